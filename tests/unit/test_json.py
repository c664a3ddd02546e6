"""`_json`'s shortcuts read a body as vLLM's `json.loads` reads it."""

from __future__ import annotations

import codecs
import json

from hypothesis import given
from hypothesis import strategies as st

from vllm_nvext import _json

# The bytes json.detect_encoding looks at: BOMs, NULs, and what JSON text starts with.
BYTES = st.sampled_from([0, 0xEF, 0xBB, 0xBF, 0xFE, 0xFF, ord("{"), ord(" "), ord('"'), ord("a"), 0x80])
BOMS = [codecs.BOM_UTF8, codecs.BOM_UTF16_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF32_LE]


@given(head=st.lists(BYTES, max_size=6).map(bytes), bom=st.sampled_from([b"", *BOMS]))
def test_needs_decoding_is_json_detect_encoding(head, bom):
    data = bom + head
    assert _json.needs_decoding(data) == (json.detect_encoding(data) != "utf-8")


def test_bodies_in_each_encoding_vllm_reads_are_told_from_plain_utf8():
    text = '{"nvext":{"extra_fields":["completion_token_ids"]}}'
    for encoding in ("utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"):
        assert _json.needs_decoding(text.encode(encoding)), encoding
    assert not _json.needs_decoding(text.encode("utf-8"))
    assert not _json.needs_decoding(b" \n" + text.encode())


def _vllms_object(data: bytes) -> object:
    """What vLLM's route gets from `json.loads(body)` when it is an object, else None (its own 400)."""
    try:
        decoded = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return decoded if isinstance(decoded, dict) else None


BODIES = st.sampled_from(
    [
        b'{"n":1,"stream":true}',
        b'{"prompt":[123456789012345678901234567890],"n":2}',  # beyond 64 bits: exact
        b'{"temperature":NaN,"x":1e400}',  # vLLM reads NaN and inf
        b'{"a":1,"a":2}',  # the last duplicate wins
        b'{"s":"\\ud800"}',  # a lone surrogate passes
        b"[1,2]",
        b"1",
        b"nul",
        b"{",
        b"\xff",
        b"[" * 100_000,
        '{"e":"\u00e9"}'.encode("utf-16"),
        codecs.BOM_UTF8 + b'{"n":2}',
    ]
)


@given(body=BODIES | st.binary(max_size=12) | st.text(max_size=12).map(str.encode))
def test_a_body_is_the_object_vllm_decodes(body):
    """`object_as_vllm` (`loads_as_vllm` inline) gives what vLLM's `json.loads` gives, or None where vLLM refuses."""
    got, want = _json.object_as_vllm(body), _vllms_object(body)
    assert repr(got) == repr(want)  # NaN: compared by its text
    if want is not None:
        assert repr(_json.loads_as_vllm(body)) == repr(want)

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

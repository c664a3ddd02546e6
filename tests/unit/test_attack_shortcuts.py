"""Attacks on the byte-level shortcuts (issue #28): each input must get the general path's bytes, or be declined.

The shortcuts: the plain-chunk scanner, both twins (`outbound.plain.plain_chunk`, `_speedups.plain_chunk`: a
plain event is one orjson writes back byte for byte, and the two give the same answer), the plain unary body
(`outbound/unary.py`), the first and finish chunks of a stream (`outbound/finish.py`), and the kept nvext
readings and plans (`inbound/nvext_schema.read_nvext`, `inbound/request.plan`). Each attack is compared with
the general path: a decode and `reshape_unary`, the decoding `DecodingStreamReshaper`, the plan made with
nothing kept.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.kernels import kernels_for
from tests.unit.test_metrics import counted_since, scrape
from tests.unit.test_request_fidelity import BASE, _made_anew, _outcome
from tests.unit.test_stream_finish import _both, _finish_at, _recording
from tests.unit.test_stream_layouts import _events, _first_difference, _plan
from tests.unit.test_stream_send import _general as _stream_general
from tests.unit.test_stream_send import _through_send
from tests.unit.test_unary import _general
from tests.unit.test_unary_plain import PLAIN, _reshaped, _trio_plan
from vllm_nvext import Mode, metrics
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.kernels import Kernels
from vllm_nvext.protocol import Endpoint

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS
STREAMS = ["chat_stream_ids_long", "completions_stream_ids_long"]
COMPILED = pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])


# --- the scanner, both twins: whatever it calls plain, orjson writes back byte for byte ---------------

# Bytes that make JSON not plain, or not JSON: escapes, whitespace, number spellings, control bytes,
# non-ASCII, structure cut short.
NOISE = [b"\\", b'"', b" ", b"\t", b"\r\n", b"\n", b"\x00", b"\x7f", b"\xc3\xa9", b"\xff", b"-0", b"1e5", b"1.0",
         b"0", b"00", b",", b":", b"{", b"}", b"[", b"]", b"null", b"tru", b"\\u00e9", b"\\/", b"1234567890123456",
         b'"choices":', b'"token_ids":', b'"nvext":', b'"index":0']  # fmt: skip
PLAIN_JSON: st.SearchStrategy[Any] = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(10**16), 10**16),
        st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=5),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(
            st.sampled_from(["choices", "token_ids", "index", "nvext", "prompt_token_ids", "a", ""]), inner, max_size=3
        ),  # fmt: skip
    ),
    max_leaves=12,
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    root=st.dictionaries(st.sampled_from(["choices", "prompt_token_ids", "nvext", "id", "x"]), PLAIN_JSON, max_size=4),
    choice=st.dictionaries(
        st.sampled_from(["index", "token_ids", "prompt_token_ids", "finish_reason", "text"]), PLAIN_JSON, max_size=5
    ),  # fmt: skip
    edits=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(NOISE), st.booleans()), max_size=3),
    cut=st.one_of(st.none(), st.integers(1, 40)),
)
def test_a_chunk_the_scanner_calls_plain_is_one_orjson_writes_back_byte_for_byte(kernels, root, choice, edits, cut):
    """Plain (`plain_chunk` answers spans): decoding and encoding it again gives its own bytes,
    so no escape, whitespace, number spelling, control byte or key twice got through; and each span
    holds the value of the key it names."""
    event = _event(root, choice, edits, cut)
    body = event[len(b"data: ") : -2]
    spans = kernels.plain_chunk(event)
    if spans is None:
        return
    assert orjson.dumps(orjson.loads(body)) == body, "the scanner called plain what orjson writes otherwise"
    obj = orjson.loads(body)
    n, root_prompt, root_prompt_end, nvext, nvext_end, index, index_end, ids, ids_end, prompt, prompt_end = spans[:11]
    fin, fin_end = spans[11:]
    choices = obj.get("choices")
    assert n == (len(choices) if isinstance(choices, list) else -1)
    first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    for owner, key, start, end in ((obj, "prompt_token_ids", root_prompt, root_prompt_end),
                                   (obj, "nvext", nvext, nvext_end), (first, "index", index, index_end),
                                   (first, "token_ids", ids, ids_end), (first, "prompt_token_ids", prompt, prompt_end),
                                   (first, "finish_reason", fin, fin_end)):  # fmt: skip
        if key in owner:
            assert orjson.loads(event[start:end]) == owner[key], key
        else:
            assert (start, end) == (-1, -1), key


def _event(root: dict[str, Any], choice: dict[str, Any], edits: list[Any], cut: int | None) -> bytes:
    """A chunk of `root` with `choice` as its only choice (unless `root` has `choices`), then edited with noise."""
    root.setdefault("choices", [choice])
    body = orjson.dumps(root)
    for where, noise, overwrite in edits:
        at = int(where * len(body))
        body = body[:at] + noise + body[at + len(noise) if overwrite else at :]
    if cut is not None:
        body = body[: max(len(body) - cut, 1)]
    return b"data: " + body + b"\n\n"


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    root=st.dictionaries(st.sampled_from(["choices", "prompt_token_ids", "nvext", "id", "x"]), PLAIN_JSON, max_size=4),
    choice=st.dictionaries(
        st.sampled_from(["index", "token_ids", "prompt_token_ids", "finish_reason", "text"]), PLAIN_JSON, max_size=5
    ),  # fmt: skip
    edits=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(NOISE), st.booleans()), max_size=3),
    cut=st.one_of(st.none(), st.integers(1, 40)),
)
def test_the_scanners_twins_give_the_same_answer(root, choice, edits, cut):
    """`outbound.plain.plain_chunk` and `_speedups.plain_chunk` answer every event alike: None, or the same spans."""
    event = _event(root, choice, edits, cut)
    assert kernels_for("python").plain_chunk(event) == kernels_for("c").plain_chunk(event)


DEEP = b'data: {"a":' + b"[" * 17 + b"]" * 17 + b"}\n\n"  # nested deeper than the scanner reads
WIDE = b"data: {" + b",".join(b'"k%d":0' % i for i in range(65)) + b"}\n\n"  # more keys than it compares


@pytest.mark.parametrize(
    "event",
    [b"", b"data: {", b"data: {}\n", b"data: {}\r\n\r\n", b"data:{}\n\n", b"data: {}}\n\n", b'data: {"a":1}{}\n\n',
     b'data: {"a":1}\n\ndata: {"b":2}\n\n', b'data: {"a":"\x00"}\n\n', b'data: {"a":[1,]}\n\n',
     b'data: {"a":-}\n\n', b'data: {"a":nul}\n\n', b'data: {"a" :1}\n\n', b'data: {"a":1,}\n\n',
     DEEP, WIDE,
     b'data: {"choices":{}}\n\n', b'data: {"choices":[1]}\n\n', b'data: {"choices":[{},2]}\n\n'],
    ids=lambda e: repr(e[:24]),
)  # fmt: skip
def test_the_scanner_declines_what_is_not_one_plain_data_event(kernels, event):
    assert kernels.plain_chunk(event) is None


def test_the_scanner_refuses_anything_but_bytes(kernels):
    with pytest.raises(TypeError):
        kernels.plain_chunk(bytearray(b'data: {"a":1}\n\n'))


# --- the plain unary body: the general path's bytes, status and error --------------------------------


def _unary_outcome(make: Any) -> Any:
    try:
        return make()
    except ValueError:
        return "not JSON"


def _edit(name: str) -> dict[str, bytes]:
    body = _recording_body(name)
    text = b'"content":"' if b'"content":"' in body else b'"text":"'
    return {
        "a key's bytes in the text": body.replace(text, text + b"token_ids choices nvext kv_transfer_params ", 1),
        "an escaped key in the text": body.replace(text, text + b'\\"token_ids\\":[9],\\"nvext\\":1 ', 1),
        "a NUL byte in the text": body.replace(text, text + b"\x00", 1),
        "a tab in the text": body.replace(text, text + b"\t", 1),
        "bytes that are not UTF-8": body.replace(text, text + b"\xff", 1),
        "a lone surrogate": body.replace(text, text + b"\\ud800", 1),
        "an escaped slash": body.replace(text, text + b"\\/", 1),
        "a trailing newline": body + b"\n",
        "leading whitespace": b" " + body,
        "cut short": body[:-3],
        "a second document": body + body,
        "-0 as created": body.replace(b'"created":', b'"created":-0,"x":', 1),
        "a 16-digit id": body.replace(b'"token_ids":[', b'"token_ids":[1234567890123456,', 1),
        "ids that are not ids": body.replace(b'"token_ids":[', b'"token_ids":[true,"a",null,[1],', 1),
        "a choice-level nvext": body.replace(b'"index":0,', b'"index":0,"nvext":{"a":1},', 1),
        "a nested kv_transfer_params": body.replace(b'"index":0,', b'"index":0,"kv_transfer_params":{"a":1},', 1),
        "an id 64 bits wide": body.replace(b'"token_ids":[', b'"token_ids":[18446744073709551615,', 1),
    }


def _recording_body(name: str) -> bytes:
    from tests.recorded import recordings

    return recordings()[name].body


@COMPILED
@pytest.mark.parametrize("name", PLAIN)
def test_an_unusual_unary_body_gets_the_general_paths_bytes_or_the_same_refusal(name, compiled):
    plan = _trio_plan(name)
    checked = 0
    for label, body in _edit(name).items():
        got = _unary_outcome(lambda b=body: _reshaped(b, plan, compiled))
        assert got == _unary_outcome(lambda b=body: _general(b, plan)), label
        checked += 1
    assert checked == len(_edit(name))


# --- the first and finish chunks of a stream ---------------------------------------------------------


def _stream(name: str) -> tuple[Any, list[bytes], int]:
    rec = _recording(name, "0.33")
    events = _events(rec.body)
    return _plan(rec, Mode.NVEXT, ["completion_token_ids"]), events, _finish_at(events)


def _text_key(event: bytes) -> bytes:
    return b'"content":"' if b'"content":"' in event else b'"text":"'


# Edits of a first or finish chunk whose bytes the general path changes or refuses: the shortcut must
# decline each (or give the same bytes).
CHUNK_EDITS: dict[str, Any] = {
    "CRLF framing": lambda e: e[:-2] + b"\r\n\r\n",
    "a CR in the text": lambda e: e.replace(_text_key(e), _text_key(e) + b"\\r", 1),
    "an escaped quote at the text's end": lambda e: e.replace(_text_key(e), _text_key(e) + b'a\\"', 1),
    "an escaped backslash at the text's end": lambda e: e.replace(_text_key(e), _text_key(e) + b"a\\\\", 1),
    "a key's bytes in the text": lambda e: e.replace(_text_key(e), _text_key(e) + b"token_ids finish_reason ", 1),
    "whitespace after a colon": lambda e: e.replace(b'"token_ids":', b'"token_ids": ', 1),
    "a 16-digit id": lambda e: e.replace(b'"token_ids":[', b'"token_ids":[1234567890123456,', 1),
    "-0 as an id": lambda e: e.replace(b'"token_ids":[', b'"token_ids":[-0,', 1),
    "a float after the ids": lambda e: e.replace(b"]}],", b'],"x":1.0}],', 1).replace(b"]}]}", b'],"x":1.0}]}', 1),
    "a root nvext": lambda e: e[:-3] + b',"nvext":{"a":1}}\n\n',
    "a root prompt_token_ids": lambda e: e[:-3] + b',"prompt_token_ids":[1]}\n\n',
    "a kv_transfer_params": lambda e: e[:-3] + b',"kv_transfer_params":{"a":1}}\n\n',
    "an index of 1": lambda e: e.replace(b'"index":0,', b'"index":1,', 1),
    "an index of true": lambda e: e.replace(b'"index":0,', b'"index":true,', 1),
    "a second choice": lambda e: e.replace(b"}],", b'},{"index":1}],', 1),
    "a second event in the message": lambda e: e + e,
    "a comment line before it": lambda e: b": keep-alive\n" + e,
}


@COMPILED
@pytest.mark.parametrize("which", ["first", "finish"])
@pytest.mark.parametrize("name", STREAMS)
def test_an_unusual_first_or_finish_chunk_gets_the_general_paths_bytes(name, which, compiled):
    plan, events, finish = _stream(name)
    at = 0 if which == "first" else finish
    for label, edit in CHUNK_EDITS.items():
        edited = list(events)
        edited[at] = edit(events[at])
        got, want = _both(plan, edited, compiled)
        assert got == want, f"{label}: {_first_difference(got, want)}"


# --- the armed send: the usage chunk and [DONE] it forwards as they came ---------------------------

USAGE_STREAMS = ["vllm-0.33/chat_stream_ids_kv_usage", "vllm-0.33/completions_stream_ids_kv", "chat_stream_ids"]
USAGE_EDITS: dict[str, Any] = {
    "as recorded": lambda e: e,
    "CRLF framing": lambda e: e[:-2] + b"\r\n\r\n",
    "a choices key after the empty choices": lambda e: e[:-3] + b',"x":{"choices":[1]}}\n\n',
    "two events in the message": lambda e: e + e,
    "an unterminated event": lambda e: e[:-1],
    "whitespace in the empty choices": lambda e: e.replace(b'"choices":[]', b'"choices":[ ]'),
    "not JSON after the root": lambda e: e[:-3] + b",}\n\n",
    "an error naming a field": lambda e: e[:-3] + b',"error":{"message":"bad","param":"temperature"}}\n\n',
}
DONE_EDITS = [b"data: [DONE]\r\n\r\n", b"data: [DONE]\n\ndata: [DONE]\n\n", b"data:[DONE]\n\n", b"data: [DONE]\n"]


def _usage_cases(events: list[bytes]) -> dict[str, list[bytes]]:
    usage = next(i for i, e in enumerate(events) if b'"choices":[]' in e)
    done = events.index(b"data: [DONE]\n\n")
    cases = {k: events[:usage] + [edit(events[usage])] + events[usage + 1 :] for k, edit in USAGE_EDITS.items()}
    cases.update({repr(d): events[:done] + [d] + events[done + 1 :] for d in DONE_EDITS})
    return cases


@pytest.mark.parametrize("renames", [False, True], ids=["no-error-params", "error-params"])
@pytest.mark.parametrize("name", USAGE_STREAMS)
def test_an_unusual_usage_chunk_or_done_through_the_armed_send_gets_the_general_paths_bytes_and_counts(
    name, renames, monkeypatch
):
    """The compiled and pure-Python sends forward the usage chunk and `[DONE]` as they came only when the
    general path does; the client's bytes and the reshaped-events metric are the same on every path."""
    from tests.recorded import recordings

    rec = recordings()[name]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    if renames:  # the general path may rename an error in a chunk: no usage chunk is forwarded unread
        plan = replace(plan, error_params=(("temperature", "nvext.greed_sampling"),))
    monkeypatch.setattr(metrics, "enabled", lambda: True)
    for label, events in _usage_cases(_events(rec.body)).items():
        counts = []
        for impl in ("python", "c"):
            before = scrape()
            got, reshaping = _through_send(plan, events, kernels_for(impl))
            reshaping.count_stream()
            want = _stream_general(plan, events)
            assert got == want, f"{impl}, {label}: {_first_difference(got, want)}"
            counts.append(counted_since(before))
        assert counts[0] == counts[1], f"{label}: the metrics differ by path: {counts}"


# --- kept readings and plans: a sequence of requests gets what each gets alone ----------------------


def _body(endpoint: Endpoint, nvext: Any, **root: Any) -> bytes:
    return json.dumps({**BASE[endpoint], "nvext": nvext, **root}).encode()


SEQUENCES = {
    "true then 1": [{"extra_fields": ["completion_token_ids"], "greed_sampling": True},
                    {"extra_fields": ["completion_token_ids"], "greed_sampling": 1}],
    "1 then true": [{"extra_fields": ["completion_token_ids"], "greed_sampling": 1},
                    {"extra_fields": ["completion_token_ids"], "greed_sampling": True}],
    "a salt as text then as a number": [{"cache_salt": "1"}, {"cache_salt": 1}],
    "an empty salt then none": [{"cache_salt": "", "extra_fields": ["timing"]}, {"extra_fields": ["timing"]}],
    "null then an empty nvext": [None, {}],
    "a rank then none": [{"dp_rank": 1, "extra_fields": ["completion_token_ids"]},
                         {"extra_fields": ["completion_token_ids"]}],
    "an escaped key": [{"extra_fields": ["completion_token_ids"]}, {"extra_fields": ["completion_token_ids"]}],
    "the trio then prompt ids": [{"extra_fields": ["completion_token_ids"]}, {"extra_fields": ["prompt_token_ids"]}],
}  # fmt: skip


@pytest.mark.parametrize("mode", [Mode.AUTO, Mode.NVEXT])
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS], ids=["chat", "completions"])
@pytest.mark.parametrize("case", sorted(SEQUENCES))
def test_a_request_after_another_gets_the_plan_or_refusal_it_gets_alone(case, endpoint, mode):
    bodies = [_body(endpoint, nvext, stream=True) for nvext in SEQUENCES[case]]
    if case == "an escaped key":  # the same value spelled another way: the same reading, the same plan
        bodies[1] = bodies[1].replace(b'"extra_fields"', b'"extra\\u005ffields"')
    headers = [None, b"1"]
    for body, header in zip(bodies + bodies, headers * len(bodies), strict=False):
        in_sequence = _outcome(lambda b=body, h=header: plan_request(b, endpoint, mode, dp_rank_header=h))
        alone = _made_anew(lambda b=body, h=header: plan_request(b, endpoint, mode, dp_rank_header=h))
        assert in_sequence == alone
        _outcome(lambda b=bodies[0]: plan_request(b, endpoint, mode))  # the first body's plan kept again


def test_two_bodies_of_one_kept_plan_each_reach_vllm_as_their_own():
    bodies = [_body(CHAT, {"extra_fields": ["completion_token_ids"], "greed_sampling": True}, user=u, temperature=t)
              for u, t in (("a", 0.5), ("b", None), ("c", 1))]  # fmt: skip
    plans = [_outcome(lambda b=b: plan_request(b, CHAT, Mode.NVEXT)) for b in bodies]
    alone = [_made_anew(lambda b=b: plan_request(b, CHAT, Mode.NVEXT)) for b in bodies]
    assert plans == alone
    sent = [json.loads(p.body) for p, _, _ in plans if p.body is not None]
    assert [(s["user"], s["temperature"], "nvext" in s) for s in sent] == [("a", 0.0, False), ("b", 0.0, False),
                                                                            ("c", 0.0, False)]  # fmt: skip


# --- found broken: the finish chunk's shortcut keeps bytes a decode does not -------------------------

# Bytes in the finish chunk's text that orjson reads as something it writes otherwise (an escape it
# writes unescaped), or refuses (a raw control byte, a byte that is not UTF-8, a lone surrogate): the
# general path writes `é` and `/`, or forwards the chunk unchanged (vLLM's ids, no nvext).
TEXT_BYTES = {"an escaped e-acute": b"\\u00e9", "an escaped slash": b"\\/", "a raw NUL": b"\x00", "a raw tab": b"\t",
              "a byte that is not UTF-8": b"\xff", "a lone surrogate": b"\\ud800"}  # fmt: skip


@COMPILED
@pytest.mark.parametrize("text", sorted(TEXT_BYTES))
@pytest.mark.parametrize("name", STREAMS)
def test_a_finish_chunk_whose_text_a_decode_writes_otherwise_gets_the_general_paths_bytes(name, text, compiled):
    plan, events, finish = _stream(name)
    key = _text_key(events[finish])
    events[finish] = events[finish].replace(key, key + TEXT_BYTES[text], 1)
    got, want = _both(plan, events, compiled)
    assert got == want, _first_difference(got, want)


# A key written twice in the finish chunk after its finish reason: a decode keeps the last value at the
# first key's place; the shortcut keeps both.
TWICE = {
    "the root's model, another value": lambda e: e[:-3] + b',"model":"other"}\n\n',
    "the choice's index, null": lambda e: e.replace(b'"token_ids":', b'"index":null,"token_ids":', 1),
}


@COMPILED
@pytest.mark.parametrize("twice", sorted(TWICE))
@pytest.mark.parametrize("name", STREAMS)
def test_a_finish_chunk_with_a_key_twice_gets_the_general_paths_bytes(name, twice, compiled):
    plan, events, finish = _stream(name)
    events[finish] = TWICE[twice](events[finish])
    got, want = _both(plan, events, compiled)
    assert got == want, _first_difference(got, want)


# --- the text a splice keeps: only bytes a decode writes back as they are ---------------------------


@pytest.mark.parametrize("impl", ["python", "c"])
@pytest.mark.parametrize("text", sorted(TEXT_BYTES))
@pytest.mark.parametrize("name", STREAMS)
def test_a_mid_stream_delta_whose_text_a_decode_writes_otherwise_gets_the_general_paths_bytes(name, text, impl):
    """Deltas after the one that arms the stream, each with the bytes in its text: the armed send (compiled
    and pure-Python) serves them only as the general path writes them (é, `/`) or forwards them (refused)."""
    plan, events, finish = _stream(name)
    for at in (finish // 2, finish - 1):
        key = _text_key(events[at])
        events[at] = events[at].replace(key, key + b"a" + TEXT_BYTES[text] + b"z", 1)
    got, _ = _through_send(plan, events, kernels_for(impl))
    want = _stream_general(plan, events)
    assert got == want, _first_difference(got, want)


def _round_trips(text: bytes) -> bool:
    try:
        return orjson.dumps(orjson.loads(b'"' + text + b'"'))[1:-1] == text
    except orjson.JSONDecodeError:
        return False


# Pieces of a JSON string's bytes: escapes orjson writes and ones it does not, raw control bytes, UTF-8
# that is not valid (a surrogate, an overlong, past U+10FFFF, cut short).
TEXT_PIECES = [b"\\\\", b"\\b", b"\\f", b"\\n", b"\\r", b"\\t", b"\\u0000", b"\\u001f", b"\\u001F", b"\\u0008",
               b"\\u000b", b"\\u00e9", b"\\u0041", b"\\/", b'\\"', b"\\", b'"', b"\\ud800", b"\\ud83d\\ude00",
               b"\xed\xa0\x80", b"\xc0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xe2\x80\xa8", b"\x7f",
               b"\x00", b"\t", b"\r", b"\n", b"\xff"]  # fmt: skip
TEXTS = st.lists(
    st.one_of(
        st.text().map(lambda s: orjson.dumps(s)[1:-1]),  # as orjson writes it
        st.text().map(lambda s: s.encode("utf-8", "surrogatepass")),  # raw, control characters and surrogates too
        st.binary(max_size=6),
        st.sampled_from(TEXT_PIECES),
    ),
    max_size=6,
).map(b"".join)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
def test_a_text_a_splice_keeps_is_one_orjson_writes_back_byte_for_byte(kernels: Kernels, text):
    """Both checks (`splice.kept_text`, the compiled one) accept a text only if a decode and an encode give its
    own bytes back, and agree; every text orjson writes back passes (escaped quotes and backslashes too)."""
    from vllm_nvext.outbound.splice import kept_text

    kept = kept_text(text, 0, len(text))
    assert kept == kernels.kept_text(text)
    same = _round_trips(text)
    assert not kept or same
    if same:
        assert kept

"""The single-choice shortcuts (outbound/finish.py) give the general path's bytes, or leave it to it.

A single-choice stream that asks for the token-id trio alone gets its finish chunk without a
decode: vLLM's copy of the ids back to null and the chunk's `nvext` (the chunk's ids, the prompt's
ids) at its end, every other byte as vLLM wrote it. Every recorded stream is compared in
test_stream_layouts.py and test_stream_send.py; here, first, delta and finish chunks laid out
with every kind of value a key may hold (decoded ones take `finish.reshape_single`), and a second
finish chunk for the same choice.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recorded import VLLM_VERSIONS, recordings
from tests.support.kernels import kernels_for
from tests.unit.test_stream_layouts import SPLICED, _events, _first_difference, _plan
from vllm_nvext import Mode
from vllm_nvext.kernels import Kernels
from vllm_nvext.outbound.decoding import DecodingStreamReshaper
from vllm_nvext.outbound.finish import finish_ids
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.outbound.splice import FinishArm, SpliceArm
from vllm_nvext.outbound.stream import StreamReshaper
from vllm_nvext.send import ReshapingSend

NAMES = ["chat_stream_ids_long", "completions_stream_ids_long", "chat_stream_ids", "completions_stream_ids"]


def _recording(name: str, vllm: str) -> Any:
    return recordings()[name if vllm == "0.32" else f"vllm-{vllm}/{name}"]


def _kernels(compiled: bool) -> Kernels:
    """The compiled kernels (skipped, or failed under VLLM_NVEXT_REQUIRE_EXTENSION, where not built), or Python's."""
    return kernels_for("c" if compiled else "python")


def _scanner(compiled: bool) -> Any:
    """The scanner (`plain_chunk`, either twin) that lets a plain first chunk skip its decode."""
    return _kernels(compiled).plain_chunk


def _both(plan: Any, events: list[bytes], compiled: bool) -> tuple[bytes, bytes]:
    kernels = _kernels(compiled)
    fast, general = StreamReshaper(plan, Clock(), kernels), DecodingStreamReshaper(plan, Clock())
    got = b"".join(fast.feed(e) for e in events) + fast.flush()
    want = b"".join(general.feed(e) for e in events) + general.flush()
    # and through the send handed to vLLM, which serves the finish chunk itself
    sent = _through_send(plan, events, kernels)
    assert sent == want, f"the {kernels.impl} send: " + _first_difference(sent, want)
    return got, want


class _Sink:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, message: Any) -> None:
        if message["type"] == "http.response.body":
            self.bodies.append(bytes(message.get("body", b"")))


def _run(awaitable: Any) -> None:
    with pytest.raises(StopIteration):
        awaitable.__await__().send(None)


def _through_send(plan: Any, events: list[bytes], kernels: Kernels) -> bytes:
    sink = _Sink()
    reshaping = ReshapingSend(plan, Clock(), sink, kernels)
    _run(
        reshaping.app_send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
        )
    )
    for event in events:
        _run(reshaping.app_send({"type": "http.response.body", "body": event, "more_body": True}))
    _run(reshaping.app_send({"type": "http.response.body", "body": b"", "more_body": False}))
    return b"".join(sink.bodies)


def _finish_at(events: list[bytes]) -> int:
    return next(i for i, e in enumerate(events) if b'"finish_reason":"' in e)


@pytest.mark.parametrize("vllm", SPLICED)
@pytest.mark.parametrize("name", NAMES)
def test_the_first_and_finish_chunks_are_not_decoded_and_carry_the_trio(name, vllm, json_decodes):
    rec = _recording(name, vllm)
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = _events(rec.body)
    reshaper = StreamReshaper(plan, Clock(), _kernels(True))
    outs = [reshaper.feed(e) for e in events]
    finish = _finish_at(events)
    assert events[finish][6:-2] not in json_decodes, "the finish chunk was decoded"
    assert events[0][6:-2] not in json_decodes, "the first chunk was decoded"
    first_ids = rec.events()[0]["choices"][0].get("token_ids", [])
    assert orjson.loads(outs[0][6:])["nvext"] == {"completion_token_ids": first_ids}
    chunk = orjson.loads(outs[finish][6:])
    vllm_ids = orjson.loads(events[finish][6:])["choices"][0]["token_ids"]
    prompt = rec.events()[0].get("prompt_token_ids") or rec.events()[0]["choices"][0].get("prompt_token_ids")
    assert chunk["nvext"] == {"completion_token_ids": vllm_ids, "prompt_token_ids": prompt}
    assert chunk["choices"][0]["token_ids"] is None, "vLLM's copy of the ids reached the client"


VALUES: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.integers(-(2**66), 2**66),
    st.text(max_size=6),
    st.text(alphabet=st.sampled_from(["a", "-", ".", " ", "/", "~"]), max_size=8),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.sampled_from([{}, [], [1], {"a": None}]),
)
KEYS = ["stop_reason", "weight_versions", "system_fingerprint", "x_y", "prompt_token_ids", "kv_transfer_params",
        "routed_experts", "logprobs", "nvext", "token_ids", "finish_reason", "index"]  # fmt: skip
IDS: st.SearchStrategy[Any] = st.one_of(
    st.lists(st.integers(0, 2**70), max_size=4), st.none(), st.just([0, 10**15 - 1, 10**15])
)


def _dumps(obj: Any) -> bytes:
    try:
        return orjson.dumps(obj)
    except TypeError:  # ids beyond 64 bits: as the general path would encode them
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_chunk_laid_out_any_way_gives_the_general_paths_bytes(compiled, data):
    vllm = data.draw(st.sampled_from(SPLICED), label="vllm")
    rec = _recording(data.draw(st.sampled_from(NAMES), label="name"), vllm)
    plan = _plan(rec, data.draw(st.sampled_from([Mode.NVEXT, Mode.BOTH, Mode.AUTO])), ["completion_token_ids"])
    events = _events(rec.body)
    at = data.draw(st.sampled_from([0, 1, _finish_at(events)]), label="chunk")  # the first, a delta, the finish
    chunk = orjson.loads(events[at][6:])
    choice = chunk["choices"][0]
    owners = [choice, chunk] + ([choice["delta"]] if isinstance(choice.get("delta"), dict) else [])
    for owner in owners:
        for key in data.draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True), label="keys"):
            owner[key] = data.draw(VALUES, label=key)
    if data.draw(st.booleans(), label="other ids"):
        choice["token_ids"] = data.draw(IDS, label="ids")
    if data.draw(st.booleans(), label="other prompt ids"):
        (chunk if "prompt_token_ids" in chunk else choice)["prompt_token_ids"] = data.draw(IDS, label="prompt ids")
    if at:
        reasons = ["length", "stop", "tool_calls", "x y", ""] if at > 1 else [None, "stop"]
        choice["finish_reason"] = data.draw(st.sampled_from(reasons), label="reason")
    events[at] = b"data: " + _dumps(chunk) + b"\n\n"
    got, want = _both(plan, events, compiled)
    assert got == want, _first_difference(got, want)


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@pytest.mark.parametrize("vllm", VLLM_VERSIONS)
def test_a_second_finish_chunk_for_the_same_choice_is_treated_as_the_general_path_treats_it(vllm, compiled):
    rec = _recording("chat_stream_ids_long", vllm)
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = _events(rec.body)
    finish = _finish_at(events)
    events.insert(finish + 1, events[finish])
    got, want = _both(plan, events, compiled)
    assert got == want, _first_difference(got, want)
    assert got.count(b'"prompt_token_ids":[') == 1, "the prompt's ids must be reported once, on the first finish"


JSON: st.SearchStrategy[Any] = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(allow_nan=False), st.text(max_size=5)),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)),
    max_leaves=12,
)


@settings(max_examples=500, deadline=None)
@given(value=st.dictionaries(st.sampled_from(["a", "choices", "nvext", "b_c", "é"]), JSON, max_size=4))
def test_the_scanner_accepts_only_json_that_orjson_writes_back_byte_for_byte(value):
    payload = _dumps(value)
    if _scanner(True)(b"data: " + payload + b"\n\n") is not None:
        assert orjson.dumps(orjson.loads(payload)) == payload


@pytest.mark.parametrize(
    "payload",
    [b'{"a":1,"a":2}', b'{"a":1.0}', b'{"a":-0}', b'{"a":1e5}', b'{"a": 1}', b'{"a":"\\/"}', b'{"a":"\\u00e9"}',
     b'{"a":"\xc3\xa9"}', b'{"a":01}', b'{"a":1234567890123456}', b'{"a":[1,]}', b'{"a":nul}', b'{"a":1}x',
     b'{"choices":{}}', b'{"choices":[1]}', b'[1]', b'{"a":' + b"[" * 20 + b"]" * 20 + b"}"],
)  # fmt: skip
def test_the_scanner_refuses_what_a_decode_would_write_otherwise(payload):
    assert _scanner(True)(b"data: " + payload + b"\n\n") is None


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@pytest.mark.parametrize("value", [None, 0, {"remote_block_ids": [1]}])
@pytest.mark.parametrize("key", ["kv_transfer_params", "prompt_token_ids"])
def test_a_key_the_finish_moves_before_choices_is_moved_as_the_general_path_moves_it(key, value, compiled):
    # vLLM writes kv_transfer_params after `choices`; a layout that writes it (or the prompt's ids) before
    # `choices` on every chunk must still see it moved into the finish chunk's nvext (docs/protocol.md §3.4)
    rec = _recording("chat_stream_ids_long", "0.32")
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    name = b'"' + key.encode() + b'":'
    member = name + orjson.dumps(value) + b","
    events = [e if name in e else e.replace(b'"choices":[', member + b'"choices":[', 1) for e in _events(rec.body)]
    got, want = _both(plan, events, compiled)
    assert got == want, _first_difference(got, want)


def _armed_parts(rec: Any, events: list[bytes]) -> tuple[bytes, bytes, int]:
    """The prefix, finish head and root end the stream's splice serves its finish chunk with."""
    reshaper = StreamReshaper(_plan(rec, Mode.NVEXT, ["completion_token_ids"]), Clock())
    for event in events[:3]:
        reshaper.feed(event)
    splice = reshaper.splice
    assert splice is not None and splice.finish_head is not None
    return splice.prefix, splice.finish_head, len(reshaper.root)


def _compiled_finish_ids() -> Any:
    return _kernels(True).finish_ids  # skips, or fails under VLLM_NVEXT_REQUIRE_EXTENSION, where not built


@pytest.mark.parametrize("vllm", SPLICED)
@pytest.mark.parametrize("name", NAMES)
def test_the_two_finish_scanners_agree_on_every_recorded_finish_chunk(name, vllm):
    rec = _recording(name, vllm)
    events = _events(rec.body)
    parts = _armed_parts(rec, events)
    twin = _compiled_finish_ids()
    for event in events:
        assert twin(event, *parts) == finish_ids(event, *parts), f"{name}: the scanners differ on {event!r}"
    assert finish_ids(events[_finish_at(events)], *parts) is not None, "the recorded finish chunk is served"


_PIECES = [b"", b",", b'"', b"0", b"01", b"-1", b"1234567890123456", b"[", b"]", b"}", b"null", b"\\", b"\n",
           b'"a":', b',"x":1', b',"x":null', b',"token_ids":[1]', b',"index":0', b',"stop_reason":"a b"',
           b"\xc3\xa9", b"}]", b"\n\n", b"a", b'"finish_reason":"stop"', b',"nvext":null',
           b',"prompt_token_ids":null']  # fmt: skip


@settings(max_examples=1500, deadline=None)
@given(data=st.data())
def test_the_two_finish_scanners_agree_on_any_finish_chunk(data):
    rec = _recording(data.draw(st.sampled_from(NAMES), label="name"), data.draw(st.sampled_from(SPLICED)))
    events = _events(rec.body)
    prefix, head, root_end = _armed_parts(rec, events)
    event = events[_finish_at(events)]
    chunk = orjson.loads(event[6:])
    choice = chunk["choices"][0]
    for owner in (choice, chunk):
        for key in data.draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True), label="keys"):
            owner[key] = data.draw(VALUES, label=key)
    if data.draw(st.booleans(), label="other ids"):
        choice["token_ids"] = data.draw(IDS, label="ids")
    if data.draw(st.booleans(), label="relaid"):
        event = b"data: " + _dumps(chunk) + b"\n\n"
    for _ in range(data.draw(st.integers(0, 3), label="edits")):  # bytes no encoder writes
        at = data.draw(st.integers(0, len(event)), label="at")
        cut = data.draw(st.integers(0, 3), label="cut")
        event = event[:at] + data.draw(st.sampled_from(_PIECES), label="piece") + event[at + cut :]
    twin = _compiled_finish_ids()
    assert twin(event, prefix, head, root_end) == finish_ids(event, prefix, head, root_end), repr(event)


_FAR_ROOT_ENDS = [(1 << 63) - 1, (1 << 63) - 11, (1 << 63) - 12, 1 << 62]


def test_a_root_end_past_the_chunk_serves_no_finish_chunk():
    """A root end past the chunk's end, however far (sizes near the largest Py_ssize_t included), serves
    nothing: the compiled scanner and the compiled send agree with `finish_ids` instead of reading far past
    the chunk (a crash). Run in a child process, which such a read kills."""
    rec = _recording("chat_stream_ids", "0.33")
    events = _events(rec.body)
    prefix, head, _ = _armed_parts(rec, events)
    finish = events[_finish_at(events)]
    _compiled_finish_ids()
    for root_end in _FAR_ROOT_ENDS:
        assert finish_ids(finish, prefix, head, root_end) is None
    script = f"""
from vllm_nvext import _speedups
from vllm_nvext.outbound.splice import FinishArm, SpliceArm
event, prefix, head = {finish!r}, {prefix!r}, {head!r}
print([_speedups.finish_ids(event, prefix, head, r) for r in {_FAR_ROOT_ENDS!r}])
for r in {_FAR_ROOT_ENDS!r}:
    general, downstream = [], []
    send = _speedups.StreamSend(general.append, downstream.append)
    finish = FinishArm(head, r, lambda event, start, end: b"{{}}")
    send.arm(1 << 62, None, SpliceArm(prefix, b"x", b"y", b"", True, True, None, b"", finish))
    send({{"type": "http.response.body", "body": event, "more_body": True}})
    print(len(general), len(downstream))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the compiled finish scanner crashed: {done.returncode} {done.stderr[-2000:]}"
    assert done.stdout.split("\n")[:-1] == [str([None] * len(_FAR_ROOT_ENDS))] + ["1 0"] * len(_FAR_ROOT_ENDS)


def test_a_finish_chunk_the_send_cannot_record_goes_to_the_general_path(kernels):
    """Neither send raises into vLLM's stream: a finish chunk whose owner (`ChunkReshaper.finish_first_choice`)
    fails to record it, or has recorded one already (None), goes to the general path; a second finish chunk is
    never served."""
    rec = _recording("chat_stream_ids_long", "0.33")
    events = _events(rec.body)
    prefix, head, root_end = _armed_parts(rec, events)
    finish = events[_finish_at(events)]
    general: list[bytes] = []
    downstream: list[bytes] = []

    def broken(event: bytes, start: int, end: int) -> bytes | None:
        raise RuntimeError("a bug")

    def recorded(event: bytes, start: int, end: int) -> bytes | None:
        return b'{"completion_token_ids":' + event[start:end] + b"}"

    for record in (broken, lambda event, start, end: None, recorded):
        send, arm, _, _ = kernels.stream_send(
            lambda m: general.append(m["body"]), lambda m: downstream.append(m["body"])
        )
        arm(1 << 62, None, SpliceArm(prefix, b"x", b"y", b"", True, True, None, b"", FinishArm(head, root_end, record)))
        send({"type": "http.response.body", "body": finish, "more_body": True})
        send({"type": "http.response.body", "body": finish, "more_body": True})  # a second one: never served
    assert general == [finish] * 5 and len(downstream) == 1, "only the recordable finish chunk was served, once"
    span = finish_ids(finish, prefix, head, root_end)
    assert span is not None
    start, end = span
    nvext = b',"nvext":{"completion_token_ids":' + finish[start:end] + b"}}\n\n"
    assert downstream == [finish[:start] + b"null" + finish[end:-3] + nvext], "the finish chunk's bytes"


@pytest.mark.parametrize("finish_decoded", [False, True], ids=["byte-level finish", "decoded finish"])
@pytest.mark.parametrize("name", NAMES)
def test_long_prompt_ids_reach_the_finish_chunk_as_the_general_path_writes_them(name, finish_decoded, json_decodes):
    # The plain first chunk's prompt ids are kept as vLLM wrote them (prompt_ids.PromptIds.keep_prompt_json) and
    # copied into the finish chunk's nvext; a finish chunk that is decoded reads them decoded.
    rec = _recording(name, "0.33")
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = _events(rec.body)
    first = orjson.loads(events[0][6:])
    owner = first if "prompt_token_ids" in first else first["choices"][0]
    owner["prompt_token_ids"] = [(i * 7919) % 10**15 for i in range(4000)]
    events[0] = b"data: " + orjson.dumps(first) + b"\n\n"
    finish = _finish_at(events)
    if finish_decoded:  # a float the byte-level finish never copies
        events[finish] = events[finish].replace(b'"finish_reason":', b'"x_y":1.5,"finish_reason":', 1)
    fast = StreamReshaper(plan, Clock(), _kernels(True))
    got = b"".join(fast.feed(e) for e in events) + fast.flush()
    decoded = [d for d in json_decodes if len(d) > 4000]
    assert len(decoded) == finish_decoded, "the prompt's ids were decoded though only their bytes were copied"
    general = DecodingStreamReshaper(plan, Clock())
    want = b"".join(general.feed(e) for e in events) + general.flush()
    assert got == want, _first_difference(got, want)
    assert orjson.loads(got.split(b"\n\n")[finish][6:])["nvext"]["prompt_token_ids"] == owner["prompt_token_ids"]


def test_a_delta_is_served_by_the_splice_it_matched_even_if_the_send_is_armed_anew_meanwhile(kernels):
    """A send reports a delta's ids (`on_ids`) while it serves the delta: a call back that arms the send
    anew (other parts) changes later deltas, never the bytes of the one it was called for (both sends)."""
    rec = _recording("chat_stream_ids_long", "0.33")
    events = _events(rec.body)
    reshaper = StreamReshaper(_plan(rec, Mode.NVEXT, ["completion_token_ids"]), Clock())
    for event in events[:3]:
        reshaper.feed(event)
    parts = reshaper.arm_parts()
    assert parts is not None
    delta = events[4]
    expected = StreamReshaper(_plan(rec, Mode.NVEXT, ["completion_token_ids"]), Clock())
    for event in events[:4]:
        expected.feed(event)
    want = expected.feed(delta)
    downstream: list[bytes] = []
    send, arm, _, _ = kernels.stream_send(lambda m: None, lambda m: downstream.append(m["body"]))
    other = parts._replace(mid=b"OTHER" * 40, strip=not parts.strip, trio=not parts.trio, on_ids=None)

    def rearm(event: bytes, start: int, end: int) -> None:
        arm(1 << 62, None, other)
        gc.collect()

    arm(1 << 62, None, parts._replace(on_ids=rearm))
    send({"type": "http.response.body", "body": delta, "more_body": True})
    assert downstream == [want], "the delta's bytes are the splice's it matched"

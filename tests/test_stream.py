"""Stream reshaping, bytes in and bytes out: every shortcut gives the bytes of the general path."""

from __future__ import annotations

import json

import pytest

from vllm_nvext import Mode
from vllm_nvext import stream as stream_module
from vllm_nvext.request import plan_request
from vllm_nvext.response import Clock
from vllm_nvext.stream import StreamReshaper

from .recorded import recordings

STREAMS = sorted(n for n, r in recordings().items() if r.stream and "n2" not in n)
SELECTOR_SETS = [
    ["completion_token_ids"],
    ["completion_token_ids", "engine_data"],
    ["prompt_token_ids"],
    ["engine_data"],
    ["timing", "stop_reason", "detailed_finish_reason"],
]


def _events(body: bytes) -> list[bytes]:
    return [b + b"\n\n" for b in body.split(b"\n\n") if b.startswith(b"data: {")]


def _run(reshaper: StreamReshaper, events: list[bytes]) -> list[dict]:
    out = []
    for raw in events:
        new = reshaper.reshape_event(raw)
        assert (new or raw).startswith(b"data: {") and (new or raw).endswith(b"}\n\n")
        event = json.loads((new or raw)[6:])
        event.get("nvext", {}).pop("timing", None)  # wall-clock values differ run to run
        out.append(event)
    return out


@pytest.mark.parametrize("selectors", SELECTOR_SETS, ids="+".join)
@pytest.mark.parametrize("mode", [Mode.NVEXT, Mode.BOTH, Mode.AUTO])
@pytest.mark.parametrize("name", STREAMS)
def test_byte_level_path_equals_decoding_every_chunk(name, mode, selectors, monkeypatch):
    rec = recordings()[name]
    request = {**rec.request, "nvext": {"extra_fields": selectors}}
    plan = plan_request(json.dumps(request).encode(), rec.endpoint, mode)
    assert plan is not None
    events = _events(rec.body)
    fast = _run(StreamReshaper(plan, Clock()), events)
    monkeypatch.setattr(StreamReshaper, "reshape_event", StreamReshaper._decoded_event)
    slow = _run(StreamReshaper(plan, Clock()), events)
    assert fast == slow


def test_byte_level_path_serves_mid_stream_deltas(monkeypatch):
    rec = recordings()["chat_stream_ids_long"]
    plan = plan_request(
        json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids"]}}).encode(),
        rec.endpoint,
        Mode.NVEXT,
    )
    reshaper = StreamReshaper(plan, Clock())
    events = _events(rec.body)
    reshaper.reshape_event(events[0])
    delta = events[5]
    decoded = []
    monkeypatch.setattr(stream_module._json, "loads", lambda data: decoded.append(data) or json.loads(data))
    out = reshaper.reshape_event(delta)
    assert decoded == [] and isinstance(out, bytes), "a plain delta chunk must not need a decode"
    # everything vLLM wrote outside the changed spans is kept byte for byte
    assert out.startswith(delta[: delta.index(b',"token_ids":')])


def test_key_lookalikes_inside_text_are_not_matched():
    rec = recordings()["chat_stream_ids"]
    plan = plan_request(
        json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids"]}}).encode(),
        rec.endpoint,
        Mode.NVEXT,
    )
    events = _events(rec.body)
    event = json.loads(events[2][6:])
    event["choices"][0]["delta"]["content"] = ',"token_ids":[9,9],"finish_reason":null,"nvext":{}}'
    tricky = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    reshaper = StreamReshaper(plan, Clock())
    reshaper.reshape_event(events[0])
    got = json.loads(reshaper.reshape_event(tricky)[6:])
    assert got["choices"][0]["delta"]["content"] == event["choices"][0]["delta"]["content"]
    assert got["nvext"]["completion_token_ids"] == event["choices"][0]["token_ids"]
    assert got["choices"][0]["token_ids"] is None


def _timing_free(body: bytes) -> list[dict]:
    out = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: {"):
            event = json.loads(block[6:])
            event.get("nvext", {}).pop("timing", None)  # wall-clock values differ run to run
            out.append(event)
        elif block:
            out.append({"raw": block.decode()})
    return out


@pytest.mark.parametrize("selectors", SELECTOR_SETS, ids="+".join)
@pytest.mark.parametrize("name", STREAMS)
def test_feeding_whole_events_equals_feeding_split_bytes(name, selectors):
    """The single-event shortcut in `feed` gives the bytes the framer gives for any split."""
    rec = recordings()[name]
    request = {**rec.request, "nvext": {"extra_fields": selectors}}
    plan = plan_request(json.dumps(request).encode(), rec.endpoint, Mode.NVEXT)
    assert plan is not None
    whole = StreamReshaper(plan, Clock())
    by_event = b"".join(whole.feed(e) for e in _events(rec.body) + [b"data: [DONE]\n\n"]) + whole.flush()
    split = StreamReshaper(plan, Clock())
    pieces = [rec.body[i : i + 7] for i in range(0, len(rec.body), 7)]
    by_piece = b"".join(split.feed(p) for p in pieces) + split.flush()
    assert by_event.endswith(b"data: [DONE]\n\n") and rec.body.endswith(b"data: [DONE]\n\n")
    assert _timing_free(by_event) == _timing_free(by_piece)


def test_unterminated_tail_is_flushed_as_it_came():
    rec = recordings()["chat_stream_ids"]
    plan = plan_request(
        json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids"]}}).encode(),
        rec.endpoint,
        Mode.NVEXT,
    )
    stream = StreamReshaper(plan, Clock())
    assert stream.feed(b"data: {\"partial") == b""
    assert stream.buffered == len(b"data: {\"partial")
    assert stream.flush() == b"data: {\"partial" and stream.buffered == 0

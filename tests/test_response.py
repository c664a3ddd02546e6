"""Stream reshaping: the byte-level delta path says exactly what decoding the chunk says."""

from __future__ import annotations

import json

import pytest

from vllm_nvext import Mode
from vllm_nvext import response as response_module
from vllm_nvext.request import plan_request
from vllm_nvext.response import Clock, StreamReshaper

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
    monkeypatch.setattr(response_module._json, "loads", lambda data: decoded.append(data) or json.loads(data))
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

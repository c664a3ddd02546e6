"""Capture of a client that asked for ids itself (docs/capture.md): it gets them as it asked, and the
turn is recorded all the same (found by tests/e2e/test_capture_fleet.py: a unary answer in vLLM's
placement went out untouched, past the tap). And a captured stream's bytes, read by the tap in bulk,
give the turn its decoded chunks give one by one."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import CHAT, COMPLETIONS, sse_events
from tests.recorded import recording, recordings
from tests.unit.asgi import Upstream, call
from tests.unit.test_capture_tap import ID_CASES, JSON, _app, _turns
from vllm_nvext.capture import tap as tap_module
from vllm_nvext.capture.keys import header_key
from vllm_nvext.capture.record import Turn
from vllm_nvext.capture.tap import Collector


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
@pytest.mark.parametrize("name", ID_CASES)
async def test_a_client_that_asks_for_ids_gets_them_and_its_turn_is_recorded(name, pure, tmp_path):
    rec = recording(name)
    assert rec.request.get("return_token_ids") is True, "the client asks vLLM for ids"
    upstream = Upstream(content_type=rec.content_type, body=rec.body, cuts=(7, 200))
    app = _app(upstream, tmp_path, pure_python=pure)
    headers = (JSON, (b"x-nvext-session-id", b"asked"))
    result = await call(app, rec.path, json.dumps(rec.request).encode(), headers=headers)
    assert result.status == 200
    if rec.stream:
        sent = rec.events()
        assert sse_events(result.body) == sent, "vLLM's placement, as vLLM sent it"
        completion = [i for e in sent for c in e["choices"] if c["index"] == 0 for i in c.get("token_ids") or []]
        request_id = sent[0]["id"]
    else:
        sent = rec.json()
        assert json.loads(result.body) == sent, "vLLM's placement, as vLLM sent it"
        completion, request_id = sent["choices"][0]["token_ids"], sent["id"]
    (turn,) = _turns(app)
    record = turn.to_json()
    assert (record["session_id"], record["request_id"]) == ("asked", request_id)
    assert record["completion_token_ids"] == completion and record["prompt_token_ids"]


# --- a stream's bytes, read in bulk (tap.Collector.stream_bytes) -------------------------------------------

STREAMS = sorted(n for n, r in recordings().items() if r.stream and r.path in (CHAT, COMPLETIONS))


class _Sink:
    def __init__(self) -> None:
        self.turns: list[Turn] = []

    def submit(self, turn: Turn) -> None:
        self.turns.append(turn)


def _turn_of(feed: Callable[[Collector], None]) -> dict[str, Any]:
    sink = _Sink()
    tap = Collector(sink, CHAT, header_key([(b"x-nvext-session-id", b"s")]), 1.0)
    feed(tap)
    tap.finish()
    tap.finish()  # once
    (turn,) = sink.turns
    return turn.to_json()


@pytest.mark.parametrize("read_every", [1, 97, tap_module.STREAM_READ_BYTES])
@pytest.mark.parametrize("name", STREAMS)
def test_a_streams_bytes_read_in_bulk_give_the_turn_its_chunks_give(name, read_every, monkeypatch):
    """Whatever the cuts between body messages and however often the held bytes are read: the turn the
    decoded chunks give one by one (CRLF framing and a comment line too)."""
    rec = recording(name)
    monkeypatch.setattr(tap_module, "STREAM_READ_BYTES", read_every)
    body = rec.body.replace(b"\n\n", b"\r\n\r\n", 1) + b": a comment\n\n"
    cuts = range(0, len(body), 61)

    def in_bulk(tap: Collector) -> None:
        for start in cuts:
            tap.stream_bytes(body[start : start + 61])

    def by_chunk(tap: Collector) -> None:
        for event in rec.events():
            tap.chunk(event)

    assert _turn_of(in_bulk) == _turn_of(by_chunk)


def test_a_stream_that_sent_nothing_readable_is_no_turn():
    sink = _Sink()
    tap = Collector(sink, CHAT, header_key([]), 1.0)
    tap.stream_bytes(b'data: {"error": {"message": "no"}}\n\ndata: not json\n\ndata: [DONE]\n\ndata: {"id"')
    tap.finish()
    assert sink.turns == []

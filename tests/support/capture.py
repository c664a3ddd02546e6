"""Turns as the request path makes them (before the store places them), for the capture tests."""

from __future__ import annotations

import threading
from typing import Any

from vllm_nvext.capture.record import Turn
from vllm_nvext.capture.store import Sink


def make_turn(session: str, prompt: list[int] | None, completion: list[int] | None = None, **kw: Any) -> Turn:
    fields: dict[str, Any] = {
        "session_id": session,
        "route": "/v1/chat/completions",
        "request_id": f"chatcmpl-{session}-{len(prompt or [])}",
        "time": 1_700_000_000.0,
        "session_source": "x-nvext-session-id",
        "model": "tiny",
        "finish_reason": "length",
    }
    fields.update(kw)
    return Turn(prompt_token_ids=prompt, completion_token_ids=completion, **fields)


def hold_writer(sink: Sink) -> threading.Event:
    """The store's writer thread held before each write until the returned gate is set (a writer behind)."""
    gate, write = threading.Event(), sink.backend.write

    def held_write(turns: Any, now: float) -> None:
        gate.wait(10)
        write(turns, now)

    sink.backend.write = held_write  # type: ignore[method-assign]
    return gate

"""The capture's mount in the server: its sink opened at start-up (`open_capture`), its queue written out at
shutdown (`closing_capture`). The request path hands the sink turns; the read API (sessions.py) reads it.
docs/capture.md.
"""

from __future__ import annotations

import contextlib

from .. import metrics
from ..asgi_types import Message, Send
from ..capture import api as capture_api
from ..capture.store import Sink, open_sink
from ..config import Settings


def open_capture(settings: Settings) -> Sink | None:
    """The capture sink the settings name (docs/capture.md), opened at start-up; None when capture is off.
    Closed (its queue written out) in the server's lifespan shutdown (`closing_capture`), else when the process
    exits."""
    if settings.capture is None:
        return None
    import atexit

    sink = open_sink(
        settings.capture,
        max_bytes=settings.capture_max_bytes,
        retention_s=settings.capture_retention_s,
        counts=metrics.CAPTURE,
        queue_bytes=settings.capture_queue_bytes,
    )
    atexit.register(sink.close)
    return sink


def closing_capture(sink: Sink, send: Send) -> Send:
    """The lifespan's `send`, which writes the capture queue out (at most store.CLOSE_WAIT_S: `Sink.close`) before the
    server hears that the app has shut down: uvicorn re-raises SIGTERM once it has, so `atexit` never runs then. In
    a daemon thread of its own (`capture_api.in_thread`): a store that hangs never holds the server's exit."""

    async def lifespan_send(message: Message) -> None:
        if message.get("type") in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
            with contextlib.suppress(Exception):  # `close` counts and logs what it did not write; shutdown goes on
                await capture_api.in_thread(sink.close, timeout=None, limited=False)
        await send(message)

    return lifespan_send

"""The capture of one server process (`CaptureMount`): its sink opened at start-up (`open_capture`), vLLM's
renderer wrapped where continue ids are on, its queue written out at shutdown (`closing_capture`). The request
path hands the sink turns; the read API (sessions.py) reads it. docs/capture.md.
"""

from __future__ import annotations

import contextlib
import threading
from typing import ClassVar

from .. import metrics
from ..asgi_types import Message, Send
from ..capture import api as capture_api
from ..capture import render_hook
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


class CaptureMount:
    """The capture of this process for one store: one sink, one writer thread, however many mounts capture into it.

    `vllm-nvext serve` mounts both `--middleware` and the plugin in one API-server process; each mount takes the
    mount of its settings' store (`start`), so both hand their turns to one queue, one writer writes them, and the
    lifespan's shutdown writes that queue out once. A mount whose sink was closed (its server shut down) is opened
    anew by the next `start`."""

    _mounts: ClassVar[dict[tuple[str, int, int, int], CaptureMount]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, sink: Sink) -> None:
        self.sink = sink

    @classmethod
    def start(cls, settings: Settings) -> CaptureMount | None:
        """This process's capture into the store `settings` name, opened on the first call (None: capture off).
        Run at start-up, never on a request: with continue ids on (`settings.continue_ids`), vLLM's chat rendering
        is wrapped here, once per process (render_hook.install; ConfigError outside a vLLM server)."""
        if settings.capture is None:
            return None
        if settings.continue_ids:
            render_hook.install()
        # The same URL with other bounds is another sink (tests on one Redis server): the bounds are the sink's own.
        key = (settings.capture, settings.capture_max_bytes, settings.capture_retention_s, settings.capture_queue_bytes)
        with cls._lock:
            mount = cls._mounts.get(key)
            if mount is None or mount.sink.closed:
                sink = open_capture(settings)
                assert sink is not None
                mount = cls._mounts[key] = cls(sink)
        return mount

    def closing(self, send: Send) -> Send:
        """The lifespan's `send` of a mount (`closing_capture`): the sink closes once, whichever mount sees it first."""
        return closing_capture(self.sink, send)

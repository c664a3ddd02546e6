"""A captured stream's reshaper (docs/capture.md): `stream.StreamReshaper`'s bytes for the client, every
body message of vLLM's stream to the capture tap (`capture.tap.Collector.stream_bytes`), in order."""

from __future__ import annotations

from typing import Any

from ..inbound.plan import Plan
from .nvext_values import Clock
from .splice import SpliceArm
from .stream import StreamKernels, StreamReshaper


class CapturedStreamReshaper(StreamReshaper):
    """A captured stream (docs/capture.md): the client's bytes are `StreamReshaper`'s, its shortcuts and
    compiled twins included; each body message, as vLLM sent it, goes to `tap`
    (`capture.tap.Collector.stream_bytes`), which reads the chunks in bulk, not one by one on the way."""

    __slots__ = ("tap",)

    def __init__(self, plan: Plan, clock: Clock, tap: Any, kernels: StreamKernels | None = None) -> None:
        super().__init__(plan, clock, kernels)
        self.tap = tap

    def feed(self, body: bytes) -> bytes:
        self.tap.stream_bytes(body)
        return super().feed(body)

    def arm_parts(self) -> SpliceArm | None:
        """The splice's arm, serving mid-stream deltas alone: each one it serves goes to the tap by `on_ids`,
        every other message (the finish and usage chunks among them) to `feed`, so the tap gets them all, in order."""
        parts = super().arm_parts()
        if parts is None:
            return None
        tap_bytes, reported = self.tap.stream_bytes, parts.on_ids

        def on_ids(event: bytes, start: int, end: int) -> None:
            if reported is not None:
                reported(event, start, end)  # first: if it refuses the ids, the delta comes to `feed` instead
            tap_bytes(event)

        return parts._replace(on_ids=on_ids, usage_root=b"", finish=None)

"""The general path of a stream, every `data:` event decoded: the oracle each shortcut of `stream.StreamReshaper`
gives the bytes of (the stream tests compare the two), and the path of a captured stream (docs/capture.md),
whose every chunk the capture tap reads as vLLM sent it.
"""

from __future__ import annotations

from typing import Any

from ..plan import Plan
from .chunks import ChunkReshaper
from .nvext_values import Clock
from .stream import StreamReshaper


class DecodingStreamReshaper(StreamReshaper):
    """`StreamReshaper` with the byte-level path for mid-stream deltas off: every `data:` event is decoded.

    The general path each shortcut must give the bytes of; the tests compare the two.
    """

    __slots__ = ()

    def __init__(self, plan: Plan, clock: Clock) -> None:
        super().__init__(plan, clock)
        self._finishes = False  # no single-choice shortcut (finish.py) either
        self._scan = None

    def reshape_event(self, event: bytes) -> bytes | None:
        return self._decoded_event(event)


class _TappedChunks(ChunkReshaper):
    """`ChunkReshaper` that tells the capture tap each chunk, as vLLM sent it, before reshaping it."""

    __slots__ = ("tap",)
    tap: Any

    def reshape(self, obj: Any) -> bool:
        self.tap.chunk(obj)
        return super().reshape(obj)


class CapturedStreamReshaper(DecodingStreamReshaper):
    """The general path of a captured stream (docs/capture.md): every chunk decoded and told to `tap`
    (`capture.tap.Collector.chunk`); the client's bytes are the general path's."""

    __slots__ = ()

    def __init__(self, plan: Plan, clock: Clock, tap: Any) -> None:
        super().__init__(plan, clock)
        chunks = _TappedChunks(plan, clock)
        chunks.tap = tap
        self.chunks = chunks

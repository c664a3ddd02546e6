"""The general path of a stream, every `data:` event decoded: the oracle each shortcut of `stream.StreamReshaper`
gives the bytes of (the stream tests compare the two).
"""

from __future__ import annotations

from ..inbound.plan import Plan
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

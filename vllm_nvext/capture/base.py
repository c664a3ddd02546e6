"""The capture store's interface: what a backend is (`Backend`), what a read returns (`Page`), and how a write
fails (`StoreFull`, `PartlyWritten`). The sink (store.py) drives a backend; each backend (sqlite_store.py,
redis_store.py) implements it; neither imports the other. docs/capture.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from .record import Turn


class StoreFull(Exception):
    """The store is at its size cap; the batch is dropped."""


class PartlyWritten(Exception):
    """A store that writes turn by turn (Redis) wrote `written` of the batch's turns and failed on the others
    (the last failure: `__cause__`): those written are recorded, the others dropped."""

    def __init__(self, written: int) -> None:
        super().__init__(written)
        self.written = written


@dataclass(frozen=True, slots=True)
class Page:
    """Some turns of a session, from `start`; `next_index` is where the next page starts (None: the end)."""

    turns: list[str]  # each a turn's JSON text, as stored
    next_index: int | None


class Backend(Protocol):
    """One kind of store. Every method may raise; the Sink counts and logs, the request path never sees it.

    `write`: the turns, each placed as its session's next (`Turn.placed`, against the stored previous turn), in
    their order; StoreFull when the store is at its cap, PartlyWritten when some were written. `read`: the
    session's turns from `start`, about `max_bytes` of them but at least one (None: no such session). `delete`:
    False when there was no such session. `sessions`: the session ids whose last turn is at or after `since`,
    oldest first. `prune`: removes the sessions past the retention, how many. `used_bytes`: what the store holds
    against its cap."""

    def write(self, turns: Sequence[Turn], now: float) -> None: ...

    def read(self, session_id: str, start: int, max_bytes: int) -> Page | None: ...

    def delete(self, session_id: str) -> bool: ...

    def sessions(self, since: float | None) -> Iterator[str]: ...

    def prune(self, now: float) -> int: ...

    def used_bytes(self) -> int: ...

    def close(self) -> None: ...


def readable(body: str | bytes) -> Turn | None:
    """A stored turn as the writer places the next by it; None for one that does not read back (a store written before
    `Turn.problem` refused such turns): its session's next turn is then placed as after no reported ids."""
    try:
        return Turn.from_json(json.loads(body))
    except (ValueError, TypeError, RecursionError):
        return None

# The compiled kernels (csrc/, one file each): each is the twin of the Python function named beside it, with
# the same signature (`kernels.Kernels` holds one or the other; tests/unit/conftest.py's `kernels` fixture runs
# every kernel test on both).
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from .outbound.splice import SpliceArm

_Message = MutableMapping[str, Any]
_Send = Callable[[_Message], Awaitable[None]]

class StreamSend:
    """`kernels.python_stream_send`'s twin (csrc/stream_send.c)."""

    def __init__(self, general: _Send, downstream: _Send) -> None: ...
    def __call__(self, message: _Message) -> Awaitable[None]: ...
    def arm(self, countdown: int, tally_add: Callable[[int], int] | None, splice: SpliceArm) -> None: ...
    def disarm(self) -> None: ...
    def countdown(self) -> int: ...

def learn_splice(
    event: bytes, start: int, end: int, strip: bool, trio: bool, out: bytes
) -> tuple[bytes, bytes, bytes, bytes, bytes | None] | None:
    """`outbound.splice.learn_splice`'s twin (csrc/learn_splice.c)."""

def finish_ids(event: bytes, prefix: bytes, finish_head: bytes, root_end: int) -> tuple[int, int] | None:
    """`outbound.finish.finish_ids`'s twin (csrc/finish_ids.c)."""

def kept_text(text: bytes) -> bool:
    """`kernels.kept_text`'s twin: `outbound.splice.kept_text` over a whole bytes object (csrc/locate.c)."""

def splice_root(body: bytes, drop: tuple[bytes, ...], extra: bytes) -> bytes | None:
    """`_json.splice_root`'s twin (csrc/splice_root.c); None: a body it leaves to the Python twin."""

def plain_chunk(event: bytes) -> tuple[int, ...] | None:
    """`outbound.plain.plain_chunk`'s twin (csrc/plain_chunk.c): None, or the spans `outbound.finish.first_chunk`
    reads."""

"""The hot path's kernels, compiled or pure Python: one record, built once per setting.

MarkupSafe's pattern: the extension `_speedups` (csrc/, one C file per kernel, typed by `_speedups.pyi`)
or the Python twins, picked once (`pick`); a field holds the same kernel, same signature, in either
record, and the Python twin is its compiled twin's oracle (every kernel test runs on both: the `kernels`
fixture of tests/unit/conftest.py). The arming rule that keeps it honest: the compiled path serves only what
the Python path has just shown it reproduces byte for byte (`splice.learn_splice` checks the splice against
the byte-level path's bytes for the delta that arms it); everything else goes back to Python.

`python_stream_send` is the stream send's Python twin (`_speedups.StreamSend`'s): the `send` handed to vLLM,
which serves an armed stream's mid-stream deltas and choice 0's finish chunk itself (`splice.SpliceArm`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from time import perf_counter_ns

from . import _json
from .asgi_types import Message, Send
from .inbound.rewrite import SpliceRoot
from .outbound.finish import FinishIds, Scanner, finish_ids
from .outbound.plain import plain_chunk
from .outbound.splice import FinishArm, Learner, SpliceArm, learn_splice
from .outbound.splice import kept_text as kept_span

_ID_BYTES = b"0123456789,"
_NVEXT = b',"nvext":'

# The send handed to vLLM, and the three calls that drive it: arm(countdown, tally_add, splice), disarm(),
# countdown() (the metrics countdown while armed; the message at 1 is timed).
Arm = Callable[[int, "Callable[[int], int] | None", SpliceArm], None]
StreamSendParts = tuple[Callable[[Message], Awaitable[None]], Arm, Callable[[], None], Callable[[], int]]
StreamSendFactory = Callable[[Send, Send], StreamSendParts]


@dataclass(frozen=True, slots=True)
class Kernels:
    """The kernels one setting runs: `impl` "c" (the extension) or "python" (the twins), as the startup log
    and the metrics name it. Each field's twin has the same signature; the compiled field's doc names it."""

    impl: str
    stream_send: StreamSendFactory  # `_speedups.StreamSend` / `python_stream_send`
    learn_splice: Learner  # the splice a delta teaches, checked (`splice.learn_splice`)
    finish_ids: FinishIds  # where choice 0's finish ids sit (`finish.finish_ids`)
    kept_text: Callable[[bytes], bool]  # a text a splice serves (`splice.kept_text` over a whole bytes)
    splice_root: SpliceRoot  # the request body's root members rewritten (`_json.splice_root`)
    plain_chunk: Scanner  # a plain chunk's spans, for `finish.first_chunk` and `unary.plain_body` (`plain.plain_chunk`)
    # Whether the hot path reads a plain chunk with `plain_chunk` instead of decoding it: the compiled scanner costs a
    # fraction of a decode; the Python twin decodes to check (2-3x the general path's decode and reshape), so the
    # pure-Python path decodes. The kernel tests run the shortcut on both (tests/support/kernels.py).
    scans_plain: bool


# Until armed, every message goes to `general` (the `ReshapingSend`). Armed with a stream's
# `splice.SpliceArm`, it serves the mid-stream deltas the splice serves (the checks of `Splice.locate`,
# the bytes of `Splice.render`), choice 0's finish chunk when armed for one (`finish.finish_chunk`'s bytes: its
# ids found by `finish_ids`, recorded by the arm's `FinishArm.record`, once), and `data: [DONE]`, the usage chunk
# and the stream's closing empty message as they came (nothing is held or waits while armed; the closing message
# is not counted: the general path counts it as a framed message of no event), as a plain function that returns
# `downstream`'s awaitable: no coroutine of its own.
# Anything else goes to `general`, which arms or disarms it again. While armed it keeps the metrics countdown
# (metrics.StreamTally) and times the sampled message itself; `countdown` hands it back.
def python_stream_send(general: Send, downstream: Send) -> StreamSendParts:
    """The pure-Python `send` handed to vLLM: (send, arm, disarm, countdown); see the comment above."""
    prefix = head = tail = mid = root = b""
    lp = lh = lt = lr = 0
    strip = trio = armed = False
    on_ids, tally_add = _NO_IDS_RECORDER, _NO_TALLY
    left, clock, fin = 0, perf_counter_ns, _FinishChunk()

    def send(message: Message) -> Awaitable[None]:
        nonlocal left
        if armed and message["type"] == "http.response.body":
            body = message.get("body", b"")
            if not message.get("more_body", False):
                return downstream(message) if body == b"" and type(body) is bytes else general(message)
            t0 = clock() if left == 1 else 0
            if type(body) is bytes and body.startswith(prefix) and body.endswith(tail):
                end = len(body) - lt
                start = body.rfind(b"[")  # the tail holds none (splice.Splice)
                h = start - lh
                if (
                    h >= lp
                    and body.startswith(head, h)
                    and kept_span(body, lp, h)
                    and body[end - 1] == 93  # ]
                    and not body[start + 1 : end - 1].strip(_ID_BYTES)
                ):
                    if trio:  # the delta written before its ids are reported: by the splice it matched
                        ids = body[start:end]
                        message["body"] = b"".join((body[:start] if strip else body[:end], mid, ids, b"}}\n\n"))
                    elif strip:
                        message["body"] = body[:start] + mid
                    if on_ids is not None and not _reported(on_ids, message, body, start, end):
                        return general(message)  # ids a decode refuses: the delta as it came
                elif not fin.served(message, body, prefix, strip):  # choice 0's finish chunk, or the general path
                    return general(message)
            elif type(body) is not bytes or not fin.beside(message, body, prefix, strip, root, lr):
                return general(message)
            left = tally_add(clock() - t0) if t0 and tally_add is not None else left - 1
            return downstream(message)
        return general(message)

    def arm(countdown: int, add: Callable[[int], int] | None, splice: SpliceArm) -> None:
        nonlocal prefix, head, tail, mid, root, lp, lh, lt, lr, strip, trio, armed, on_ids, left, tally_add
        prefix, head, tail, mid, strip, trio, on_ids, root, fin.arm = splice
        lp, lh, lt, lr, left, tally_add, armed = len(prefix), len(head), len(tail), len(root), countdown, add, True

    def disarm() -> None:
        nonlocal armed
        armed = False

    return send, arm, disarm, lambda: left


# An unarmed stream send's: no delta's ids recorded, no metrics countdown timed.
_NO_IDS_RECORDER: Callable[[bytes, int, int], None] | None = None
_NO_TALLY: Callable[[int], int] | None = None


class _FinishChunk:
    """The messages an armed Python stream send serves beside the deltas: `data: [DONE]` and the usage chunk as
    they came, choice 0's finish chunk once when armed for it (`splice.FinishArm`)."""

    __slots__ = ("arm",)

    def __init__(self) -> None:
        self.arm: FinishArm | None = None

    def beside(self, message: Message, body: bytes, prefix: bytes, strip: bool, root: bytes, lr: int) -> bool:
        """`body` goes out: as it came (`data: [DONE]`, the usage chunk) or as the finish chunk (`served`); False:
        the general path's."""
        return body == b"data: [DONE]\n\n" or _is_usage(body, root, lr) or self.served(message, body, prefix, strip)

    def served(self, message: Message, body: bytes, prefix: bytes, strip: bool) -> bool:
        """`body` is the finish chunk, recorded by its owner: `message` holds its bytes (`finish.finish_chunk`'s);
        False: the general path's, as it came."""
        arm = self.arm
        span = None if arm is None else finish_ids(body, prefix, arm.head, arm.root_end)
        if arm is None or span is None:
            return False
        self.arm = None  # served once: a second finish chunk goes to the general path
        start, end = span
        try:
            nvext = arm.record(body, start, end)
        except Exception:
            return False  # the general path tries it again, and forwards it unchanged if it fails again
        if nvext is None:
            return False
        kept = body[:start] + b"null" + body[end:-3] if strip else body[:-3]
        message["body"] = b"".join((kept, _NVEXT, nvext, b"}\n\n"))
        return True


def _reported(on_ids: Callable[[bytes, int, int], None], message: Message, body: bytes, start: int, end: int) -> bool:
    """`on_ids` recorded the delta's ids; False: it refused them (ids a decode refuses), and the message holds
    the delta as it came again, for the general path, which forwards it unchanged and counts it (the compiled
    send does the same)."""
    try:
        on_ids(body, start, end)
    except Exception:
        message["body"] = body
        return False
    return True


def _is_usage(body: bytes, root: bytes, lr: int) -> bool:
    """The usage chunk `stream.StreamReshaper` forwards as it came: one whole event, the root (b"": none does),
    `]`, no `"choices":` after it."""
    return (
        lr > 0
        and body.startswith(root)
        and body[lr : lr + 1] == b"]"
        and body.endswith(b"\n\n")
        and body.find(b"\n") == len(body) - 2
        and body.find(b"\r") < 0
        and body.find(b'"choices":', lr) < 0
    )


def kept_text(text: bytes) -> bool:
    """`splice.kept_text` over a whole bytes object: `_speedups.kept_text`'s twin."""
    return kept_span(text, 0, len(text))


PYTHON = Kernels(
    "python", python_stream_send, learn_splice, finish_ids, kept_text, _json.splice_root, plain_chunk, False
)


def _compiled() -> Kernels:
    """The compiled kernels (`_speedups`, typed by `_speedups.pyi`)."""
    stream_send = _speedups.StreamSend

    def factory(general: Send, downstream: Send) -> StreamSendParts:
        send = stream_send(general, downstream)
        return send, send.arm, send.disarm, send.countdown

    return Kernels(
        "c", factory, _speedups.learn_splice, _speedups.finish_ids, _speedups.kept_text, _speedups.splice_root,
        _speedups.plain_chunk, True,
    )  # fmt: skip


COMPILED: Kernels | None
try:
    from . import _speedups
except ImportError:  # not built, or an interpreter that cannot load it: the Python twins run
    COMPILED = None
else:
    COMPILED = _compiled()
# The kernels this install has, by `impl`.
KERNELS: dict[str, Kernels] = {"python": PYTHON} if COMPILED is None else {"python": PYTHON, "c": COMPILED}


def pick(pure_python: bool) -> Kernels:
    """The kernels that run: the compiled ones when the extension is built and not turned off, else Python's."""
    return PYTHON if pure_python or COMPILED is None else COMPILED

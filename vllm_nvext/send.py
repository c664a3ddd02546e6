"""The `send` handed to vLLM when a response is reshaped: ASGI messages in, the client's out.

A stream's bytes go through `stream.StreamReshaper` as they come; a unary body is held until
complete, reshaped by `unary.reshape_unary_body` and sent with its new length. A JSON error about
a field the middleware set from an nvext field is renamed to that field (`chunks.rename_error`);
other errors, 204/206/304 and encoded bodies pass untouched. Used by `NvextMiddleware`; public for benchmarks.

vLLM is handed `ReshapingSend.app_send`: a plain function (`python_stream_send`) or the compiled
`_speedups.StreamSend`, which serve an armed stream's mid-stream deltas themselves
(`splice.Splice`) and hand every other message to the `ReshapingSend`. Same bytes as the general
path, both implementations: tests/unit/test_stream_send.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from importlib import import_module
from time import perf_counter_ns
from typing import Any

from . import _json, metrics
from .asgi import Message, Send, is_event_stream, is_json
from .outbound.chunks import rename_error
from .outbound.finish import Scanner
from .outbound.nvext_values import Clock
from .outbound.splice import Learner, kept_text
from .outbound.stream import CapturedStreamReshaper, StreamReshaper
from .outbound.unary import plain_body, reshape_unary_body
from .outbound.unary import serves as unary_serves
from .plan import Plan
from .protocol import Endpoint

logger = logging.getLogger("vllm_nvext")

_PASS_STATUSES = frozenset({204, 206, 304})
_ID_BYTES = b"0123456789,"
_UNTIMED = 1 << 62  # the countdown to the next timed message when metrics are off: never reached

# The metrics countdown, the tally's `add` (None: metrics off), then `stream.StreamReshaper.arm_parts`: the
# splice's parts, as `splice.Splice` holds them, the on-ids callback, the root of a usage chunk that goes out
# as it came (b"": none does) and what serves choice 0's finish chunk (None: none is; the compiled send only).
Arm = Callable[[int, "Callable[[int], int] | None", bytes, bytes, bytes, bytes, bool, bool,
                "Callable[[bytes, int, int], None] | None", bytes, "tuple[bytes, int, bytes, Any] | None"],
               None]  # fmt: skip


# Until armed, every message goes to `general` (the `ReshapingSend`). Armed with a stream's
# `splice.Splice`, it serves the mid-stream deltas the splice serves (the checks of `Splice.locate`,
# the bytes of `Splice.render`), and `data: [DONE]`, the usage chunk and the stream's closing empty message
# as they came (nothing is held or waits while armed; the closing message is not counted: the general path
# counts it as a framed message of no event), as a plain function that returns `downstream`'s awaitable:
# no coroutine of its own.
# Anything else goes to `general`, which arms or disarms it again. While armed it keeps the metrics countdown
# (metrics.StreamTally) and times the sampled message itself; `countdown` hands it back.
def python_stream_send(general: Send, downstream: Send) -> tuple[Callable[[Message], Awaitable[None]], Arm,
                                                                   Callable[[], None], Callable[[], int]]:  # fmt: skip
    """The pure-Python `send` handed to vLLM: (send, arm, disarm, countdown); see the comment above."""
    prefix = head = tail = mid = root = b""
    lp = lh = lt = lr = 0
    strip = trio = armed = False
    on_ids: Callable[[bytes, int, int], None] | None = None
    tally_add: Callable[[int], int] | None = None
    left, clock = 0, perf_counter_ns

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
                if not (
                    h >= lp
                    and body.startswith(head, h)
                    and kept_text(body, lp, h)
                    and body[end - 1] == 93  # ]
                    and not body[start + 1 : end - 1].strip(_ID_BYTES)
                ):
                    return general(message)
                if trio:  # the delta written before its ids are reported: by the splice it matched
                    ids = body[start:end]
                    message["body"] = b"".join((body[:start] if strip else body[:end], mid, ids, b"}}\n\n"))
                elif strip:
                    message["body"] = body[:start] + mid
                if on_ids is not None and not _reported(on_ids, message, body, start, end):
                    return general(message)  # ids a decode refuses: the delta as it came
            elif type(body) is not bytes or (body != b"data: [DONE]\n\n" and not _is_usage(body, root, lr)):
                return general(message)
            if t0 and tally_add is not None:
                left = tally_add(clock() - t0)
            else:
                left -= 1
            return downstream(message)
        return general(message)

    def arm(countdown: int, add: Callable[[int], int] | None, p: bytes, h: bytes, t: bytes, m: bytes, s: bool,
            tr: bool, ids: Callable[[bytes, int, int], None] | None, r: bytes, finish: object) -> None:  # fmt: skip
        nonlocal prefix, head, tail, mid, root, lp, lh, lt, lr, strip, trio, armed, on_ids, left, tally_add
        prefix, head, tail, mid, strip, trio, on_ids, left, tally_add = p, h, t, m, s, tr, ids, countdown, add
        root, lp, lh, lt, lr = r, len(p), len(h), len(t), len(r)
        armed = True

    def disarm() -> None:
        nonlocal armed
        armed = False

    def countdown() -> int:
        return left

    return send, arm, disarm, countdown


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


# The echoed prompts of a plan, decoded; None when the client went away meanwhile.
DecodeEcho = Callable[[Plan], Awaitable["tuple[str | tuple[int, ...], ...] | None"]]


class ReshapingSend:
    """The `send` handed to vLLM when the response has to be reshaped."""

    __slots__ = ("plan", "clock", "send", "route", "decode_echo", "_kind", "_start", "_parts", "_stream", "_tally",
                 "_left", "app_send", "_arm", "_disarm", "_countdown", "_armed", "_scan", "_learn", "tap")  # fmt: skip

    _PASS, _UNARY, _STREAM, _ERROR, _DROP = 0, 1, 2, 3, 4

    def __init__(
        self,
        plan: Plan,
        clock: Clock,
        send: Send,
        stream_send: StreamSendFactory | None = None,
        route: Endpoint | None = None,
        decode_echo: DecodeEcho | None = None,
        tap: Any = None,
    ) -> None:
        self.plan = plan
        # The capture tap (`capture.tap.Collector`): told each decoded chunk or body as vLLM sent it; a
        # captured stream stays on the general path, which decodes every chunk (docs/capture.md).
        self.tap = tap
        self.clock = clock
        self.send = send
        # The metrics' `endpoint` label: the route the client called (docs/metrics.md), /invocations
        # included, whichever of chat or completions served it.
        self.route = plan.endpoint if route is None else route
        # Decodes the plan's echoed id prompts once vLLM has accepted the request (docs/protocol.md §8).
        self.decode_echo = decode_echo
        self._kind = self._PASS
        self._start: Message | None = None
        self._parts: list[bytes] = []
        self._stream: StreamReshaper | None = None
        self._tally: metrics.StreamTally | None = None  # None: metrics off, nothing timed
        self._left = metrics.StreamTally.FIRST  # body messages until the next timed one
        # The send to hand vLLM: serves armed streams' deltas itself, everything else through this object.
        make = STREAM_SENDS[stream_path(False)] if stream_send is None else stream_send
        if make is _compiled and _StreamSend is not None:  # the factory's work, inlined
            app_send = _StreamSend(self, send)
            self.app_send, self._arm, self._disarm = app_send, app_send.arm, app_send.disarm
            self._countdown = app_send.countdown
            self._scan = COMPILED_SCAN  # the compiled path's chunk scanner
            self._learn = COMPILED_LEARN  # and its splice learner (splice.learn_splice's twin)
        else:
            self.app_send, self._arm, self._disarm, self._countdown = make(self, send)
            compiled = make is _compiled
            self._scan = COMPILED_SCAN if compiled else None
            self._learn = COMPILED_LEARN if compiled else None
        self._armed = False  # app_send is armed: its countdown is the one that counts

    async def __call__(self, message: Message) -> None:
        if self._kind == 2 and message["type"] == "http.response.body":  # _STREAM: the hot path, inlined
            stream = self._stream
            assert stream is not None
            if self._armed:
                self._left = self._countdown()
            body = message.get("body", b"")
            if type(body) is not bytes:
                body = bytes(body)  # memoryview or bytearray: `in` and find() need real bytes
            left = self._left - 1
            if left or self._tally is None:
                self._left = left
                out = stream.feed(body)
            else:  # one message in a sample is timed (metrics.StreamTally)
                t0 = perf_counter_ns()
                out = stream.feed(body)
                self._left = self._tally.add(perf_counter_ns() - t0)
            more = message.get("more_body", False)
            if not more:
                out += stream.flush()  # an unterminated tail goes out as it came
            if out is not body:
                message["body"] = out  # vLLM's message dict is its own per send: reused, not copied
            if more and stream.splice is not None and (parts := stream.arm_parts()) is not None:
                tally = self._tally
                if tally is None:
                    self._arm(_UNTIMED, None, *parts)
                else:
                    self._arm(self._left, tally.add, *parts)
                self._armed = True
            elif self._armed:
                self._disarm()
                self._armed = False
            if out or not more:
                await self.send(message)
            return
        kind = message["type"]
        if self._kind == self._DROP:
            return  # the client went away while the echoed prompts were decoded
        if kind == "http.response.start":
            await self._on_start(message)
        elif kind == "http.response.body" and self._kind in (self._UNARY, self._ERROR):
            await self._on_unary_body(message)
        else:
            await self.send(message)

    async def _on_start(self, message: Message) -> None:
        status = message["status"]
        if self.decode_echo is not None and 200 <= status < 300:
            # Only now: vLLM has checked the key, the model and every id, and done its own work.
            decoded = await self.decode_echo(self.plan)
            if decoded is None:
                self._kind = self._DROP
                return
            self.plan = replace(self.plan, echo_prompts=decoded)
        content_type: bytes | None = None
        encoded = sized = False
        for name, value in message.get("headers", ()):
            lower = name.lower()
            if lower == b"content-type":
                # The request side's rule (`asgi.read_as_json`): the first header, read as FastAPI reads it.
                content_type = value if content_type is None else content_type
            elif lower == b"content-encoding":
                encoded = True
            elif lower == b"content-length":
                sized = True
        # (no Content-Type reads as an empty one: neither)
        json_body, event_stream = _BODY_KINDS.get(content_type or b"") or _body_kind(content_type)
        if status >= 400 and self.plan.error_params and not encoded and json_body:
            self._kind = self._ERROR
            self._start = message
            return  # held until the body is complete, to fix its length
        if status >= 400 or status in _PASS_STATUSES or encoded:
            self._kind = self._PASS
        elif not self.plan.reshapes_answer and not event_stream:
            self._kind = self._PASS  # only vLLM's errors could change (error events come in streams)
        elif event_stream:
            self._kind = self._STREAM
            if self.tap is None:
                self._stream = StreamReshaper(self.plan, self.clock, self._scan, self._learn)
            else:
                self._stream = CapturedStreamReshaper(self.plan, self.clock, self.tap)
            self._tally = metrics.StreamTally() if metrics.enabled() else None
            if sized:
                message["headers"] = [(n, v) for n, v in message.get("headers", ()) if n.lower() != b"content-length"]
        elif json_body:
            self._kind = self._UNARY
            self._start = message
            return  # held until the body is complete, to fix its length
        await self.send(message)

    async def _on_unary_body(self, message: Message) -> None:
        body = bytes(message.get("body", b""))  # bytes as they are, not copied
        if message.get("more_body", False) or self._parts:  # else the body in one message, usually: no join
            self._parts.append(body)
            if message.get("more_body", False):
                return
            body = b"".join(self._parts)
            self._parts = []
        t0 = perf_counter_ns()
        unchanged = 0
        plan = self.plan
        try:
            if self._kind == self._ERROR:
                new = _renamed_error(body, plan)
            elif self.tap is not None:
                self.tap.body(_json.loads(body))  # as vLLM sent it
                new = reshape_unary_body(body, plan, self.clock)
            elif self._scan is not None and unary_serves(plan):  # reshape_unary_body's first step, inlined
                new = plain_body(body, plan, self._scan)
                if new is None:
                    new = reshape_unary_body(body, plan, self.clock)
            else:
                new = reshape_unary_body(body, plan, self.clock, self._scan)
            if new is not None:
                body = new
        except ValueError:
            pass  # not JSON after all: forwarded unchanged
        except Exception:  # never turn a good vLLM answer into a 500
            logger.exception("vllm-nvext could not reshape a response; forwarded unchanged")
            unchanged = 1
        metrics.count_reshaping(self.route, metrics.UNARY, 1, (perf_counter_ns() - t0) / 1e9, unchanged)
        start = self._start
        assert start is not None
        headers = []
        for name, value in start.get("headers", ()):  # a loop, not a comprehension: no function of its own
            if name.lower() != b"content-length":
                headers.append((name, value))
        headers.append((b"content-length", str(len(body)).encode()))
        start["headers"] = headers
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def count_stream(self) -> None:
        """Add a reshaped stream's events and time to the metrics, once, when it is over."""
        stream, tally = self._stream, self._tally
        if stream is not None and tally is not None:
            self._tally = None
            left = self._countdown() if self._armed else self._left
            events = tally.messages(left) - stream.framed + stream.framed_events
            seconds = tally.seconds(left)
            metrics.count_reshaping(self.route, metrics.STREAM, events, seconds, stream.unchanged)


_BODY_KINDS: dict[bytes, tuple[bool, bool]] = {}
_BODY_KINDS_MAX = 64  # vLLM writes a handful of content types; more are read each time


def _body_kind(content_type: bytes | None) -> tuple[bool, bool]:
    """(JSON, event stream) for a response's Content-Type, as `asgi.is_json` and `asgi.is_event_stream` read it."""
    if content_type is None:
        return False, False
    kind = _BODY_KINDS.get(content_type)
    if kind is None:
        kind = (is_json(content_type), is_event_stream(content_type))
        if len(_BODY_KINDS) < _BODY_KINDS_MAX:
            _BODY_KINDS[content_type] = kind
    return kind


def _renamed_error(body: bytes, plan: Plan) -> bytes | None:
    obj = _json.loads(body)
    return _json.dumps(obj) if rename_error(obj, plan) else None


StreamSendFactory = Callable[[Send, Send], tuple[Callable[[Message], Awaitable[None]], Arm, Callable[[], None],
                                                 Callable[[], int]]]  # fmt: skip


def compiled(name: str) -> Any:
    """The compiled extension's `name` (`vllm_nvext._speedups`); None when the extension is not built
    (or is a build without it)."""
    try:
        speedups = import_module("._speedups", __package__)
    except ImportError:
        return None
    return getattr(speedups, name, None)


_StreamSend: Any = compiled("StreamSend")


def _compiled_stream_send() -> StreamSendFactory | None:
    """`_speedups.StreamSend` as a factory like `python_stream_send`; None when the extension is not built."""
    stream_send = _StreamSend
    if stream_send is None:
        return None

    def factory(general: Send, downstream: Send) -> tuple[Callable[[Message], Awaitable[None]], Arm,
                                                           Callable[[], None], Callable[[], int]]:  # fmt: skip
        send = stream_send(general, downstream)
        return send, send.arm, send.disarm, send.countdown

    return factory


# The stream paths this install has, by the name the startup log and metrics use (`impl`).
STREAM_SENDS: dict[str, StreamSendFactory] = {"python": python_stream_send}
_compiled = _compiled_stream_send()
if _compiled is not None:
    STREAM_SENDS["c"] = _compiled


# outbound/finish.first_chunk's scanner, and splice.learn_splice's compiled twin.
COMPILED_SCAN: Scanner | None = compiled("plain_chunk")
COMPILED_LEARN: Learner | None = compiled("learn_splice")


def stream_path(pure_python: bool) -> str:
    """The stream path that runs: "c" when the extension is built and not turned off, else "python"."""
    return "python" if pure_python or "c" not in STREAM_SENDS else "c"

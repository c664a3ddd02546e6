"""The `send` handed to vLLM when a response is reshaped: ASGI messages in, the client's out.

A stream's bytes go through `stream.StreamReshaper` as they come; a unary body is held until
complete, reshaped by `unary.reshape_unary_body` and sent with its new length. A JSON error about
a field the middleware set from an nvext field is renamed to that field (`chunks.rename_error`);
other errors, 204/206/304 and encoded bodies pass untouched. Used by `NvextMiddleware`; public for benchmarks.

vLLM is handed `ReshapingSend.app_send`: for a stream request, the stream send of the kernels that run
(`kernels.Kernels`): a plain function (`kernels.python_stream_send`) or the compiled `_speedups.StreamSend`, which
serve an armed stream's mid-stream deltas and finish chunk themselves (`splice.SpliceArm`) and hand every other
message to the `ReshapingSend`; for a unary request, the `ReshapingSend` itself (no stream send is made; an event
stream it gets all the same takes the general path). Same bytes as the general path, both implementations:
tests/unit/test_stream_send.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from time import perf_counter_ns
from typing import Any

from . import _json, metrics
from .asgi import is_event_stream, is_json
from .asgi_types import Message, Send
from .inbound.plan import Plan
from .kernels import Arm, Kernels, pick
from .outbound.captured import CapturedStreamReshaper
from .outbound.chunks import rename_error
from .outbound.nvext_values import Clock
from .outbound.splice import SpliceArm
from .outbound.stream import StreamReshaper
from .outbound.unary import plain_body, reshape_unary_body
from .outbound.unary import serves as unary_serves
from .protocol import Endpoint

logger = logging.getLogger("vllm_nvext")

_PASS_STATUSES = frozenset({204, 206, 304})
_UNTIMED = 1 << 62  # the countdown to the next timed message when metrics are off: never reached

# The echoed prompts of a plan, decoded; None when the client went away meanwhile.
DecodeEcho = Callable[[Plan], Awaitable["tuple[str | tuple[int, ...], ...] | None"]]


class ReshapingSend:
    """The `send` handed to vLLM when the response has to be reshaped."""

    __slots__ = ("plan", "clock", "send", "route", "decode_echo", "_kind", "_start", "_parts", "_stream", "_tally",
                 "_left", "app_send", "_arm", "_disarm", "_countdown", "_armed", "kernels", "tap")  # fmt: skip

    _PASS, _UNARY, _STREAM, _ERROR, _DROP = 0, 1, 2, 3, 4

    def __init__(
        self,
        plan: Plan,
        clock: Clock,
        send: Send,
        kernels: Kernels | None = None,
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
        # The kernels that run (None: those of the default settings), and the send to hand vLLM: a stream's from
        # the kernels, which serves armed streams' deltas itself, everything else through this object; for a
        # unary request, this object (made lazily, at the response start, only for an event stream: `_on_start`).
        self.kernels = pick(False) if kernels is None else kernels
        if plan.stream:
            self.app_send, self._arm, self._disarm, self._countdown = self.kernels.stream_send(self, send)
        else:
            self.app_send = self
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
                    self._arm(_UNTIMED, None, parts)
                else:
                    self._arm(self._left, tally.add, parts)
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
        elif not self.plan.reshapes_answer and not event_stream and self.tap is None:
            self._kind = self._PASS  # only vLLM's errors could change (error events come in streams); a tap reads it
        elif event_stream:
            self._kind = self._STREAM
            if self.app_send is self:  # a unary request answered by a stream: nothing but this object serves it
                self._arm, self._disarm, self._countdown = _general_only()
            if self.tap is None:
                self._stream = StreamReshaper(self.plan, self.clock, self.kernels)
            else:
                self._stream = CapturedStreamReshaper(self.plan, self.clock, self.tap, self.kernels)
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
            elif self.kernels.scans_plain and unary_serves(plan):  # reshape_unary_body, inlined
                new = plain_body(body, plan, self.kernels.plain_chunk)
                if new is None:
                    new = reshape_unary_body(body, plan, self.clock)
            else:
                new = reshape_unary_body(body, plan, self.clock)
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
            tally.count(self.route, left, stream.framed_events - stream.framed, stream.unchanged)


def _general_only() -> tuple[Arm, Callable[[], None], Callable[[], int]]:
    """(arm, disarm, countdown) where vLLM calls the `ReshapingSend` itself: nothing is served beside it, and the
    countdown it is armed with is the one that counts (it arms or disarms again on every message while armed)."""
    left = metrics.StreamTally.FIRST

    def arm(countdown: int, add: Callable[[int], int] | None, parts: SpliceArm) -> None:
        nonlocal left
        left = countdown

    return arm, _nothing, lambda: left


def _nothing() -> None:
    return None


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

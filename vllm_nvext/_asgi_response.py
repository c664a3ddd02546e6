"""The `send` handed to vLLM when a response is reshaped: ASGI messages in, the client's out.

A stream's bytes go through `stream.StreamReshaper` as they come; a unary body is held until
complete, reshaped by `unary.reshape_unary_body` and sent with its new length. A JSON error about
a field the middleware set from an nvext field is renamed to that field (`response.rename_error`);
other errors, 204/206/304 and encoded bodies pass untouched. Used by `NvextMiddleware`; public for benchmarks.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from time import perf_counter_ns

from . import _json, metrics
from ._asgi_request import Message, Send
from .nvext_values import Clock
from .request import Plan
from .response import rename_error
from .stream import StreamReshaper
from .unary import reshape_unary_body

logger = logging.getLogger("vllm_nvext")

_PASS_STATUSES = frozenset({204, 206, 304})
# The echoed prompts of a plan, decoded; None when the client went away meanwhile.
DecodeEcho = Callable[[Plan], Awaitable["tuple[str | tuple[int, ...], ...] | None"]]


class ReshapingSend:
    """The `send` handed to vLLM when the response has to be reshaped."""

    __slots__ = ("plan", "clock", "send", "decode_echo", "_kind", "_start", "_parts", "_stream", "_tally", "_left")

    _PASS, _UNARY, _STREAM, _ERROR, _DROP = 0, 1, 2, 3, 4

    def __init__(self, plan: Plan, clock: Clock, send: Send, decode_echo: DecodeEcho | None = None) -> None:
        self.plan = plan
        self.clock = clock
        self.send = send
        # Decodes the plan's echoed id prompts once vLLM has accepted the request (docs/protocol.md §8).
        self.decode_echo = decode_echo
        self._kind = self._PASS
        self._start: Message | None = None
        self._parts: list[bytes] = []
        self._stream: StreamReshaper | None = None
        self._tally: metrics.StreamTally | None = None  # None: metrics off, nothing timed
        self._left = metrics.StreamTally.FIRST  # body messages until the next timed one

    async def __call__(self, message: Message) -> None:
        if self._kind == 2 and message["type"] == "http.response.body":  # _STREAM: the hot path, inlined
            stream = self._stream
            assert stream is not None
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
        content_type = b""
        encoded = False
        for name, value in message.get("headers", ()):
            if name.lower() == b"content-type":
                content_type = value.lower()
            elif name.lower() == b"content-encoding":
                encoded = True
        if status >= 400 and self.plan.error_params and not encoded and content_type.startswith(b"application/json"):
            self._kind = self._ERROR
            self._start = message
            return  # held until the body is complete, to fix its length
        if status >= 400 or status in _PASS_STATUSES or encoded:
            self._kind = self._PASS
        elif not self.plan.reshapes_answer and not content_type.startswith(b"text/event-stream"):
            self._kind = self._PASS  # only vLLM's errors could change (error events come in streams)
        elif content_type.startswith(b"text/event-stream"):
            self._kind = self._STREAM
            self._stream = StreamReshaper(self.plan, self.clock)
            self._tally = metrics.StreamTally() if metrics.enabled() else None
            message["headers"] = [(n, v) for n, v in message.get("headers", ()) if n.lower() != b"content-length"]
        elif content_type.startswith(b"application/json"):
            self._kind = self._UNARY
            self._start = message
            return  # held until the body is complete, to fix its length
        await self.send(message)

    async def _on_unary_body(self, message: Message) -> None:
        self._parts.append(bytes(message.get("body", b"")))
        if message.get("more_body", False):
            return
        body = b"".join(self._parts)
        self._parts = []
        t0 = perf_counter_ns()
        unchanged = 0
        try:
            if self._kind == self._ERROR:
                new = _renamed_error(body, self.plan)
            else:
                new = reshape_unary_body(body, self.plan, self.clock)
            if new is not None:
                body = new
        except ValueError:
            pass  # not JSON after all: forwarded unchanged
        except Exception:  # never turn a good vLLM answer into a 500
            logger.exception("vllm-nvext could not reshape a response; forwarded unchanged")
            unchanged = 1
        metrics.count_reshaping(self.plan.endpoint, metrics.UNARY, 1, (perf_counter_ns() - t0) / 1e9, unchanged)
        start = self._start
        assert start is not None
        headers = [(n, v) for n, v in start.get("headers", ()) if n.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        start["headers"] = headers
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    def count_stream(self) -> None:
        """Add a reshaped stream's events and time to the metrics, once, when it is over."""
        stream, tally = self._stream, self._tally
        if stream is not None and tally is not None:
            self._tally = None
            left = self._left
            events = tally.messages(left) - stream.framed + stream.framed_events
            seconds = tally.seconds(left)
            metrics.count_reshaping(self.plan.endpoint, metrics.STREAM, events, seconds, stream.unchanged)


def _renamed_error(body: bytes, plan: Plan) -> bytes | None:
    obj = _json.loads(body)
    return _json.dumps(obj) if rename_error(obj, plan) else None

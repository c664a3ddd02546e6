"""The ASGI middleware: wires request and response bytes to the pure modules.

Only `POST /v1/chat/completions` and `POST /v1/completions` are ever read; everything else,
and every request that opts into nothing, reaches vLLM and the client byte for byte.
"""

from __future__ import annotations

import email.message
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from time import perf_counter_ns
from typing import Any

from . import _vllm_compat, metrics
from .config import MODE_HEADER, Mode, Settings
from .request import ECHO_TEXT_LOST, ENDPOINT_PATHS, Endpoint, OptInScan, Plan, RequestError, error_body, read_request
from .request import plan as plan_request_for
from .response import Clock
from .stream import StreamReshaper
from .unary import reshape_unary_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("vllm_nvext")

_MODE_HEADER = MODE_HEADER.encode()
# Set on the scope by the first instance, so a second mount (plugin and --middleware) is inert.
_HANDLED = "vllm_nvext.handled"
_PASS_STATUSES = frozenset({204, 206, 304})


class NvextMiddleware:
    """Translate token ids between vLLM's placement and Dynamo's `nvext` (see README).

    `vllm serve --middleware vllm_nvext.NvextMiddleware` builds it with the app alone: the
    settings then come from the environment, validated here so a bad value stops start-up.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        settings: Settings | None = None,
        mode: Mode | str | None = None,
        allow_mode_header: bool | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.settings = Settings.create(
            mode=mode, allow_mode_header=allow_mode_header, max_body_bytes=max_body_bytes, base=settings
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or _HANDLED in scope:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]  # `vllm serve --root-path` behind a proxy
        endpoint = ENDPOINT_PATHS.get(path)
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        scope[_HANDLED] = True
        await _Exchange(self.app, self.settings, endpoint, scope, receive, send).run()


class _Replay:
    """Hands the app the (possibly rewritten) body, then the server's own `receive`."""

    __slots__ = ("_messages", "_receive")

    def __init__(self, parts: list[bytes], more_body: bool, receive: Receive) -> None:
        last = len(parts) - 1
        self._messages: list[Message] = [
            {"type": "http.request", "body": part, "more_body": more_body or i < last} for i, part in enumerate(parts)
        ]
        self._messages.reverse()
        self._receive = receive

    async def __call__(self) -> Message:
        if self._messages:
            return self._messages.pop()
        return await self._receive()


class _PassThrough:
    """The `receive` for a body over the cap that does not opt in so far: it streams to vLLM.

    The rest of the body is checked as it passes. Should it turn out to opt in after all, vLLM is
    told the client went away (it has not answered yet: it answers once the body is complete) and
    the client gets the 413 the middleware owes it.
    """

    __slots__ = ("_replay", "_receive", "_scan", "aborted")

    def __init__(self, parts: list[bytes], scan: OptInScan, receive: Receive) -> None:
        self._replay = _Replay(parts, True, receive)
        self._receive = receive
        self._scan = scan
        self.aborted = False

    async def __call__(self) -> Message:
        if self.aborted:
            return {"type": "http.disconnect"}
        if self._replay._messages:
            return await self._replay()
        message = await self._receive()
        if message["type"] == "http.request" and self._scan.feed(bytes(message.get("body", b""))):
            self.aborted = True
            return {"type": "http.disconnect"}
        return message


class _Exchange:
    """One request/response cycle through the middleware."""

    __slots__ = ("app", "settings", "endpoint", "scope", "receive", "send", "clock")

    def __init__(
        self, app: ASGIApp, settings: Settings, endpoint: Endpoint, scope: Scope, receive: Receive, send: Send
    ) -> None:
        self.app = app
        self.settings = settings
        self.endpoint = endpoint
        self.scope = scope
        self.receive = receive
        self.send = send
        self.clock = Clock()

    async def run(self) -> None:
        scope = self.scope
        # vLLM (starlette) reads the first of repeated headers.
        content_type: bytes | None = None
        dp_rank: bytes | None = None
        modes: list[bytes] = []
        declared_length = -1
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value if content_type is None else content_type
            elif name == _MODE_HEADER:
                modes.append(value)
            elif name == b"x-data-parallel-rank":
                dp_rank = value if dp_rank is None else dp_rank
            elif name == b"content-length":
                declared_length = int(value) if value.isdigit() else -1
        if not _read_as_json(content_type):
            metrics.count_request(self.endpoint, "none", self.settings.mode, metrics.UNKNOWN)
            await self.app(scope, self.receive, self.send)  # vLLM does not read this body as JSON
            return

        cap = self.settings.max_body_bytes
        scan = OptInScan()
        parts: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await self.receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = message.get("body", b"")
            chunk = chunk if type(chunk) is bytes else bytes(chunk)
            more = bool(message.get("more_body", False))
            size += len(chunk)
            parts.append(chunk)
            if scan.feed(chunk) and size > cap:
                await self._refuse(_too_large(cap), b"".join(parts), more)
                return
            if more and not scan.found and max(size, declared_length) > cap:
                metrics.count_request(self.endpoint, "none", self.settings.mode, metrics.UNKNOWN)
                await self._pass_through(parts, scan)  # too large to hold, and no opt-in so far
                return
        body = parts[0] if len(parts) == 1 else b"".join(parts)

        try:
            request = read_request(body, self.endpoint) if scan.found else None
            if request is None:
                metrics.count_request(self.endpoint, "none", self.settings.mode, metrics.UNKNOWN)
                await self.app(scope, _Replay([body], False, self.receive), self.send)
                return
            mode = self._mode(modes)
            plan = plan_request_for(request, mode, dp_rank_header=dp_rank)
            if plan.echo_text_lost:
                raise RequestError(ECHO_TEXT_LOST, "echo")
        except RequestError as exc:
            await self._refuse(exc, body, False)
            return
        if plan.body is not None:
            body = plan.body
            _set_header(scope, b"content-length", str(len(body)).encode())
        for name, value in plan.headers:
            _set_header(scope, name, value, replace=False)
        metrics.count_request(self.endpoint, plan.dialect, mode, metrics.STREAM if plan.stream else metrics.UNARY)
        if not plan.reshapes_response:
            await self.app(scope, _Replay([body], False, self.receive), self.send)
            return
        reshaping = _Reshaping(plan, self.clock, self.send)
        try:
            await self.app(scope, _Replay([body], False, self.receive), reshaping)
        finally:
            reshaping.count_stream()  # also for a stream the client cut short

    def _mode(self, values: list[bytes]) -> Mode:
        """The mode for a request that opts in; an empty header counts as absent."""
        mode = self.settings.mode
        if not self.settings.allow_mode_header:
            return mode
        chosen: set[Mode] = set()
        for value in values:
            text = value.decode("latin-1")
            if text.strip():
                try:
                    chosen.add(Mode.parse(text))
                except ValueError as exc:
                    raise RequestError(f"header `{MODE_HEADER}`: {exc}", MODE_HEADER) from None
        if len(chosen) > 1:
            names = ", ".join(sorted(m.value for m in chosen))
            raise RequestError(f"header `{MODE_HEADER}` is repeated with different modes ({names})", MODE_HEADER)
        return chosen.pop() if chosen else mode

    async def _pass_through(self, parts: list[bytes], scan: OptInScan) -> None:
        receive = _PassThrough(parts, scan, self.receive)
        started = False

        async def send(message: Message) -> None:
            nonlocal started
            if receive.aborted:
                return  # vLLM's answer to the disconnect; the client gets the 413 below
            started = True
            await self.send(message)

        await self.app(self.scope, receive, send)
        if receive.aborted and not started:
            await self._send_error(_too_large(self.settings.max_body_bytes))

    async def _refuse(self, error: RequestError, body: bytes, more_body: bool) -> None:
        if _vllm_compat.auth_refuses(self.scope):
            # Mounted outside vLLM's auth: an unauthenticated caller gets vLLM's 401, not our verdict.
            await self.app(self.scope, _Replay([body], more_body, self.receive), self.send)
            return
        await self._send_error(error)

    async def _send_error(self, error: RequestError) -> None:
        metrics.count_refusal(error.param, error.status)
        payload = error_body(error.message, error.param, error.status)
        await self.send(
            {
                "type": "http.response.start",
                "status": error.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await self.send({"type": "http.response.body", "body": payload, "more_body": False})


def _read_as_json(content_type: bytes | None) -> bool:
    """Whether vLLM's FastAPI route parses the body as JSON (its own rule, on the first header)."""
    if content_type is None:
        return _vllm_compat.untyped_body_is_json()
    message = email.message.Message()
    message["content-type"] = content_type.decode("latin-1")
    if message.get_content_maintype() != "application":
        return False
    subtype = message.get_content_subtype()
    return subtype == "json" or subtype.endswith("+json")


def _too_large(cap: int) -> RequestError:
    return RequestError(f"Request body exceeds the {cap}-byte limit of vllm-nvext", None, 413)


class _Reshaping:
    """The `send` handed to vLLM when the response has to be reshaped."""

    __slots__ = ("plan", "clock", "send", "_kind", "_start", "_parts", "_stream", "_tally", "_left")

    _PASS, _UNARY, _STREAM = 0, 1, 2

    def __init__(self, plan: Plan, clock: Clock, send: Send) -> None:
        self.plan = plan
        self.clock = clock
        self.send = send
        self._kind = self._PASS
        self._start: Message | None = None
        self._parts: list[bytes] = []
        self._stream: StreamReshaper | None = None
        self._tally: metrics.StreamTally | None = None  # None: metrics off, nothing timed
        self._left = metrics.StreamTally.FIRST  # body messages until the next timed one

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            await self._on_start(message)
        elif kind == "http.response.body":
            if self._kind == self._STREAM:
                await self._on_stream_body(message)
            elif self._kind == self._UNARY:
                await self._on_unary_body(message)
            else:
                await self.send(message)
        else:
            await self.send(message)

    async def _on_start(self, message: Message) -> None:
        status = message["status"]
        content_type = b""
        encoded = False
        for name, value in message.get("headers", ()):
            if name.lower() == b"content-type":
                content_type = value.lower()
            elif name.lower() == b"content-encoding":
                encoded = True
        if status >= 400 or status in _PASS_STATUSES or encoded:
            self._kind = self._PASS
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

    async def _on_stream_body(self, message: Message) -> None:
        stream = self._stream
        assert stream is not None
        more = bool(message.get("more_body", False))
        body = message.get("body", b"")
        if type(body) is not bytes:
            body = bytes(body)  # memoryview or bytearray: `in` and find() need real bytes
        tally = self._tally
        if tally is None:
            out = stream.feed(body)
        else:
            left = self._left - 1
            if left:
                self._left = left
                out = stream.feed(body)
            else:  # one message in a sample is timed (metrics.StreamTally)
                t0 = perf_counter_ns()
                out = stream.feed(body)
                self._left = tally.add(perf_counter_ns() - t0)
        if not more:
            out += stream.flush()  # an unterminated tail goes out as it came
        if out or not more:
            await self.send({"type": "http.response.body", "body": out, "more_body": more})

    async def _on_unary_body(self, message: Message) -> None:
        self._parts.append(bytes(message.get("body", b"")))
        if message.get("more_body", False):
            return
        body = b"".join(self._parts)
        self._parts = []
        t0 = perf_counter_ns()
        unchanged = 0
        try:
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


def _set_header(scope: Scope, name: bytes, value: bytes, *, replace: bool = True) -> None:
    """Set a request header in the scope's own list (never a copy of the scope).

    With replace=False a header the client already sent is kept.
    """
    headers = scope["headers"]
    if not isinstance(headers, list):
        headers = scope["headers"] = list(headers)
    if any(n == name for n, _ in headers):
        if not replace:
            return
        headers[:] = [(n, v) for n, v in headers if n != name]
    headers.append((name, value))

"""The ASGI middleware: wires request and response bytes to the pure modules.

Only `POST /v1/chat/completions` and `POST /v1/completions` are ever read; everything else,
and every request that opts into nothing, reaches vLLM and the client byte for byte.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from . import _json, _vllm_compat
from .config import MODE_HEADER, Mode, Settings
from .request import ENDPOINT_PATHS, Endpoint, Plan, RequestError, error_body, might_opt_in, plan_request
from .response import Clock, reshape_unary
from .stream import StreamReshaper

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
    """Hands the app the (possibly rewritten) body once, then the server's own `receive`."""

    __slots__ = ("_message", "_receive")

    def __init__(self, body: bytes, more_body: bool, receive: Receive) -> None:
        self._message: Message | None = {"type": "http.request", "body": body, "more_body": more_body}
        self._receive = receive

    async def __call__(self) -> Message:
        message = self._message
        if message is not None:
            self._message = None
            return message
        return await self._receive()


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
        content_type = b""
        mode_header: bytes | None = None
        declared_length = -1
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value
            elif name == _MODE_HEADER:
                mode_header = value
            elif name == b"content-length":
                declared_length = int(value) if value.isdigit() else -1
        if b"json" not in content_type.lower():
            await self.app(scope, self.receive, self.send)  # vLLM answers non-JSON bodies itself
            return

        mode = self.settings.mode
        if mode_header is not None and self.settings.allow_mode_header:
            try:
                mode = Mode.parse(mode_header.decode("latin-1"))
            except ValueError as exc:
                await self._refuse(RequestError(f"header `{MODE_HEADER}`: {exc}", MODE_HEADER), b"", False)
                return

        cap = self.settings.max_body_bytes
        if declared_length > cap:
            await self._refuse(_too_large(cap), b"", True)
            return
        parts: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await self.receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunk = bytes(message.get("body", b""))
            more = bool(message.get("more_body", False))
            size += len(chunk)
            parts.append(chunk)
            if size > cap:
                await self._refuse(_too_large(cap), b"".join(parts), more)
                return
        body = b"".join(parts)

        plan: Plan | None = None
        if might_opt_in(body):
            try:
                plan = plan_request(body, self.endpoint, mode)
            except RequestError as exc:
                await self._refuse(exc, body, False)
                return
        if plan is None:
            await self.app(scope, _Replay(body, False, self.receive), self.send)
            return
        if plan.body is not None:
            body = plan.body
            _set_header(scope, b"content-length", str(len(body)).encode())
        for name, value in plan.headers:
            _set_header(scope, name, value, replace=False)
        send = _Reshaping(plan, self.clock, self.send) if plan.reshapes_response else self.send
        await self.app(scope, _Replay(body, False, self.receive), send)

    async def _refuse(self, error: RequestError, body: bytes, more_body: bool) -> None:
        if _vllm_compat.auth_refuses(self.scope):
            # Mounted outside vLLM's auth: an unauthenticated caller gets vLLM's 401, not our verdict.
            await self.app(self.scope, _Replay(body, more_body, self.receive), self.send)
            return
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


def _too_large(cap: int) -> RequestError:
    return RequestError(f"Request body exceeds the {cap}-byte limit of vllm-nvext", None, 413)


class _Reshaping:
    """The `send` handed to vLLM when the response has to be reshaped."""

    __slots__ = ("plan", "clock", "send", "_kind", "_start", "_parts", "_stream")

    _PASS, _UNARY, _STREAM = 0, 1, 2

    def __init__(self, plan: Plan, clock: Clock, send: Send) -> None:
        self.plan = plan
        self.clock = clock
        self.send = send
        self._kind = self._PASS
        self._start: Message | None = None
        self._parts: list[bytes] = []
        self._stream: StreamReshaper | None = None

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
        out = stream.feed(body)
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
        try:
            obj = _json.loads(body)
            if reshape_unary(obj, self.plan, self.clock):
                body = _json.dumps(obj)
        except ValueError:
            pass  # not JSON after all: forwarded unchanged
        except Exception:  # never turn a good vLLM answer into a 500
            logger.exception("vllm-nvext could not reshape a response; forwarded unchanged")
        start = self._start
        assert start is not None
        headers = [(n, v) for n, v in start.get("headers", ()) if n.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        start["headers"] = headers
        await self.send(start)
        await self.send({"type": "http.response.body", "body": body, "more_body": False})


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

"""The ASGI middleware: wires request and response bytes to the pure modules.

Request plumbing lives in `_asgi_request.py`, the reshaping `send` in `_asgi_response.py`.

Only POSTs to the routes of `protocol.ENDPOINT_PATHS` (chat, completions, the chat batch route,
/invocations) are ever read; everything else, and every request that opts into nothing, reaches
vLLM and the client byte for byte (docs/protocol.md §10).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from . import _json, _vllm_compat, metrics
from ._asgi_request import ASGIApp, Message, PassThrough, Receive, Replay, Scope, Send, read_as_json, set_header
from ._asgi_response import ReshapingSend
from ._optin import OptInScan
from .config import MODE_HEADER, Mode, Settings
from .messages_api import plugin_serves_messages
from .messages_api import serve as serve_messages
from .nvext_values import Clock
from .protocol import ENDPOINT_PATHS, Endpoint, RequestError, error_body
from .request import Plan, read_request
from .request import plan as plan_request_for
from .responses_api import (
    AGENT_PATHS,
    AgentRoute,
    MessagesPlan,
    ResponsesSend,
    anthropic_error_body,
    plan_messages,
    plan_responses,
)

_MODE_HEADER = MODE_HEADER.encode()
# Set on the scope by the first instance, so a second mount (plugin and --middleware) is inert.
_HANDLED = "vllm_nvext.handled"


class NvextMiddleware:
    """Translate token ids between vLLM's placement and Dynamo's `nvext` (docs/protocol.md).

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
        serve_messages: bool = False,
    ) -> None:
        self.app = app
        self.settings = Settings.create(
            mode=mode, allow_mode_header=allow_mode_header, max_body_bytes=max_body_bytes, base=settings
        )
        # The plugin mount serves /v1/messages with ids itself (messages_api.py).
        self.serve_messages = serve_messages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or _HANDLED in scope:
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]  # `vllm serve --root-path` behind a proxy
        endpoint: Endpoint | AgentRoute | None = ENDPOINT_PATHS.get(path)
        if endpoint is None:
            endpoint = AGENT_PATHS.get(path)  # /v1/responses, /v1/messages: responses_api.py
        if endpoint is None or (
            endpoint is AgentRoute.MESSAGES and not self.serve_messages and plugin_serves_messages(scope)
        ):
            await self.app(scope, receive, send)  # (/v1/messages: the plugin mount inside serves it)
            return
        scope[_HANDLED] = True
        await _Exchange(self.app, self.settings, endpoint, scope, receive, send, self.serve_messages).run()


class _Exchange:
    """One request/response cycle through the middleware."""

    __slots__ = ("app", "settings", "endpoint", "scope", "receive", "send", "clock", "serve_messages")

    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        endpoint: Endpoint | AgentRoute,
        scope: Scope,
        receive: Receive,
        send: Send,
        serve_messages: bool = False,
    ) -> None:
        self.app = app
        self.serve_messages = serve_messages
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
        if not read_as_json(content_type):
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
        if isinstance(self.endpoint, AgentRoute):
            await self._agent_route(self.endpoint, body, scan.found, modes, dp_rank)
            return

        try:
            request = read_request(body, self.endpoint, scanned=True) if scan.found else None
            if request is None:
                metrics.count_request(self.endpoint, "none", self.settings.mode, metrics.UNKNOWN)
                await self.app(scope, Replay([body], False, self.receive), self.send)
                return
            mode = self._mode(modes)
            plan = plan_request_for(request, mode, dp_rank_header=dp_rank)
        except RequestError as exc:
            await self._refuse(exc, body, False)
            return
        if any(not isinstance(p, str) for p in plan.echo_prompts):
            decoded = await self._decode_echo_prompts(plan, request.data.get("model"))
            if decoded is None:
                return  # vLLM's own answer about the ids went to the client
            plan = replace(plan, echo_prompts=decoded)
        if plan.body is not None:
            body = plan.body
            set_header(scope, b"content-length", str(len(body)).encode())
        for name, value in plan.headers:
            set_header(scope, name, value, replace=False)
        metrics.count_request(self.endpoint, plan.dialect, mode, metrics.STREAM if plan.stream else metrics.UNARY)
        if not plan.reshapes_response:
            await self.app(scope, Replay([body], False, self.receive), self.send)
            return
        reshaping = ReshapingSend(plan, self.clock, self.send)
        try:
            await self.app(scope, Replay([body], False, self.receive), reshaping)
        finally:
            reshaping.count_stream()  # also for a stream the client cut short

    async def _agent_route(
        self, route: AgentRoute, body: bytes, found: bool, modes: list[bytes], dp_rank: bytes | None
    ) -> None:
        """/v1/responses and /v1/messages (docs/protocol.md §11)."""
        messages = route is AgentRoute.MESSAGES
        try:
            mode = self._mode(modes) if found else self.settings.mode
            plan = (
                (plan_messages if messages else plan_responses)(body, mode, dp_rank_header=dp_rank) if found else None
            )
            if isinstance(plan, MessagesPlan) and plan.ids and not self.serve_messages:
                raise plan.refusal()
        except RequestError as exc:
            await self._refuse(exc, body, False, anthropic_error_body(exc) if messages else None)
            return
        if plan is None:
            metrics.count_request(route, "none", self.settings.mode, metrics.UNKNOWN)
            await self.app(self.scope, Replay([body], False, self.receive), self.send)
            return
        if plan.body is not None:
            body = plan.body
            set_header(self.scope, b"content-length", str(len(body)).encode())
        for name, value in plan.headers:
            set_header(self.scope, name, value, replace=False)
        metrics.count_request(route, plan.dialect, mode, metrics.STREAM if plan.stream else metrics.UNARY)
        receive = Replay([body], False, self.receive)
        if isinstance(plan, MessagesPlan):
            if plan.ids:
                data = _json.loads_as_vllm(body)
                if not await serve_messages(self.app, self.scope, receive, self.send, data, plan.placements):
                    await self._send_error(plan.refusal(), anthropic_error_body(plan.refusal()))
                return
            await self.app(self.scope, receive, self.send)
            return
        await self.app(self.scope, receive, ResponsesSend(plan, self.send) if plan.reshapes else self.send)

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

    async def _decode_echo_prompts(self, plan: Plan, model: Any) -> tuple[str, ...] | None:
        """Each echoed id prompt as vLLM echoes it: decoded by vLLM's own `/detokenize`.

        None when vLLM refused to decode one; its answer (it names the bad id) went to the client.
        """
        texts: list[str] = []
        for prompt in plan.echo_prompts:
            if isinstance(prompt, str):
                texts.append(prompt)
                continue
            status, headers, body = await _internal_post(self.app, self.scope, "/detokenize", model, prompt)
            try:
                decoded = _json.loads(body) if status == 200 else None
            except ValueError:
                decoded = None  # not vLLM's answer shape: the client gets it as it came
            if not isinstance(decoded, dict) or not isinstance(decoded.get("prompt"), str):
                await self.send({"type": "http.response.start", "status": status, "headers": headers})
                await self.send({"type": "http.response.body", "body": body, "more_body": False})
                return None
            texts.append(decoded["prompt"])
        return tuple(texts)

    async def _pass_through(self, parts: list[bytes], scan: OptInScan) -> None:
        receive = PassThrough(parts, scan, self.receive)
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

    async def _refuse(self, error: RequestError, body: bytes, more_body: bool, payload: bytes | None = None) -> None:
        if _vllm_compat.auth_refuses(self.scope):
            # Mounted outside vLLM's auth: an unauthenticated caller gets vLLM's 401, not our verdict.
            await self.app(self.scope, Replay([body], more_body, self.receive), self.send)
            return
        await self._send_error(error, payload)

    async def _send_error(self, error: RequestError, payload: bytes | None = None) -> None:
        """`payload`: the error body when it is not vLLM's OpenAI envelope (the Anthropic route's)."""
        metrics.count_refusal(error.param, error.status)
        if payload is None:
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


async def _internal_post(
    app: ASGIApp, scope: Scope, route: str, model: Any, tokens: tuple[int, ...]
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """POST `{"model", "tokens"}` to one of vLLM's own routes in this process, with the client's credentials."""
    payload = {"tokens": list(tokens)} if model is None else {"model": model, "tokens": list(tokens)}
    body = _json.dumps(payload)
    root = scope.get("root_path", "")
    headers = [(n, v) for n, v in scope["headers"] if n == b"authorization"]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    sub: Scope = {
        **{k: v for k, v in scope.items() if k != _HANDLED},
        "path": root + route,
        "raw_path": (root + route).encode(),
        "query_string": b"",
        "headers": headers,
    }
    result: dict[str, Any] = {"status": 500, "headers": [], "body": []}
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:  # vLLM listens for a disconnect while it answers: none comes
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            result["status"] = message["status"]
            result["headers"] = list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            result["body"].append(bytes(message.get("body", b"")))

    await app(sub, receive, send)
    return result["status"], result["headers"], b"".join(result["body"])

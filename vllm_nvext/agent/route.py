"""One request on an agent route (/v1/responses, /v1/messages), for the middleware's exchange (docs/protocol.md §11).

Its plan (with the refusals only these routes have), its capture, and vLLM's answer, reshaped on
/v1/responses (`ResponsesSend`, the ASGI send over responses.py's reshaping) and served by the plugin mount on
/v1/messages (messages.py). The request's state
stays on the exchange that calls it (`middleware.exchange.Exchange`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Any, Protocol

from .. import _json, _vllm_compat, metrics
from ..asgi import Replay, RequestHeaders, set_header
from ..asgi_types import ASGIApp, Message, Receive, Scope, Send
from ..capture.keys import URL_SESSION
from ..capture.store import Sink
from ..capture.tap import Collector
from ..config import Mode, Settings
from ..protocol import RequestError
from .messages import MessagesPlan, anthropic_error_body, plan_messages
from .messages import serve as serve_messages
from .responses import (
    AgentRoute,
    ResponsesPlan,
    ResponsesStream,
    plan_responses,
    reshape_unary,
    rust_frontend_refusal,
)

logger = logging.getLogger("vllm_nvext")


class Exchange(Protocol):
    """What of the middleware's exchange (one request's state) an agent route reads."""

    app: ASGIApp
    settings: Settings
    scope: Scope
    receive: Receive
    send: Send
    arrived: tuple[float, float]
    serve_messages: bool  # the plugin mount serves /v1/messages with ids itself
    sink: Sink | None

    def mode(self, values: list[bytes]) -> Mode: ...

    def forward(self, body: bytes | None) -> Awaitable[None]: ...

    async def send_error(self, error: RequestError, payload: bytes | None = None) -> None: ...


def _plan(
    exchange: Exchange, messages: bool, body: bytes, found: bool, headers: RequestHeaders, mode: Mode
) -> MessagesPlan | ResponsesPlan | None:
    """The route's plan (None: to vLLM as sent), with the refusals only these routes have. Raises RequestError."""
    captured = exchange.sink is not None
    if not found and not captured:
        return None
    if messages:
        plan: MessagesPlan | ResponsesPlan | None = plan_messages(
            body, mode, dp_rank_header=headers.dp_rank, capture=captured
        )
    else:
        # The capture's logprobs (VLLM_NVEXT_CAPTURE_LOGPROBS), never where vLLM's Harmony rendering refuses them.
        logprobs = captured and exchange.settings.capture_logprobs
        logprobs = logprobs and not _vllm_compat.responses_use_harmony(exchange.scope)
        plan = plan_responses(body, mode, dp_rank_header=headers.dp_rank, capture=captured, logprobs=logprobs)
    if isinstance(plan, MessagesPlan) and plan.ids and not exchange.serve_messages:
        raise plan.refusal()
    if isinstance(plan, ResponsesPlan) and (rs := _vllm_compat.rust_frontend_version(exchange.scope)):
        if plan.asks_ids:
            raise rust_frontend_refusal(plan, rs)  # through the proxy (docs/scaling-out.md)
        if plan.capture:  # vllm-rs refuses enable_response_messages: not captured, never a 400 for capture
            plan = plan_responses(body, mode, dp_rank_header=headers.dp_rank) if found else None
    return plan


async def serve(exchange: Exchange, route: AgentRoute, body: bytes, found: bool, headers: RequestHeaders) -> None:
    """/v1/responses and /v1/messages: `found`, the body opts in (else it is read for the capture alone)."""
    messages = route is AgentRoute.MESSAGES
    try:
        mode = exchange.mode(headers.modes) if found else exchange.settings.mode
        plan = _plan(exchange, messages, body, found, headers, mode)
    except RequestError as exc:
        await exchange.send_error(exc, anthropic_error_body(exc) if messages else None)
        return
    if plan is None:
        await exchange.forward(body)
        return
    scope = exchange.scope
    if plan.body is not None:  # the body vLLM gets, with the plan's extra headers
        body = plan.body
        set_header(scope, b"content-length", str(len(body)).encode())
    for name, value in plan.headers:
        set_header(scope, name, value, replace=False)
    metrics.count_request(route, plan.dialect, mode, metrics.STREAM if plan.stream else metrics.UNARY)
    receive = Replay([body], False, exchange.receive)
    tap = _tap(exchange, plan.capture, messages, body)
    try:
        if isinstance(plan, MessagesPlan):
            if plan.ids or tap is not None:
                data = _json.loads_as_vllm(body)
                data.update(plan.dropped)  # as sent: vLLM's model ignores them, its errors count them
                logprobs = tap is not None and exchange.settings.capture_logprobs
                if await serve_messages(exchange.app, scope, receive, exchange.send, data, plan.placements, tap,
                                        logprobs):  # fmt: skip
                    return
                if plan.ids:
                    await exchange.send_error(plan.refusal(), anthropic_error_body(plan.refusal()))
                    return
            await exchange.app(scope, receive, exchange.send)
            return
        send = ResponsesSend(plan, exchange.send, tap) if plan.reshapes else exchange.send
        await exchange.app(scope, receive, send)
    finally:
        if tap is not None:
            tap.finish()


def _tap(exchange: Exchange, capture: bool, messages: bool, body: bytes) -> Collector | None:
    """What records this request's turn (None: not captured). On /v1/messages where the plugin does not serve it
    (`--middleware` alone) the ids are not there to read: counted as not captured on this mount."""
    sink = exchange.sink if capture and (not messages or exchange.serve_messages) else None
    if capture and sink is None and exchange.sink is not None:
        exchange.sink.not_on_this_mount("/v1/messages")
    path, data = "/v1/messages" if messages else "/v1/responses", _json.object_as_vllm(body) if sink else None
    scope = exchange.scope
    return Collector.of(
        sink, path, scope["headers"], data, exchange.arrived[0], exchange.settings.capture_body_keys,
        scope.get(URL_SESSION),
    )  # fmt: skip


class ResponsesSend:
    """The `send` handed to vLLM for a /v1/responses request that opts in."""

    __slots__ = ("plan", "send", "_start", "_parts", "_stream", "_unary", "tap")

    def __init__(self, plan: ResponsesPlan, send: Send, tap: Any = None) -> None:
        self.plan = plan
        self.send = send
        self.tap = tap
        self._start: Message | None = None
        self._parts: list[bytes] = []
        self._stream: ResponsesStream | None = None
        self._unary = False

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            headers = message.get("headers", ())
            content_type = b""
            encoded = False
            for name, value in headers:
                if name.lower() == b"content-type":
                    content_type = value.lower()
                elif name.lower() == b"content-encoding":
                    encoded = True
            if message["status"] == 200 and not encoded:
                if content_type.startswith(b"text/event-stream"):
                    self._stream = ResponsesStream(self.plan, self.tap)
                    message["headers"] = [(n, v) for n, v in headers if n.lower() != b"content-length"]
                elif content_type.startswith(b"application/json"):
                    self._unary = True
                    self._start = message
                    return  # held until the body is complete, to fix its length
            await self.send(message)
            return
        if kind != "http.response.body":
            await self.send(message)
            return
        body = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        if self._stream is not None:
            out = self._stream.feed(body) + (b"" if more else self._stream.flush())
            if out or not more:
                await self.send({"type": "http.response.body", "body": out, "more_body": more})
            return
        if not self._unary:
            await self.send(message)
            return
        self._parts.append(body)
        if not more:
            await self._send_unary(b"".join(self._parts))

    async def _send_unary(self, whole: bytes) -> None:
        """The held JSON answer, reshaped (as it came when it cannot be), with the start it held and its new length."""
        try:
            new = reshape_unary(whole, self.plan, self.tap)
        except ValueError:
            new = None  # not JSON after all: forwarded unchanged
        except Exception:  # never turn a good vLLM answer into a 500
            logger.exception("vllm-nvext could not reshape a response; forwarded unchanged")
            new = None
        if new is not None:
            whole = new
        start = self._start
        assert start is not None
        headers = [(n, v) for n, v in start.get("headers", ()) if n.lower() != b"content-length"]
        start["headers"] = headers + [(b"content-length", str(len(whole)).encode())]
        await self.send(start)
        await self.send({"type": "http.response.body", "body": whole, "more_body": False})

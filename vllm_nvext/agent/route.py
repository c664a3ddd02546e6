"""One request on an agent route (/v1/responses, /v1/messages), for the middleware's exchange (docs/protocol.md §11).

Its plan (with the refusals only these routes have), its capture, and vLLM's answer, reshaped on
/v1/responses and served by the plugin mount on /v1/messages (messages.py). The request's state
stays on the exchange that calls it (`middleware.exchange.Exchange`).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Protocol

from .. import _json, _vllm_compat, metrics
from ..asgi import Replay, RequestHeaders, set_header
from ..asgi_types import ASGIApp, Receive, Scope, Send
from ..capture.keys import URL_SESSION
from ..capture.store import Sink
from ..capture.tap import Collector
from ..config import Mode, Settings
from ..protocol import RequestError
from .messages import MessagesPlan, anthropic_error_body, plan_messages
from .messages import serve as serve_messages
from .responses import AgentRoute, ResponsesPlan, ResponsesSend, plan_responses, rust_frontend_refusal


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


async def serve(exchange: Exchange, route: AgentRoute, body: bytes, found: bool, headers: RequestHeaders) -> None:
    """/v1/responses and /v1/messages: `found`, the body opts in (else it is read for the capture alone)."""
    messages = route is AgentRoute.MESSAGES
    captured = exchange.sink is not None
    try:
        mode = exchange.mode(headers.modes) if found else exchange.settings.mode
        planner = plan_messages if messages else plan_responses
        plan = planner(body, mode, dp_rank_header=headers.dp_rank, capture=captured) if found or captured else None
        if isinstance(plan, MessagesPlan) and plan.ids and not exchange.serve_messages:
            raise plan.refusal()
        if isinstance(plan, ResponsesPlan) and (rs := _vllm_compat.rust_frontend_version(exchange.scope)):
            if plan.asks_ids:
                raise rust_frontend_refusal(plan, rs)  # through the proxy (docs/scaling-out.md)
            if plan.capture:  # vllm-rs refuses enable_response_messages: not captured, never a 400 for capture
                plan = plan_responses(body, mode, dp_rank_header=headers.dp_rank) if found else None
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
                if await serve_messages(exchange.app, scope, receive, exchange.send, data, plan.placements, tap):
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

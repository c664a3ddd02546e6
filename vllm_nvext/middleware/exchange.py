"""One request's cycle through the middleware, top-down: its body read (held to the cap while it may opt in),
its plan, vLLM's app awaited, and vLLM's answer reshaped by the send made for it (docs/protocol.md).

`NvextMiddleware` (middleware/__init__.py) routes a request and makes its exchange; the agent routes read
the exchange too (agent/route.py).
"""

from __future__ import annotations

from collections.abc import Awaitable
from functools import partial
from typing import Any

from .. import _vllm_compat, metrics
from ..agent import route as agent_route
from ..agent.responses import AgentRoute
from ..asgi import PassThrough, RequestHeaders, decode_echo_prompts, replay_body, send_error, set_header, too_large
from ..asgi_types import ASGIApp, Message, Receive, Scope, Send
from ..capture.keys import URL_SESSION
from ..capture.requests import plan_for_capture
from ..capture.store import Sink
from ..capture.tap import Collector
from ..config import Mode, Settings
from ..inbound import client_params
from ..inbound.optin import OptInScan
from ..inbound.plan import Plan, for_upstream
from ..inbound.request import plan as plan_request_for
from ..inbound.request import read_request
from ..kernels import Kernels
from ..outbound.nvext_values import Clock
from ..protocol import PATHS, Dialect, Endpoint, RequestError
from ..send import ReshapingSend


class Exchange:
    """One request/response cycle through the middleware."""

    __slots__ = ("app", "settings", "endpoint", "scope", "receive", "send", "arrived", "kernels", "body_request_id",
                 "strip", "serve_messages", "hides_reasoning_ids", "sink")  # fmt: skip

    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        endpoint: Endpoint | AgentRoute | None,
        scope: Scope,
        receive: Receive,
        send: Send,
        kernels: Kernels,
        arrived: tuple[float, float],
    ) -> None:
        self.app = app
        self.kernels = kernels
        self.serve_messages = False  # the plugin mount serves /v1/messages with ids itself
        self.settings = settings
        self.endpoint = endpoint
        self.scope = scope
        self.receive = receive
        self.send = send
        self.arrived = arrived  # `time.time()` and `time.perf_counter()` when the request came (`Clock`)
        self.body_request_id = False  # the body's `request_id` must be a plain name
        self.strip = False  # the address keys of the body's kv_transfer_params go (docs/scaling-out.md)
        self.hides_reasoning_ids = False  # the server withholds ids (`_vllm_compat.hides_reasoning_ids`)
        self.sink: Sink | None = None  # capture is on: every request is recorded (docs/capture.md)

    async def run(self, whole: bytes | None = None, headers: RequestHeaders | None = None) -> None:
        """One request, top-down: its headers and body, the plan, then vLLM, whose answer is reshaped. `whole`: the
        body, received in one message and found to opt in (JSON by its type); `headers`: once read for it."""
        if headers is None:
            headers = RequestHeaders.read(self.scope)
        if whole is None and not headers.json_body:
            await self.forward(None)  # vLLM does not read this body as JSON
            return
        read = await self._body(whole, headers.content_length)
        if read is None:
            return  # answered, passed through, or the client went away
        body, opts_in = read
        del read  # the client's bytes are `body` alone: dropped once the rewritten body replaces them
        endpoint = self.endpoint
        if endpoint is None:  # read for client_params' checks alone
            await self.app(self.scope, replay_body(body, self.receive), self.send)
            return
        if isinstance(endpoint, AgentRoute):
            await agent_route.serve(self, endpoint, body, opts_in, headers)  # agent/route.py
            return
        try:
            planned = self._plan(body, endpoint, opts_in, headers)
        except RequestError as exc:
            await self.send_error(exc)
            return
        if planned is None:
            await self.forward(body)
            return
        plan, mode, data = planned
        del planned
        if plan.body is not None:  # the body vLLM gets, set here: one function less per request
            body = plan.body
            set_header(self.scope, b"content-length", str(len(body)).encode())
        for name, value in plan.headers:
            set_header(self.scope, name, value, replace=False)
        reshaping = self._reshaping(endpoint, plan, mode, data)
        del data  # the decoded body and the client's bytes are not held while vLLM answers
        # vLLM's app is awaited here, not in a coroutine of its own: every time the app resumes (each
        # token of a stream) it passes through one frame of ours less.
        receive = replay_body(body, self.receive)
        if reshaping is None:
            await self.app(self.scope, receive, self.send)
            return
        try:
            await self.app(self.scope, receive, reshaping.app_send)
        finally:
            reshaping.count_stream()  # also for a stream the client cut short
            if reshaping.tap is not None:
                reshaping.tap.finish()  # the captured turn, to the store (also for a stream cut short)

    def _plan(
        self, body: bytes, endpoint: Endpoint, opts_in: bool, headers: RequestHeaders
    ) -> tuple[Plan, Mode, dict[str, Any]] | None:
        """The plan of a request on a translated route, its mode and decoded body; None: it goes to vLLM as the
        client sent it. Raises RequestError for a body vLLM's client gets a 400 for."""
        request = read_request(body, endpoint, scanned=True) if opts_in else None
        if request is None:  # captured alone, or to vLLM as the client sent it
            mode, hides, logprobs = self.settings.mode, self.hides_reasoning_ids, self.settings.capture_logprobs
            request, plan = plan_for_capture(body, endpoint, mode, hides, logprobs) if self.sink else (None, None)
        else:
            mode = self.mode(headers.modes) if headers.modes else self.settings.mode  # no header: the setting
            splice = self.kernels.splice_root
            plan = plan_request_for(request, mode, dp_rank_header=headers.dp_rank, capture=self.sink is not None,
                                    hides_reasoning_ids=self.hides_reasoning_ids, splice_root=splice,
                                    logprobs=self.settings.capture_logprobs)  # fmt: skip
        if request is None or plan is None:
            return None
        if _vllm_compat.UPSTREAM in self.scope:  # behind `vllm-nvext proxy`: vllm-rs writes its streams otherwise
            plan = for_upstream(plan, _vllm_compat.rust_frontend_version(self.scope))
        return plan, mode, request.data

    async def _body(self, whole: bytes | None, declared_length: int) -> tuple[bytes, bool] | None:
        """`_read_body`'s answer, for a body that came `whole` too (it opts in: the caller scanned it)."""
        if whole is None:
            return await self._read_body(declared_length)
        if len(whole) <= self.settings.max_body_bytes:
            return whole, True
        await self.send_error(too_large(self.settings.max_body_bytes))  # as `_read_body` refuses it
        return None

    async def _read_body(self, declared_length: int) -> tuple[bytes, bool] | None:
        """The whole body and whether it opts in; None once it was answered, passed on or abandoned.

        A body is held (up to the cap) only while it may opt in: a larger one that does not goes to
        vLLM as it streams in.
        """
        cap = self.settings.max_body_bytes
        # Keys besides the opt-in ones that make a body one to read (and hold to the cap).
        also = client_params.keys_to_read(self.body_request_id, self.strip)
        scan = OptInScan(also)
        parts: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await self.receive()
            if message["type"] != "http.request":
                return None  # the client went away before sending its body
            chunk = message.get("body", b"")
            chunk = chunk if type(chunk) is bytes else bytes(chunk)
            more = bool(message.get("more_body", False))
            size += len(chunk)
            parts.append(chunk)
            if scan.feed(chunk) and size > cap:
                await self.send_error(too_large(cap))
                return None
            if more and not scan.found and max(size, declared_length) > cap:
                if self.endpoint is not None:
                    metrics.count_request(self.endpoint, Dialect.NONE, self.settings.mode, metrics.UNKNOWN)
                await self._pass_through(parts, scan)  # too large to hold, and no opt-in so far
                return None
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        if also and scan.found:
            checked = await self._check_client_params(body)
            if checked is None:
                return None  # answered
            body = checked
        return body, scan.found

    def forward(self, body: bytes | None) -> Awaitable[None]:
        """To vLLM as the client sent it (`body` once read, else the client's own stream), answer untouched:
        vLLM's app, for the caller to await (no coroutine of ours between the two)."""
        if self.endpoint is not None:
            metrics.REQUESTS[self.endpoint, Dialect.NONE, self.settings.mode, metrics.UNKNOWN].inc()
        return self.app(self.scope, self.receive if body is None else replay_body(body, self.receive), self.send)

    def _reshaping(self, endpoint: Endpoint, plan: Plan, mode: Mode, data: dict[str, Any]) -> ReshapingSend | None:
        """The request counted; the send that reshapes vLLM's answer as the plan says (None: it goes out as is)."""
        metrics.REQUESTS[endpoint, plan.dialect, mode, metrics.STREAM if plan.stream else metrics.UNARY].inc()
        if not plan.reshapes_response:
            return None
        decode_echo = None
        # No echo (the common case): no generator entered.
        if plan.echo_prompts and any(not isinstance(p, str) for p in plan.echo_prompts):
            decode_echo = partial(decode_echo_prompts, self.app, self.scope, self.receive, model=data.get("model"))
        tap = None
        if plan.capture:  # told what the answer carries (docs/capture.md)
            tap = Collector.of(
                self.sink, PATHS[plan.endpoint], self.scope["headers"], data, self.arrived[0],
                self.settings.capture_body_keys, self.scope.get(URL_SESSION),
            )  # fmt: skip
        return ReshapingSend(plan, Clock(*self.arrived), self.send, self.kernels, endpoint, decode_echo, tap)

    def mode(self, values: list[bytes]) -> Mode:
        """The mode for a request that opts in (`client_params.request_mode`)."""
        return client_params.request_mode(self.settings.mode, self.settings.allow_mode_header, values)

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
            await self.send_error(too_large(self.settings.max_body_bytes))

    async def _check_client_params(self, body: bytes) -> bytes | None:
        """The body with the client's remote address stripped (when set); None once a refusal went out.

        Only reached past vLLM's key check (`NvextMiddleware.__call__`).
        """
        checked = client_params.checked_body(body, self.body_request_id, self.strip)
        if isinstance(checked, RequestError):
            await self.send_error(checked)
            return None
        if checked is not body:
            set_header(self.scope, b"content-length", str(len(checked)).encode())
        return checked

    async def send_error(self, error: RequestError, payload: bytes | None = None) -> None:
        await send_error(self.send, error, payload)

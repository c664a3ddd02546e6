"""The ASGI middleware: wires request and response bytes to the pure modules.

Request plumbing lives in `asgi.py`, the reshaping `send` in `send.py`.

Only POSTs to the routes of `protocol.ENDPOINT_PATHS` (chat, completions, the chat batch route,
/invocations) and the agent routes are ever translated (a few more are read for the client values
that reach further: `inbound.client_params.checks_on`); everything else, and every request that opts
into nothing, reaches vLLM and the client byte for byte (docs/protocol.md §10).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Awaitable
from functools import partial
from typing import Any

from . import _vllm_compat, metrics
from ._vllm_compat import ServerFacts
from .agent import route as agent_route
from .agent import websocket
from .agent.messages import plugin_serves_messages
from .agent.responses import AGENT_PATHS, AgentRoute
from .asgi import (
    HANDLED,
    ASGIApp,
    Message,
    PassThrough,
    Receive,
    Replay,
    RequestHeaders,
    Scope,
    Send,
    decode_echo_prompts,
    first_header,
    open_capture,
    replay_body,
    send_error,
    serve_sessions,
    set_header,
    too_large,
)
from .capture import render_hook
from .capture.requests import plan_for_capture
from .capture.store import Sink
from .capture.tap import Collector
from .config import Mode, Settings
from .inbound import client_params, fields
from .inbound.optin import OptInScan, opts_in_whole
from .inbound.plan import Plan, for_upstream
from .inbound.request import plan as plan_request_for
from .inbound.request import read_request
from .kernels import Kernels, pick
from .outbound.nvext_values import Clock
from .protocol import ENDPOINT_PATHS, PATHS, Dialect, Endpoint, RequestError
from .send import ReshapingSend

logger = logging.getLogger("vllm_nvext")


def prepare() -> None:
    """What a request would import or build on first use, for a server to do at start-up, before serving
    (the proxy does, off its loop); in vLLM's own server all of it is loaded by then."""
    metrics.enabled()
    fields.load_request_models()


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
        strip_kv_remote_address: bool | None = None,
        pure_python: bool | None = None,
        capture: str | None = None,
        capture_max_bytes: int | None = None,
        capture_retention_s: int | None = None,
        continue_ids: bool | None = None,
        serve_messages: bool = False,
    ) -> None:
        self.app = app
        self.settings = Settings.create(
            mode=mode,
            allow_mode_header=allow_mode_header,
            max_body_bytes=max_body_bytes,
            strip_kv_remote_address=strip_kv_remote_address,
            pure_python=pure_python,
            capture=capture,
            capture_max_bytes=capture_max_bytes,
            capture_retention_s=capture_retention_s,
            continue_ids=continue_ids,
            base=settings,
        )
        self.kernels = pick(self.settings.pure_python)  # the compiled kernels, or their Python twins
        self.stream_path = self.kernels.impl  # "c" or "python"
        metrics.set_stream_path(self.stream_path)
        metrics.report_vllm_version()  # an untested vLLM: a warning and a gauge, once per process
        announce = "vllm-nvext: the %s stream path runs (VLLM_NVEXT_PURE_PYTHON=1 forces Python)"
        logger.info(announce, self.stream_path)
        if "vllm.logger" in sys.modules:
            # Inside vLLM's server, whose logging prints only its own `vllm` loggers: say it there too.
            logging.getLogger("vllm.nvext").info(announce, self.stream_path)
        # The plugin mount serves /v1/messages with ids itself (agent/messages.py).
        self.serve_messages = serve_messages
        if self.settings.continue_ids:  # VLLM_NVEXT_CONTINUE_IDS: vLLM's chat rendering wrapped (docs/capture.md)
            render_hook.install()
        self.sink = open_capture(self.settings)  # docs/capture.md; None: capture off, nothing of it runs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.sink is not None and await serve_sessions(self.app, self.sink, scope, receive, send):
            return  # the capture's read API (docs/capture.md), after vLLM's key check
        if scope["type"] != "http" or scope.get("method") != "POST" or HANDLED in scope:
            # Codex's WebSocket attempt on /v1/responses gets "use HTTP" (docs/protocol.md §11.4).
            await (websocket.refuse(scope, send) if websocket.refuses(scope) else self.app(scope, receive, send))
            return
        routed = self._route(scope)
        if routed is None:
            # Mounted outside vLLM's key check, a request it refuses reaches it untouched: nothing of the
            # middleware runs before the check (docs/protocol.md §10). /v1/messages: the plugin mount serves it.
            await self.app(scope, receive, send)
            return
        if isinstance(routed, RequestError):
            await send_error(send, routed)
            return
        endpoint, body_request_id, strip, facts = routed
        scope[HANDLED] = True
        arrived = (time.time(), time.perf_counter())  # when the request came, before its body (nvext `timing`)
        whole = None  # the body, when it came in one message, opts in and is read as JSON
        headers = None  # its headers, once read (`_Exchange.run` reads them otherwise)
        if not body_request_id and not strip and self.sink is None:
            # Only the opt-in keys make this body one to read: one that comes whole is scanned here
            # (`optin.opts_in_whole`, the verdict of `_Exchange._read_body`'s scan), and goes on to
            # vLLM at once when it names none or vLLM does not read it as JSON.
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                body = message.get("body", b"")
                whole = body if type(body) is bytes else bytes(body)
                if not opts_in_whole(whole) or not (headers := RequestHeaders.read(scope)).json_body:
                    metrics.REQUESTS[endpoint, Dialect.NONE, self.settings.mode, metrics.UNKNOWN].inc()
                    await self.app(scope, replay_body(whole, receive), send)
                    return
            else:
                receive = Replay.again(message, receive)  # `_Exchange` reads it as the first of many
        exchange = _Exchange(self.app, self.settings, endpoint, scope, receive, send, self.kernels, arrived)
        exchange.serve_messages, exchange.body_request_id, exchange.strip = self.serve_messages, body_request_id, strip
        exchange.hides_reasoning_ids, exchange.sink = facts.hides_reasoning_ids, self.sink
        await exchange.run(whole, headers)

    def _route(
        self, scope: Scope
    ) -> tuple[Endpoint | AgentRoute | None, bool, bool, ServerFacts] | RequestError | None:
        """What the middleware does with a POST: None, it goes to vLLM untouched; a refusal of its X-Request-Id;
        or its route (None: read for `client_params`' checks alone), the checks its body gets, the server's facts."""
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]  # `vllm serve --root-path` behind a proxy
        endpoint: Endpoint | AgentRoute | None = ENDPOINT_PATHS.get(path)
        if endpoint is None:
            endpoint = AGENT_PATHS.get(path)  # /v1/responses, /v1/messages: agent/
        facts = _vllm_compat.server_facts(scope)
        # A server whose kv connector joins request ids into file paths gets plain names only.
        request_id = first_header(scope, b"x-request-id") if facts.paths_from_request_ids else None
        if (
            request_id is not None
            and not client_params.is_plain_name(request_id.decode("latin-1"))
            and not _vllm_compat.auth_refuses(scope, facts)
        ):
            return RequestError(client_params.not_plain_message("X-Request-Id"), client_params.REQUEST_ID_HEADER)
        # What of the body reaches further (a route translated nowhere is read for this alone).
        body_request_id, strip = client_params.checks_on(
            path, endpoint is not None, facts.paths_from_request_ids, request_id, self.settings.strip_kv_remote_address
        )
        if (
            (endpoint is None and not body_request_id and not strip)
            or (facts.key_digests and _vllm_compat.auth_refuses(scope, facts))  # without a key vLLM refuses nothing
            or (endpoint is AgentRoute.MESSAGES and not self.serve_messages and plugin_serves_messages(scope))
        ):
            return None
        return endpoint, body_request_id, strip, facts


class _Exchange:
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
            mode, hides = self.settings.mode, self.hides_reasoning_ids
            request, plan = plan_for_capture(body, endpoint, mode, hides) if self.sink else (None, None)
        else:
            mode = self.mode(headers.modes) if headers.modes else self.settings.mode  # no header: the setting
            splice = self.kernels.splice_root
            plan = plan_request_for(request, mode, dp_rank_header=headers.dp_rank, capture=self.sink is not None,
                                    hides_reasoning_ids=self.hides_reasoning_ids, splice_root=splice)  # fmt: skip
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
            tap = Collector.of(self.sink, PATHS[plan.endpoint], self.scope["headers"], data, self.arrived[0])
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

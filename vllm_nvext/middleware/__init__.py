"""The ASGI middleware: routes each request and wires its bytes to the pure modules.

Request plumbing lives in `asgi.py`, the reshaping `send` in `send.py`, one request's cycle (its body, plan
and answer) in `middleware/exchange.py`, the capture's sink and its shutdown in `middleware/capture.py`.

Only POSTs to the routes of `protocol.ENDPOINT_PATHS` (chat, completions, the chat batch route,
/invocations) and the agent routes are ever translated (a few more are read for the client values
that reach further: `inbound.client_params.checks_on`); everything else, and every request that opts
into nothing, reaches vLLM and the client byte for byte (docs/protocol.md §10).
"""

from __future__ import annotations

import logging
import sys
import time

from .. import _vllm_compat, metrics
from .._vllm_compat import ServerFacts
from ..agent import websocket
from ..agent.messages import plugin_serves_messages
from ..agent.responses import AGENT_PATHS, AgentRoute
from ..asgi import HANDLED, Replay, RequestHeaders, first_header, replay_body, send_error
from ..asgi_types import ASGIApp, Receive, Scope, Send
from ..capture import render_hook
from ..config import Mode, Settings
from ..inbound import client_params, fields
from ..inbound.optin import opts_in_whole
from ..kernels import pick
from ..protocol import ENDPOINT_PATHS, Dialect, Endpoint, RequestError
from .capture import CaptureMount
from .exchange import Exchange
from .sessions import serve_sessions
from .url import rewrite

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
        capture_api: str | None = None,
        capture_body_keys: bool | None = None,
        capture_logprobs: bool | None = None,
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
            capture_api=capture_api,
            capture_body_keys=capture_body_keys,
            capture_logprobs=capture_logprobs,
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
        # This process's capture (docs/capture.md), shared with the other mount: one sink, one writer; None: capture
        # off, nothing of it runs. VLLM_NVEXT_CONTINUE_IDS: vLLM's chat rendering wrapped, at start-up.
        self.capture = CaptureMount.start(self.settings)
        self.sink = None if self.capture is None else self.capture.sink

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.sink is not None and not self.sink.tokenizer_sought and scope["type"] == "http":
            self.sink.tokenizer_sought = True  # once: vLLM's tokenizer, for a break's texts (docs/capture.md)
            self.sink.decode = render_hook.vllm_decode(scope.get("app"))
        if await rewrite(scope, send):
            return  # `/nvext/sessions/{id}/...`: refused (vLLM's 401, a bad id's 400); else now the route it names
        if self.sink is not None and await serve_sessions(
            self.app, self.sink, self.settings.capture_api, scope, receive, send
        ):
            return  # the capture's read API (docs/capture.md), after vLLM's key check
        if self.capture is not None and scope["type"] == "lifespan":
            await self.app(scope, receive, self.capture.closing(send))  # the queued turns written at shutdown
            return
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
        headers = None  # its headers, once read (`Exchange.run` reads them otherwise)
        if not body_request_id and not strip and self.sink is None:
            # Only the opt-in keys make this body one to read: one that comes whole is scanned here
            # (`optin.opts_in_whole`, the verdict of `Exchange._read_body`'s scan), and goes on to
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
                receive = Replay.again(message, receive)  # `Exchange` reads it as the first of many
        exchange = Exchange(self.app, self.settings, endpoint, scope, receive, send, self.kernels, arrived)
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

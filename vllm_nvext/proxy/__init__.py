"""`vllm-nvext proxy`: the middleware out of process, in front of any vLLM OpenAI server.

`NvextProxy` is an ASGI app: the unchanged `NvextMiddleware` around `Forwarder`, which sends every
request (any route, any method) to the upstream server with one pooled `aiohttp.ClientSession`, the
request body streamed up and the response streamed down as it comes, so the translation is the
mounted middleware's, byte for byte (docs/scaling-out.md, "Out of process"). aiohttp, not httpx:
it reads a stream at a fraction of httpx's CPU per event (docs/performance.md, "The proxy's hop").

What the middleware gets from inside vLLM when mounted, it gets here from outside:
- vLLM's key check: the proxy's `--api-key` (default `VLLM_API_KEY`), the upstream's keys, rides on
  the scope (`_vllm_compat.API_KEYS`) so the middleware never answers a request the upstream
  would refuse for auth; the upstream still checks every request itself.
- echo's `/detokenize`: the middleware's in-process sub-request reaches `Forwarder`, hence the
  upstream's own `/detokenize`, with the client's credentials.
- its counters: `GET /metrics` answers the upstream's `/metrics` followed by the proxy's own
  `vllm_nvext:*` families (summed over `--workers` processes).

The package: `config` (ProxyConfig), `headers` (what crosses the hop, as bytes), `forward` (the
Forwarder: the requests, the lifespan, `/metrics`); here, the app of each worker and `serve`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import aiohttp

from .. import _vllm_compat
from ..asgi_types import Receive, Scope, Send
from ..config import ENV_ALLOW_MODE_HEADER, ENV_MAX_BODY_BYTES, ENV_MODE, Settings, capture_environ
from ..middleware import NvextMiddleware
from ..protocol import UPSTREAM_RELEASE
from .config import CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S, ENV_CONFIG, ProxyConfig
from .forward import METRICS_PATH, Forwarder, own_metrics, prepare
from .headers import HOP_BY_HOP, request_headers, response_headers

__all__ = [
    "CONNECT_TIMEOUT_S",
    "DEFAULT_TIMEOUT_S",
    "ENV_CONFIG",
    "HOP_BY_HOP",
    "METRICS_PATH",
    "Forwarder",
    "NvextProxy",
    "ProxyConfig",
    "app_from_env",
    "own_metrics",
    "prepare",
    "request_headers",
    "response_headers",
    "serve",
]


class NvextProxy:
    """`NvextMiddleware` around `Forwarder`, with the upstream's keys for the middleware's auth check."""

    def __init__(
        self, config: ProxyConfig, settings: Settings | None = None, session: aiohttp.ClientSession | None = None
    ):
        self.forwarder = Forwarder(config, session)
        self.middleware = NvextMiddleware(self.forwarder, settings=settings)
        self.api_keys = config.api_keys
        self.server_args = SimpleNamespace(
            api_key=list(config.api_keys),
            reasoning_parser=config.reasoning_parser,
            enable_auto_tool_choice=config.enable_auto_tool_choice,
            tool_call_parser=config.tool_call_parser,
            kv_transfer_config=config.kv_transfer_config,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[_vllm_compat.API_KEYS] = self.api_keys
        scope[_vllm_compat.SERVER_ARGS] = self.server_args
        scope[_vllm_compat.UPSTREAM] = self.forwarder.upstream
        # The messages written for this request are sanitized by the upstream's release's rules.
        token = UPSTREAM_RELEASE.set(self.forwarder.upstream.version)
        try:
            await self.middleware(scope, receive, send)
        finally:
            UPSTREAM_RELEASE.reset(token)


def app_from_env() -> NvextProxy:
    """The app of each uvicorn worker: ProxyConfig from ENV_CONFIG, Settings from VLLM_NVEXT_*."""
    return NvextProxy(ProxyConfig.from_json(os.environ[ENV_CONFIG]), Settings.from_env())


def serve(config: ProxyConfig, settings: Settings, *, host: str, port: int, workers: int = 1) -> None:
    """Serve NvextProxy with uvicorn (imported here: vLLM installs it) in `workers` processes."""
    import tempfile

    import uvicorn

    os.environ[ENV_CONFIG] = config.to_json()
    # Each worker builds its Settings from the environment: these are the validated ones.
    os.environ[ENV_MODE] = settings.mode.value
    os.environ[ENV_ALLOW_MODE_HEADER] = "1" if settings.allow_mode_header else "0"
    os.environ[ENV_MAX_BODY_BYTES] = str(settings.max_body_bytes)
    os.environ.update(capture_environ(settings))  # `--capture`: every worker records (docs/capture.md)
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Each worker counts into its own files; any worker's /metrics sums them (as vLLM does).
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="vllm-nvext-proxy-metrics-")
    uvicorn.run(
        "vllm_nvext.proxy:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        # The upstream's own `server` and `date` headers pass through; none of the proxy's beside them.
        server_header=False,
        date_header=False,
        # The client's address as TCP gives it: `forwarded` decides what its X-Forwarded-* are worth.
        proxy_headers=False,
        lifespan="on",
        # uvicorn's fastest stack where installed (vLLM installs uvloop and httptools; "auto" falls
        # back to asyncio and h11), and no access log line per request.
        loop="auto",
        http="auto",
        access_log=False,
    )

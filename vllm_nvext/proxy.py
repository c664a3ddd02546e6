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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from . import _vllm_compat, metrics
from .asgi import Message, Receive, Scope, Send
from .config import ENV_ALLOW_MODE_HEADER, ENV_MAX_BODY_BYTES, ENV_MODE, Settings, capture_environ
from .middleware import NvextMiddleware
from .protocol import error_body

logger = logging.getLogger("vllm_nvext")

# Connection-specific headers (RFC 9110 §7.6.1, and the ones HTTP/1.1 proxies have always dropped):
# never forwarded in either direction. `host` is the upstream's, set by the client library.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
METRICS_PATH = "/metrics"
# Headers aiohttp would add of its own (`host` aside, which is the upstream's).
_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# The proxy's settings for the worker processes uvicorn spawns (JSON of ProxyConfig).
ENV_CONFIG = "VLLM_NVEXT_PROXY_CONFIG"
DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
_METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class ProxyConfig:
    """Where the upstream is, how long to wait for it, and the keys its `--api-key` check takes."""

    upstream: str
    api_keys: tuple[str, ...] = ()
    # Seconds to wait for each read from (or write to) the upstream; None: no limit.
    timeout: float | None = DEFAULT_TIMEOUT_S
    connect_timeout: float = CONNECT_TIMEOUT_S
    # The upstream's own `vllm serve` flags the middleware reads from vLLM's args when mounted:
    # a parser makes vLLM withhold ids under `include_reasoning: false`; a kv connector may name
    # files after request ids (`_vllm_compat.hides_reasoning_ids`, `builds_paths_from_request_ids`).
    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    kv_transfer_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        url = urlsplit(self.upstream)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"upstream: expected an http:// or https:// URL, got {self.upstream!r}")
        object.__setattr__(self, "upstream", self.upstream.rstrip("/"))
        object.__setattr__(self, "api_keys", tuple(k for k in self.api_keys if k))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProxyConfig:
        raw = json.loads(text)
        return cls(**{**raw, "api_keys": tuple(raw.get("api_keys", ()))})


class _ClientGone(Exception):
    """The client disconnected while its request body was still coming."""


class Forwarder:
    """The app inside the middleware: every request to the upstream, streamed both ways."""

    def __init__(self, config: ProxyConfig, session: aiohttp.ClientSession | None = None) -> None:
        self.config = config
        self._session = session

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made in the serving process, on its event loop
            self._session = aiohttp.ClientSession(
                # No cap on concurrent requests (each stream holds a connection); idle ones kept.
                connector=aiohttp.TCPConnector(limit=0),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.config.connect_timeout, sock_read=self.config.timeout
                ),
                # A proxy keeps no cookies: one client's would go to the next.
                cookie_jar=aiohttp.DummyCookieJar(),
                # Only what the client sent: none of the client library's own headers (the upstream's
                # `host` aside), and the body's bytes as they come (compressed stays compressed).
                skip_auto_headers=_AUTO_HEADERS,
                auto_decompress=False,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if scope.get("method") == "GET" and scope.get("path") == METRICS_PATH:
                await self._metrics(scope, send)
            else:
                await self.forward(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1011})  # not proxied (docs/scaling-out.md)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                metrics.enabled()  # the families exist (empty) from the first scrape on
                await send({"type": "lifespan.startup.complete"})
            else:  # lifespan.shutdown
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def url(self, scope: Scope) -> URL:
        """The upstream's URL for this request: the client's path and query as it sent them (no re-quoting)."""
        raw: bytes = scope.get("raw_path") or scope["path"].encode()
        query: bytes = scope.get("query_string", b"")
        text = self.config.upstream + raw.decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
        return URL(text, encoded=True)

    async def forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        """One request to the upstream; the client going away closes the upstream request."""
        first = await receive()
        if first["type"] != "http.request":
            return  # gone before sending anything
        body: _Body | None = None
        data: bytes | AsyncIterator[bytes] | None
        if first.get("more_body", False):
            body = _Body(receive)
            data = body.chunks(first)
        else:
            data = bytes(first.get("body", b"")) or None
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in request_headers(scope["headers"])]
        exchange = asyncio.ensure_future(self._exchange(scope["method"], self.url(scope), headers, data, body, send))
        watch = asyncio.ensure_future(_client_gone(receive, body))
        try:
            await asyncio.wait((exchange, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not exchange.done():
                exchange.cancel()  # closes the upstream connection: vLLM aborts the request
            with contextlib.suppress(asyncio.CancelledError):
                await exchange  # re-raises a failure mid-response: the server cuts the connection

    async def _exchange(
        self,
        method: str,
        url: URL,
        headers: list[tuple[str, str]],
        data: bytes | AsyncIterator[bytes] | None,
        body: _Body | None,
        send: Send,
    ) -> None:
        try:
            response = await self.session.request(method, url, headers=headers, data=data, allow_redirects=False)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if body is not None and body.gone:
                return  # the client left while its body came: nobody to answer
            if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are TimeoutErrors too
                await _send_error(send, 504, "vllm-nvext proxy: the upstream server did not answer in time")
            else:
                await _send_error(send, 502, "vllm-nvext proxy: the upstream server could not be reached")
            return
        try:
            headers_out = response_headers(response.raw_headers)
            await send({"type": "http.response.start", "status": response.status, "headers": headers_out})
            async for chunk in response.content.iter_any():  # never an empty chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except BaseException:
            response.close()  # mid-response (a failure, or the client gone): the connection is dropped
            raise
        response.release()  # read to its end: the connection goes back to the pool

    async def _metrics(self, scope: Scope, send: Send) -> None:
        """The upstream's `/metrics`, then the proxy's own families."""
        upstream = b""
        headers = [(n.decode("latin-1"), v.decode("latin-1")) for n, v in scope["headers"] if n == b"authorization"]
        try:
            async with self.session.get(
                self.config.upstream + METRICS_PATH, headers=[*headers, ("accept", "text/plain")]
            ) as response:
                if response.status == 200:
                    upstream = await response.read()
        except (aiohttp.ClientError, TimeoutError):
            pass  # the proxy's own counters still answer
        if upstream and not upstream.endswith(b"\n"):
            upstream += b"\n"
        body = upstream + own_metrics()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", _METRICS_CONTENT_TYPE), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body, "more_body": False})


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
        await self.middleware(scope, receive, send)


def app_from_env() -> NvextProxy:
    """The app of each uvicorn worker: ProxyConfig from ENV_CONFIG, Settings from VLLM_NVEXT_*."""
    return NvextProxy(ProxyConfig.from_json(os.environ[ENV_CONFIG]), Settings.from_env())


def request_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's headers less hop-by-hop ones, those its `Connection` names, `host` and `expect`.

    The proxy's own server has answered `Expect: 100-continue` already; the upstream gets the body.
    """
    drop = _connection_named(headers) | {b"host", b"expect"}
    return [(n, v) for n, v in headers if n not in HOP_BY_HOP and n not in drop]


def response_headers(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The upstream's headers less hop-by-hop ones (the proxy's server frames the body itself)."""
    lowered = [(n.lower(), v) for n, v in headers]
    drop = _connection_named(lowered)
    return [(n, v) for n, v in lowered if n not in HOP_BY_HOP and n not in drop]


def _connection_named(headers: Sequence[tuple[bytes, bytes]]) -> set[bytes]:
    return {t.strip().lower() for n, v in headers if n == b"connection" for t in v.split(b",")}


class _Body:
    """A request body that comes in several messages, read as it arrives (the client's flow control
    is the upstream's); `gone` once the client left before its end."""

    __slots__ = ("receive", "done", "gone")

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.done = asyncio.Event()
        self.gone = False

    async def chunks(self, first: Message) -> AsyncIterator[bytes]:
        try:
            chunk = first.get("body", b"")
            if chunk:
                yield bytes(chunk)
            more = True
            while more:
                message = await self.receive()
                if message["type"] != "http.request":
                    self.gone = True
                    raise _ClientGone  # aborts the upstream request: it never gets half a body
                more = bool(message.get("more_body", False))
                chunk = message.get("body", b"")
                if chunk:
                    yield bytes(chunk)
        finally:
            self.done.set()


async def _client_gone(receive: Receive, body: _Body | None) -> None:
    """Returns when the client disconnects (after its body: until then the body's reader listens)."""
    if body is not None:
        await body.done.wait()
        if body.gone:
            return
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_error(send: Send, status: int, message: str) -> None:
    payload = error_body(message, None, status)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def own_metrics() -> bytes:
    """The proxy's `vllm_nvext:*` families in Prometheus text (summed over processes in multiprocess mode)."""
    try:
        from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector
    except ImportError:
        return b""
    source: Any = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        source = CollectorRegistry()
        MultiProcessCollector(source)  # type: ignore[no-untyped-call]

    class Ours:
        def collect(self) -> Iterator[Any]:
            return (f for f in source.collect() if f.name.startswith(metrics.PREFIX))

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Ours())
    return bytes(generate_latest(registry))


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
        lifespan="on",
        # uvicorn's fastest stack where installed (vLLM installs uvloop and httptools; "auto" falls
        # back to asyncio and h11), and no access log line per request.
        loop="auto",
        http="auto",
        access_log=False,
    )

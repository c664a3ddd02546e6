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
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp import http_writer
from yarl import URL

from . import _vllm_compat, metrics
from .asgi import Message, Receive, Scope, Send, forwarded, is_trusted, trusted_networks
from .config import ENV_ALLOW_MODE_HEADER, ENV_MAX_BODY_BYTES, ENV_MODE, Settings, capture_environ
from .middleware import NvextMiddleware
from .middleware import prepare as prepare_middleware
from .protocol import error_body

logger = logging.getLogger("vllm_nvext")

# Connection-specific headers (RFC 9110 §7.6.1, and the ones HTTP/1.1 proxies have always dropped):
# never forwarded in either direction. `host` is the upstream's, set by the client library.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                        b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})  # fmt: skip
METRICS_PATH = "/metrics"
# Headers aiohttp would add of its own (`host` aside, which is the upstream's).
_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
# The proxy's settings for the worker processes uvicorn spawns (JSON of ProxyConfig).
ENV_CONFIG = "VLLM_NVEXT_PROXY_CONFIG"
DEFAULT_TIMEOUT_S = 600.0
CONNECT_TIMEOUT_S = 10.0
_METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# A request body sent up in pieces of this size: aiohttp and the socket's buffer never copy it whole.
_UP_PIECE = 1 << 16
_FAMILY = re.compile(rb"^# (?:TYPE|HELP) (\S+)", re.MULTILINE)


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
    # The peers whose X-Forwarded-* / Forwarded headers are kept (addresses, networks, or "*").
    forwarded_allow_ips: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        url = urlsplit(self.upstream)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"upstream: expected an http:// or https:// URL, got {self.upstream!r}")
        object.__setattr__(self, "upstream", self.upstream.rstrip("/"))
        object.__setattr__(self, "api_keys", tuple(k for k in self.api_keys if k))
        allowed = tuple(a.strip() for a in self.forwarded_allow_ips if a.strip())
        object.__setattr__(self, "forwarded_allow_ips", allowed)
        trusted_networks(allowed)  # refuses a bad entry here, in the command, not in each worker

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProxyConfig:
        raw = json.loads(text)
        tuples = {k: tuple(raw.get(k, ())) for k in ("api_keys", "forwarded_allow_ips")}
        return cls(**{**raw, **tuples})


class _ClientGone(Exception):
    """The client disconnected while its request body was still coming."""


class Forwarder:
    """The app inside the middleware: every request to the upstream, streamed both ways."""

    def __init__(self, config: ProxyConfig, session: aiohttp.ClientSession | None = None) -> None:
        self.config = config
        self._session = session
        self._trusted = trusted_networks(config.forwarded_allow_ips)
        # The upstream's `GET /version` `rust_frontend_version` (vLLM's Rust frontend, `vllm-rs`), once it answered.
        self.upstream = SimpleNamespace(rust_frontend_version=None)
        self._version_task: asyncio.Task[None] | None = None

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
            elif not scope["path"].startswith("/"):  # `OPTIONS *`: no route of the upstream's, stock's 404
                await _send_json(send, 404, b'{"detail":"Not Found"}')
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
                # Before serving, in a thread: every import a request would reach, never on the loop later.
                await asyncio.to_thread(prepare)
                metrics.enabled()  # the families exist (empty) from the first scrape on
                self._version_task = asyncio.create_task(self._read_version())
                await send({"type": "lifespan.startup.complete"})
            else:  # lifespan.shutdown
                if self._version_task is not None:
                    self._version_task.cancel()
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _read_version(self, every: float = 2.0) -> None:
        """The upstream's `/version`, asked until it answers (it may start after the proxy): whether it is
        `vllm-rs`, which refuses what vLLM's Python server answers ids on /v1/responses with (docs/scaling-out.md)."""
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with self.session.get(self.config.upstream + "/version") as resp:
                    if resp.status == 200:
                        answer = await resp.json(content_type=None)
                        version = answer.get("rust_frontend_version") if isinstance(answer, dict) else None
                        self.upstream.rust_frontend_version = version if isinstance(version, str) else None
                        return
            await asyncio.sleep(every)

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
        data: bytes | AsyncIterator[bytes] | AsyncIterator[memoryview] | None
        if first.get("more_body", False):
            body = _Body(receive)
            data = body.chunks(first)
        else:
            whole = first.get("body", b"")
            data = (whole if type(whole) is bytes else bytes(whole)) or None
            if data is not None and len(data) > _UP_PIECE:
                data = _pieces(data)
        headers = [(_text(n), _text(v)) for n, v in self.headers(scope)]
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

    def headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        """The headers the upstream gets: the client's (`request_headers`) with the proxy's X-Forwarded-*."""
        headers = request_headers(scope["headers"])
        client = scope.get("client")
        peer = client[0] if client else None
        return forwarded(headers, peer, scope.get("scheme", "http"), trusted=is_trusted(peer, self._trusted))

    async def _exchange(
        self,
        method: str,
        url: URL,
        headers: list[tuple[str, str]],
        data: bytes | AsyncIterator[bytes] | AsyncIterator[memoryview] | None,
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
        # Each family once: one the upstream already exposes (vllm-nvext mounted there) is its copy alone.
        theirs = frozenset(m.decode("latin-1") for m in _FAMILY.findall(upstream))
        body = upstream + await asyncio.to_thread(own_metrics, theirs)  # reads the workers' files: off the loop
        await _send_json(send, 200, body, _METRICS_CONTENT_TYPE)


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
        await self.middleware(scope, receive, send)


def prepare() -> None:
    """Every import a request would reach (the middleware's, and `own_metrics`'): at start-up, in a thread."""
    prepare_middleware()
    with contextlib.suppress(ImportError):
        import prometheus_client.multiprocess  # noqa: F401


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


def _text(raw: bytes) -> str:
    """Header bytes as a str aiohttp writes back to the same bytes (`_serialize_headers` below)."""
    return raw.decode("utf-8", "surrogateescape")


_aiohttp_serialize_headers = http_writer._serialize_headers


def _serialize_headers(status_line: str, headers: Any) -> bytes:
    """aiohttp's header serializer, which writes a str as UTF-8; a header that came as bytes that are
    not UTF-8 (`_text`'s surrogates, which aiohttp would drop) is written back as those bytes."""
    if all(k.isascii() and v.isascii() for k, v in headers.items()):
        return bytes(_aiohttp_serialize_headers(status_line, headers))
    safe = http_writer._safe_header  # aiohttp's refusal of CR, LF and other controls
    lines = [safe(status_line), *(f"{safe(k)}: {safe(v)}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


http_writer._serialize_headers = _serialize_headers  # what `StreamWriter.write_headers` calls


async def _pieces(data: bytes) -> AsyncIterator[memoryview]:
    """A held body sent up as views of it (no copy), so aiohttp never joins it to the headers."""
    view = memoryview(data)
    for start in range(0, len(data), _UP_PIECE):
        yield view[start : start + _UP_PIECE]


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
    await _send_json(send, status, error_body(message, None, status))


async def _send_json(send: Send, status: int, payload: bytes, content_type: bytes = b"application/json") -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def own_metrics(skip: frozenset[str] = frozenset()) -> bytes:
    """The proxy's `vllm_nvext:*` families in Prometheus text (summed over processes in multiprocess mode),
    less those named in `skip`."""
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
            return (f for f in source.collect() if f.name.startswith(metrics.PREFIX) and f.name not in skip)

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
        # The client's address as TCP gives it: `forwarded` decides what its X-Forwarded-* are worth.
        proxy_headers=False,
        lifespan="on",
        # uvicorn's fastest stack where installed (vLLM installs uvloop and httptools; "auto" falls
        # back to asyncio and h11), and no access log line per request.
        loop="auto",
        http="auto",
        access_log=False,
    )

"""The app inside the proxy's middleware: every request to the upstream, streamed both ways.

`Forwarder` sends any route, any method, to the upstream with one pooled `aiohttp.ClientSession`:
the request body streamed up as it arrives, the response streamed down as it comes, the upstream
request closed when the client goes. It answers the lifespan (`prepare` at start-up) and
`GET /metrics`: the upstream's families, then the proxy's own (`own_metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
from yarl import URL

from .. import metrics
from ..asgi_types import Message, Receive, Scope, Send
from ..middleware import prepare as prepare_middleware
from ..protocol import error_body
from .config import ProxyConfig
from .headers import _text, forwarded, is_trusted, request_headers, response_headers, trusted_networks

METRICS_PATH = "/metrics"
# Headers aiohttp would add of its own (`host` aside, which is the upstream's).
_AUTO_HEADERS = ("Accept", "Accept-Encoding", "User-Agent", "Content-Type")
_METRICS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"
# A request body sent up in pieces of this size: aiohttp and the socket's buffer never copy it whole.
_UP_PIECE = 1 << 16
_FAMILY = re.compile(rb"^# (?:TYPE|HELP) (\S+)", re.MULTILINE)


class _ClientGone(Exception):
    """The client disconnected while its request body was still coming."""


class Forwarder:
    """The app inside the middleware: every request to the upstream, streamed both ways."""

    def __init__(self, config: ProxyConfig, session: aiohttp.ClientSession | None = None) -> None:
        self.config = config
        self._session = session
        self._trusted = trusted_networks(config.forwarded_allow_ips)
        # The upstream's `GET /version`, once it answered: its `version` (whose rules sanitize the messages the
        # proxy writes) and `rust_frontend_version` (vLLM's Rust frontend, `vllm-rs`).
        self.upstream = SimpleNamespace(version=None, rust_frontend_version=None)
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
        """The upstream's `/version`, asked until it answers (it may start after the proxy): its release, whose
        `sanitize_message` rules the proxy's messages follow, and whether it is `vllm-rs`, which refuses what
        vLLM's Python server answers ids on /v1/responses with (docs/scaling-out.md)."""
        while True:
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                async with self.session.get(self.config.upstream + "/version") as resp:
                    if resp.status == 200:
                        answer = await resp.json(content_type=None)
                        answer = answer if isinstance(answer, dict) else {}
                        for key in ("version", "rust_frontend_version"):
                            value = answer.get(key)
                            setattr(self.upstream, key, value if isinstance(value, str) else None)
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
        # The client gone cancels the exchange, which closes the upstream connection: vLLM aborts the request.
        # (A done-callback, not `asyncio.wait`: no waiter future and set bookkeeping on each request's path.)
        watch.add_done_callback(lambda _: exchange.cancel())
        try:
            await exchange  # re-raises a failure mid-response: the server cuts the connection
        except asyncio.CancelledError:
            if not watch.done() or watch.cancelled():
                raise  # this request's own task cancelled (the exchange with it), not the client gone
        finally:
            watch.cancel()
            if not exchange.done():  # not after `await exchange` as asyncio goes; no upstream request outlives this
                exchange.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await exchange

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
        theirs = frozenset(_FAMILY.findall(upstream))
        own = await asyncio.to_thread(own_metrics)  # reads the workers' files: off the loop
        body = upstream + _without(own, theirs)
        await _send_json(send, 200, body, _METRICS_CONTENT_TYPE)


def prepare() -> None:
    """Every import a request would reach (the middleware's, and `own_metrics`'): at start-up, in a thread."""
    prepare_middleware()
    with contextlib.suppress(ImportError):
        import prometheus_client.multiprocess  # noqa: F401


async def _pieces(data: bytes) -> AsyncIterator[memoryview]:
    """A held body sent up as views of it (no copy), so aiohttp never joins it to the headers."""
    view = memoryview(data)
    for start in range(0, len(data), _UP_PIECE):
        yield view[start : start + _UP_PIECE]


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


def _without(text: bytes, names: frozenset[bytes]) -> bytes:
    """`text` (prometheus_client's exposition: each family a `# HELP` / `# TYPE` head, then its samples) less the
    families whose exposed name is in `names`: the names as the `# TYPE` lines write them (`..._total` for a
    counter, `..._created` beside it), which Prometheus refuses to see twice in one scrape."""
    kept: list[bytes] = []
    keep = True
    for line in text.splitlines(keepends=True):
        head = _FAMILY.match(line)
        if head is not None:
            keep = head.group(1) not in names
        if keep:
            kept.append(line)
    return b"".join(kept)


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

"""`vllm-nvext proxy`'s plumbing: forwarding, streaming both ways, disconnects, upstream failures, auth.

The upstream is a real HTTP server on a free localhost port, run in the test's own event loop
(uvicorn, as the proxy's own server), so the proxy's pooled aiohttp client talks to it over TCP.
It serves an ASGI app, or a handler written against httpx's `Request`/`Response` whose response
stream the test drives (to see each chunk leave before the next exists, and the upstream stream
closed when the client goes). The real-server matrix is tests/e2e/test_proxy.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
import uvicorn

from tests import helpers
from tests.helpers import CHAT, COMPLETIONS
from tests.unit import asgi
from tests.unit.asgi import Upstream
from vllm_nvext import Settings, _vllm_compat, metrics
from vllm_nvext.proxy import (
    ENV_CONFIG,
    Forwarder,
    NvextProxy,
    ProxyConfig,
    app_from_env,
    own_metrics,
    request_headers,
    response_headers,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
UPSTREAM = "http://upstream.test:8000"
NVEXT_IDS = {"nvext": {"extra_fields": ["completion_token_ids"]}}
JSON = (b"content-type", b"application/json")
# What each test started: its upstream servers and proxies, stopped after it (`_stop_what_started`).
_STARTED: list[Any] = []


async def call(app: Any, path: str, body: bytes, **kwargs: Any) -> asgi.Result:
    """One request through the proxy from a client that stays until the answer is complete."""
    return await asgi.call(app, path, body, **kwargs)


def _listening() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    return sock


async def serve(app: Any) -> str:
    """`app` served over HTTP on a free localhost port until the test ends; its URL."""
    sock = _listening()
    config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, timeout_graceful_shutdown=10)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)  # as `Server.serve` sets it (here: off)
    await server.startup(sockets=[sock])
    _STARTED.append(server)
    host, port = sock.getsockname()
    return f"http://{host}:{port}"


def proxy_to(url: str, *, keys: tuple[str, ...] = (), settings: Settings | None = None, **config: Any) -> NvextProxy:
    app = NvextProxy(ProxyConfig(url, api_keys=keys, **config), settings or Settings())
    _STARTED.append(app.forwarder)
    return app


async def proxy_over(app: Any, *, keys: tuple[str, ...] = (), settings: Settings | None = None) -> NvextProxy:
    return proxy_to(await serve(app), keys=keys, settings=settings)


async def mock_proxy(handler: Callable[[httpx.Request], Any], **config: Any) -> NvextProxy:
    return proxy_to(await serve(handled(handler)), **config)


@pytest.fixture(autouse=True)
async def _stop_what_started() -> AsyncIterator[None]:
    yield
    while _STARTED:
        started = _STARTED.pop()
        if isinstance(started, uvicorn.Server):
            started.should_exit = True
            await started.shutdown()
        else:
            await started.aclose()


class _RequestBody(httpx.AsyncByteStream):
    """The upstream's request body as its server hands it over, message by message."""

    def __init__(self, receive: Any) -> None:
        self.receive = receive
        self.read = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        more = True
        while more:
            message = await self.receive()
            more = bool(message.get("more_body", False))
            if message.get("body"):
                yield message["body"]
        self.read.set()


def handled(handler: Callable[[httpx.Request], Any]) -> Any:
    """An ASGI app answering with `handler(request)`: its response streamed as the stream yields;
    when the proxy drops the connection the handler is cancelled and the stream closed (`aclose`)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = [(n, v) for n, v in scope["headers"]]
        query = b"?" + scope["query_string"] if scope["query_string"] else b""
        host = dict(headers)[b"host"].decode()
        url = f"http://{host}{scope['raw_path'].decode()}{query.decode()}"
        body = _RequestBody(receive)
        request = httpx.Request(scope["method"], url, headers=headers, stream=body)
        streams: list[Any] = []
        answered = asyncio.Event()

        async def respond() -> None:
            response = handler(request)
            if asyncio.iscoroutine(response):
                response = await response
            answered.set()
            await send({"type": "http.response.start", "status": response.status_code, "headers": response.headers.raw})
            streams.append(response.stream)
            async for chunk in response.stream:
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        async def disconnect() -> None:  # listens once the body is read, or left unread by the answer
            read, answer = asyncio.ensure_future(body.read.wait()), asyncio.ensure_future(answered.wait())
            await asyncio.wait((read, answer), return_when=asyncio.FIRST_COMPLETED)
            read.cancel()
            answer.cancel()
            if not body.read.is_set():
                async for _ in body:
                    pass
            while (await receive())["type"] != "http.disconnect":
                pass

        responding, watching = asyncio.ensure_future(respond()), asyncio.ensure_future(disconnect())
        await asyncio.wait((responding, watching), return_when=asyncio.FIRST_COMPLETED)
        watching.cancel()
        if not responding.done():
            responding.cancel()
            for stream in streams:
                await stream.aclose()
            return
        responding.result()  # a stream that fails mid-body fails the app: the server cuts the connection

    return app


class Body(httpx.AsyncByteStream):
    """A response body as a transport streams it (httpx reads a `content=` body at once)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.data


def reply(status: int, content: bytes = b"", headers: Any = None, json_body: Any = None) -> httpx.Response:
    if json_body is not None:
        content, headers = json.dumps(json_body).encode(), {"content-type": "application/json"}
    return httpx.Response(status, headers=headers, stream=Body(content))


# --- forwarding ---------------------------------------------------------------------------------


async def test_an_unknown_route_is_forwarded_byte_for_byte_with_its_method_query_and_headers():
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        await request.aread()
        headers = [("content-type", "application/x-odd"), ("x-upstream", "1"), ("connection", "close, x-drop")]
        return reply(418, b"\x00odd body\xff", headers)

    app = await mock_proxy(handler)
    headers = (
        (b"content-type", b"application/x-odd"),
        (b"authorization", b"Bearer secret"),
        (b"host", b"proxy.test"),
        (b"connection", b"keep-alive, x-hop"),
        (b"x-hop", b"1"),
        (b"keep-alive", b"timeout=5"),
        (b"x-custom", b"kept"),
    )
    scope_path = "/some/route%20x"
    result = await call(app, scope_path, b"raw \x01 bytes", method="PUT", headers=headers)
    assert result.status == 418 and result.body == b"\x00odd body\xff", "the upstream's answer, unchanged"
    assert result.header(b"x-upstream") == b"1"
    assert result.header(b"connection") is None and result.header(b"x-drop") is None, "hop-by-hop dropped"
    request = seen[0]
    assert request.method == "PUT" and request.url.raw_path == b"/some/route%20x", "the path as the client sent it"
    assert request.content == b"raw \x01 bytes"
    assert request.headers["authorization"] == "Bearer secret", "credentials pass through"
    assert request.headers["x-custom"] == "kept"
    assert request.headers["host"] == app.forwarder.config.upstream.removeprefix("http://"), "the upstream's host"
    for own in ("user-agent", "accept", "accept-encoding"):
        assert own not in request.headers, f"no {own} of the proxy's own client library"
    for hop in ("x-hop", "keep-alive", "connection"):
        assert hop not in request.headers, f"{hop} is the client's connection's, not the upstream's"


async def test_the_query_string_reaches_the_upstream():
    urls: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        urls.append(str(request.url))
        return reply(200, b"ok")

    app = await mock_proxy(handler)
    scope = _scope("/v1/models", method="GET", query=b"a=1&b=%20")
    sent = await _drive(app, scope, [{"type": "http.request", "body": b"", "more_body": False}])
    assert sent[0]["status"] == 200 and urls == [app.forwarder.config.upstream + "/v1/models?a=1&b=%20"]


async def test_a_body_in_several_messages_is_streamed_up_whole():
    upstream = Upstream(body=b'{"ok": true}')
    app = await proxy_over(upstream)
    body = json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode()
    result = await call(app, COMPLETIONS, body, request_cuts=(7, 100, 4096))
    assert result.status == 200 and result.body == b'{"ok": true}'
    assert upstream.received == body
    assert dict(upstream.received_headers)[b"content-length"] == str(len(body)).encode()


async def test_a_body_the_middleware_never_reads_is_streamed_up_as_it_comes():
    received: list[bytes] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        async for part in request.stream:  # type: ignore[union-attr]
            received.append(part)
        return reply(200, b"stored")

    app = await mock_proxy(handler)
    body = b"line one\nline two\n" * 100
    headers = [(b"content-type", b"text/plain")]
    result = await call(app, "/v1/files", body, request_cuts=(0, 5, 900), headers=headers)
    assert result.status == 200 and result.body == b"stored"
    assert b"".join(received) == body, f"the body whole, in its parts: {[len(r) for r in received]}"


async def test_translation_through_the_proxy_is_the_middlewares():
    recorded = (FIXTURES / "completions_unary_ids.json").read_bytes()
    upstream = Upstream(body=recorded)
    app = await proxy_over(upstream)
    body = json.dumps({"model": "tiny", "prompt": "Hi", "max_tokens": 3, **NVEXT_IDS}).encode()
    result = await call(app, COMPLETIONS, body)
    assert result.status == 200
    sent = json.loads(upstream.received or b"")
    assert sent["return_token_ids"] is True and "nvext" not in sent, "the upstream gets vLLM's dialect"
    answer = json.loads(result.body)
    ids = json.loads(recorded)["choices"][0]["token_ids"]
    assert answer["nvext"]["completion_token_ids"] == ids and answer["choices"][0].get("token_ids") is None
    assert int(result.header(b"content-length") or 0) == len(result.body)


async def test_a_bad_nvext_field_is_the_middlewares_400_naming_it():
    upstream = Upstream()
    app = await proxy_over(upstream)
    result = await call(app, CHAT, json.dumps({"model": "tiny", "nvext": 3}).encode())
    assert result.status == 400 and json.loads(result.body)["error"]["param"] == "nvext"
    assert upstream.calls == 0


# --- streaming down -----------------------------------------------------------------------------


class Stream(httpx.AsyncByteStream):
    """An upstream response body the test releases chunk by chunk; `closed` once its server saw the
    connection dropped before its end."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.release = [asyncio.Event() for _ in chunks]
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk, gate in zip(self.chunks, self.release, strict=True):
            await gate.wait()
            yield chunk

    async def aclose(self) -> None:
        self.closed.set()


async def test_each_upstream_chunk_reaches_the_client_before_the_next_exists():
    events = [b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"]
    stream = Stream(list(events))

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    app = await mock_proxy(handler)
    gates = list(stream.release)  # one per event
    got: list[bytes] = []
    stream.release[0].set()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            got.append(message["body"])
            if len(got) < len(gates):
                gates[len(got)].set()  # the next event exists only once this one was sent

    receive = _receiver([{"type": "http.request", "body": b"", "more_body": False}])
    await asyncio.wait_for(app(_scope("/v1/other", method="GET"), receive, send), 30)
    assert got == events, "each event forwarded as it came, none held back"


async def test_a_client_that_goes_away_mid_stream_closes_the_upstream_stream():
    stream = Stream([b"data: 1\n\n", b"data: 2\n\n"])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    app = await mock_proxy(handler)
    stream.release[0].set()
    gone = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body"):
            gone.set()  # the client disconnects once it has the first event

    # A stray message after the body (an empty `http.request`) is not a disconnect.
    messages = [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.request", "body": b""}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    await asyncio.wait_for(app(_scope("/v1/other", method="GET"), receive, send), 30)
    await asyncio.wait_for(stream.closed.wait(), 30)  # the upstream request is closed, so vLLM aborts it
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: 1\n\n"]


async def test_a_request_its_server_cancels_closes_the_upstream_stream_and_stays_cancelled():
    stream = Stream([b"data: 1\n\n", b"data: 2\n\n"])

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=stream)

    app = await mock_proxy(handler)
    stream.release[0].set()
    first = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message.get("body"):
            first.set()

    # The client stays: only its server (shutting down) cancels the request's task.
    receive = _receiver([{"type": "http.request", "body": b"", "more_body": False}], then=None)
    task = asyncio.ensure_future(app(_scope("/v1/other", method="GET"), receive, send))
    await asyncio.wait_for(first.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)  # not taken for a client gone: the cancellation goes on up
    await asyncio.wait_for(stream.closed.wait(), 30)  # the upstream request is closed, so vLLM aborts it
    assert [m.get("body") for m in sent if m["type"] == "http.response.body"] == [b"data: 1\n\n"]


async def test_a_client_that_goes_away_while_its_body_comes_ends_the_exchange():
    calls: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200)

    app = await mock_proxy(handler)
    receive = _receiver(
        [
            {"type": "http.request", "body": b"{", "more_body": True},
            {"type": "http.request", "body": b"", "more_body": True},
            {"type": "http.disconnect"},
        ],
        then={"type": "http.disconnect"},
    )
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = _scope("/v2/upload", headers=[(b"content-type", b"text/plain")])
    await asyncio.wait_for(app(scope, receive, send), 30)
    assert sent == [], "nothing is answered to a client that left"


async def test_a_client_gone_before_its_body_gets_nothing():
    app = await mock_proxy(lambda request: httpx.Response(200))
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(_scope("/x", method="GET"), _receiver([{"type": "http.disconnect"}]), send)
    assert sent == []


async def test_an_upstream_failing_mid_response_cuts_the_clients_connection():
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            yield b"data: 1\n\n"
            raise httpx.ReadError("reset")

    app = await mock_proxy(lambda request: httpx.Response(200, stream=Broken()))
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    receive = _receiver([{"type": "http.request", "body": b"", "more_body": False}])
    with pytest.raises(aiohttp.ClientPayloadError):  # the server then closes the connection: no clean end
        await app(_scope("/x", method="GET"), receive, send)
    assert all(m.get("more_body", True) for m in sent if m["type"] == "http.response.body"), "never a clean end"


# --- upstream down ------------------------------------------------------------------------------


async def _hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An upstream that reads the request, then closes the connection without an answer."""
    await reader.readuntil(b"\r\n\r\n")
    writer.close()


async def _late(request: httpx.Request) -> httpx.Response:
    await request.aread()
    await asyncio.Event().wait()  # never answers
    raise AssertionError


@pytest.mark.parametrize(("upstream", "status"), [("hangs up", 502), ("refuses", 502), ("never answers", 504)])
async def test_an_upstream_down_or_late_is_a_502_or_504_in_vllms_envelope_without_details(upstream, status):
    if upstream == "hangs up":
        server = await asyncio.start_server(_hang_up, sock=_listening())
        app = proxy_to("http://{}:{}".format(*server.sockets[0].getsockname()[:2]))
    elif upstream == "refuses":
        closed = _listening()
        app = proxy_to("http://{}:{}".format(*closed.getsockname()))
        closed.close()  # nothing listens there now
    else:
        app = await mock_proxy(_late, timeout=0.2)
    result = await call(app, COMPLETIONS, json.dumps({"prompt": "x", **NVEXT_IDS}).encode())
    if upstream == "hangs up":
        server.close()
    assert result.status == status
    body = json.loads(result.body)
    assert set(body) == {"error"} and body["error"]["code"] == status and body["error"]["param"] is None
    assert "upstream" in body["error"]["message"]
    host, port = app.forwarder.config.upstream.removeprefix("http://").split(":")
    for leak in (host, port, "disconnected", "timed out", "timeout", "refused"):
        assert leak not in result.body.decode(), "no exception text, address or path"
    assert int(result.header(b"content-length") or 0) == len(result.body)


async def test_a_real_refused_connection_is_a_502():
    app = proxy_to("http://127.0.0.1:1", connect_timeout=5)
    result = await call(app, "/health", b"", method="GET")
    assert result.status == 502 and json.loads(result.body)["error"]["type"] == "BadGatewayError"


# --- auth: never answer what the upstream refuses -----------------------------------------------


async def _keyed_upstream(scope: Any, receive: Any, send: Any) -> None:
    """vLLM with `--api-key k`: 401 for a guarded path without the key."""
    while (await receive()).get("more_body"):
        pass
    if _vllm_compat.auth_refuses({**scope, _vllm_compat.API_KEYS: ("k",)}):
        status, body = 401, b'{"error":"Unauthorized"}'
    else:
        status, body = 200, b"{}"
    await send({"type": "http.response.start", "status": status, "headers": [JSON]})
    await send({"type": "http.response.body", "body": body})


@pytest.mark.parametrize("authorization", [None, b"Bearer wrong", b"Basic k"])
async def test_a_request_the_upstream_refuses_for_auth_gets_the_upstreams_401_never_a_400(authorization):
    app = await proxy_over(_keyed_upstream, keys=("k",))
    headers = [JSON] + ([(b"authorization", authorization)] if authorization else [])
    bad = json.dumps({"model": "tiny", "nvext": {"extra_fields": "garbage"}}).encode()
    result = await call(app, CHAT, bad, headers=headers)
    assert result.status == 401 and result.body == b'{"error":"Unauthorized"}'


async def test_with_the_key_the_proxy_answers_its_own_400():
    app = await proxy_over(_keyed_upstream, keys=("k",))
    bad = json.dumps({"model": "tiny", "nvext": {"extra_fields": "garbage"}}).encode()
    result = await call(app, CHAT, bad, headers=[JSON, (b"authorization", b"Bearer k")])
    assert result.status == 400 and json.loads(result.body)["error"]["param"] == "nvext.extra_fields"


async def test_echo_prompt_ids_are_decoded_by_the_upstreams_own_detokenize_over_http():
    detokenized: list[tuple[str, dict[str, Any], str | None]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(await request.aread())
        if request.url.path == "/detokenize":
            detokenized.append((request.method, body, request.headers.get("authorization")))
            return reply(200, json_body={"prompt": "Hi"})
        answer = {"choices": [{"index": 0, "text": "gen", "token_ids": [1, 2], "prompt_token_ids": body["prompt"]}]}
        return reply(200, json_body=answer)

    body = {"model": "tiny", "prompt": [72, 105], "echo": True, **NVEXT_IDS}
    headers = [JSON, (b"authorization", b"Bearer k")]
    result = await call(await mock_proxy(handler), COMPLETIONS, json.dumps(body).encode(), headers=headers)
    assert result.status == 200 and json.loads(result.body)["choices"][0]["text"] == "Higen"
    assert detokenized == [("POST", {"model": "tiny", "tokens": [72, 105]}, "Bearer k")]


# --- /metrics -------------------------------------------------------------------------------------


async def test_metrics_are_the_upstreams_then_the_proxys_own_counters():
    paths: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        paths.append(request.url.path)
        if request.url.path == "/metrics":
            assert request.headers["accept"] == "text/plain"
            return reply(200, b"# TYPE vllm:up gauge\nvllm:up 1")
        return reply(200, json_body={"choices": [{"index": 0, "text": "x", "token_ids": [5]}]})

    app = await mock_proxy(handler)
    await call(app, COMPLETIONS, json.dumps({"model": "tiny", "prompt": "a", **NVEXT_IDS}).encode())
    result = await call(app, "/metrics", b"", method="GET")
    text = result.body.decode()
    assert result.status == 200 and text.startswith("# TYPE vllm:up gauge\nvllm:up 1\n")
    assert "vllm_nvext:requests_total{" in text and 'dialect="nvext"' in text
    assert "python_gc" not in text, "only the proxy's own families, never a second copy of the runtime's"
    assert int(result.header(b"content-length") or 0) == len(result.body)


@pytest.mark.parametrize("answer", ["down", "404"])
async def test_metrics_without_the_upstreams_are_the_proxys_own(answer):
    metrics.count_refusal("nvext", 400)
    app = proxy_to("http://127.0.0.1:1") if answer == "down" else await mock_proxy(lambda request: reply(404))
    result = await call(app, "/metrics", b"", method="GET")
    assert result.status == 200 and result.body.startswith(b"# HELP vllm_nvext:")


def test_own_metrics_sum_the_worker_processes_files(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert own_metrics() == b"", "no worker has counted yet"


def test_own_metrics_without_prometheus_client_is_empty(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    assert own_metrics() == b""


# --- lifecycle and configuration --------------------------------------------------------------------


async def test_lifespan_starts_and_closes_the_pool():
    session = aiohttp.ClientSession()
    app = NvextProxy(ProxyConfig(UPSTREAM), Settings(), session=session)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    receive = _receiver([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    await app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert session.closed


async def test_a_websocket_is_closed_not_proxied():
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    app = NvextProxy(ProxyConfig(UPSTREAM), Settings())
    await app({"type": "websocket", "path": "/v1/realtime", "headers": []}, _receiver([]), send)
    assert sent == [{"type": "websocket.close", "code": 1011}]
    await app({"type": "other"}, _receiver([]), send)
    assert len(sent) == 1, "a scope type ASGI may add later gets nothing"
    await app.forwarder.aclose()  # never opened: nothing to close


# Codex's WebSocket attempt on /v1/responses (docs/protocol.md §11.4): a real client's handshake.


def _stock_vllm_app() -> Any:
    """What stock vLLM routes: /v1/responses over HTTP, no WebSocket route (starlette refuses one: 403)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def responses(request: Any) -> JSONResponse:
        return JSONResponse({"object": "response"})

    return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"])])


@pytest.mark.parametrize("root", ["", "/api"], ids=["plain", "root_path"])
async def test_codex_websocket_on_responses_is_refused_with_the_426_codex_falls_back_on(root):
    from vllm_nvext import NvextMiddleware

    app = NvextMiddleware(_stock_vllm_app())
    # `vllm serve --root-path`: the path vLLM routes is the one under it.
    url = await serve(_under_root(app, root) if root else app)
    status, body = await asyncio.to_thread(helpers.websocket_refusal, url, root + "/v1/responses")
    assert status == 426, "Codex falls back to HTTP at once on 426 only"
    error = json.loads(body)["error"]
    assert error["code"] == 426 and "POST" in error["message"] and "supports_websockets" in error["message"]
    # Any other WebSocket route is vLLM's to answer (here: starlette's refusal of a route it lacks).
    assert (await asyncio.to_thread(helpers.websocket_refusal, url, root + "/v1/realtime"))[0] == 403


def _under_root(app: Any, root: str) -> Any:
    async def rooted(scope: Any, receive: Any, send: Any) -> None:
        await app({**scope, "root_path": root}, receive, send)

    return rooted


async def test_codex_websocket_through_the_proxy_is_refused_with_426_after_the_key_check():
    proxy = await proxy_over(_stock_vllm_app(), keys=(helpers.API_KEY,))
    url = await serve(proxy)
    assert (await asyncio.to_thread(helpers.websocket_refusal, url))[0] == 426
    # A key the upstream would refuse: the proxy answers nothing of its own (not proxied: closed, 403).
    assert (await asyncio.to_thread(helpers.websocket_refusal, url, "/v1/responses", False))[0] == 403
    assert (await asyncio.to_thread(helpers.websocket_refusal, url, "/v1/realtime"))[0] == 403


async def test_a_server_without_the_denial_extension_gets_the_handshake_closed():
    from vllm_nvext import NvextMiddleware

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "websocket", "path": "/v1/responses", "headers": []}
    await NvextMiddleware(_stock_vllm_app())(scope, _receiver([]), send)
    assert sent == [{"type": "websocket.close", "code": 1008}]


# vLLM's Rust frontend (`vllm-rs`) upstream, as its GET /version says (docs/scaling-out.md).


def _upstream_with_version(answer: dict[str, str], seen: list[dict[str, Any]]) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def version(request: Request) -> JSONResponse:
        return JSONResponse(answer)

    async def responses(request: Request) -> JSONResponse:
        seen.append(await request.json())
        return JSONResponse({"object": "response", "output": []})

    return Starlette(routes=[Route("/version", version), Route("/v1/responses", responses, methods=["POST"])])


RESPONSES_BODY = {"model": "tiny", "input": "Hello", "max_output_tokens": 4}


@pytest.mark.parametrize(
    ("opt_in", "field"), [(NVEXT_IDS, "nvext.extra_fields"), ({"return_token_ids": True}, "return_token_ids")]
)
async def test_ids_on_responses_of_vllm_rs_are_a_400_naming_the_clients_field(opt_in, field):
    """vllm-rs refuses enable_response_messages (0.34; 0.33's has no /v1/responses): never a 200 without ids."""
    seen: list[dict[str, Any]] = []
    app = await proxy_over(_upstream_with_version({"version": "0.34.0", "rust_frontend_version": "0.34.0"}, seen))
    await app.forwarder._read_version()
    result = await call(app, "/v1/responses", json.dumps({**RESPONSES_BODY, **opt_in}).encode())
    error = json.loads(result.body)["error"]
    assert result.status == 400 and error["param"] == field, result.body
    assert "vllm-rs 0.34.0" in error["message"] and "enable_response_messages" in error["message"]
    assert seen == [], "nothing reached the upstream"
    plain = await call(app, "/v1/responses", json.dumps(RESPONSES_BODY).encode())
    assert plain.status == 200 and seen == [RESPONSES_BODY], "a request that asks no ids is forwarded as sent"


async def test_ids_on_responses_of_vllms_python_server_are_asked_of_it():
    seen: list[dict[str, Any]] = []
    app = await proxy_over(_upstream_with_version({"version": "0.34.0"}, seen))
    await app.forwarder._read_version()
    result = await call(app, "/v1/responses", json.dumps({**RESPONSES_BODY, **NVEXT_IDS}).encode())
    assert result.status == 200 and seen[0]["enable_response_messages"] is True


@pytest.mark.parametrize(("release", "kept"), [("0.30.0+cpu", True), ("0.31.0+cpu", False), ("0.34.0", False)])
async def test_the_proxys_messages_follow_the_sanitizer_rules_of_the_upstreams_release(release, kept):
    """vLLM 0.30's sanitize_message rewrites lower-case hex addresses only (later releases: either case): the
    400 the proxy writes for an unknown `nvext` key is sanitized as its upstream's release, from its /version."""
    seen: list[dict[str, Any]] = []
    app = await proxy_over(_upstream_with_version({"version": release}, seen))
    await app.forwarder._read_version()
    body = {"model": "tiny", "prompt": "x", "nvext": {"k at 0xABCDEF> at 0xabcdef>": 1}}
    result = await call(app, COMPLETIONS, json.dumps(body).encode())
    message = json.loads(result.body)["error"]["message"]
    assert result.status == 400 and "0xabcdef" not in message, message
    assert ("k at 0xABCDEF>>" in message) is kept and ("k>>" in message) is not kept, message
    assert seen == []


@pytest.mark.parametrize("release", ["0.30.0+cpu", "0.33.0", "0.34.0", "0.35.1"])
async def test_max_thinking_tokens_on_responses_follows_the_upstreams_release(release):
    """vLLM's Responses API takes `thinking_token_budget` from 0.34 on: through the proxy, whose own vLLM is
    0.32, `nvext.max_thinking_tokens` is sent as it where the upstream's /version says so, else a 400 that
    names the field and the upstream's release."""
    seen: list[dict[str, Any]] = []
    app = await proxy_over(_upstream_with_version({"version": release}, seen))
    await app.forwarder._read_version()
    body = {**RESPONSES_BODY, "nvext": {"max_thinking_tokens": 5}}
    result = await call(app, "/v1/responses", json.dumps(body).encode())
    if release in ("0.34.0", "0.35.1"):
        assert result.status == 200 and seen == [{**RESPONSES_BODY, "thinking_token_budget": 5}], seen
        return
    error = json.loads(result.body)["error"]
    assert result.status == 400 and error["param"] == "nvext.max_thinking_tokens" and seen == []
    assert f"vLLM {release}'s Responses API has no thinking budget" in error["message"], error


async def test_the_proxy_asks_the_upstreams_version_until_it_answers():
    """An upstream that starts after the proxy: /version is asked again until it answers."""
    answers = [500, 200]

    async def upstream(scope: Any, receive: Any, send: Any) -> None:
        status = answers.pop(0)
        body = b'{"version":"0.33.0","rust_frontend_version":"0.33.0"}'
        await send({"type": "http.response.start", "status": status, "headers": [JSON]})
        await send({"type": "http.response.body", "body": body})

    app = proxy_to(await serve(upstream))
    await asyncio.wait_for(app.forwarder._read_version(every=0.01), 10)
    assert app.forwarder.upstream.rust_frontend_version == "0.33.0" and answers == []


async def test_the_pool_is_made_on_first_use_with_the_configured_timeouts():
    forwarder = Forwarder(ProxyConfig(UPSTREAM, timeout=None, connect_timeout=3))
    session = forwarder.session
    assert forwarder.session is session and session.timeout.sock_read is None and session.timeout.sock_connect == 3
    assert session.timeout.total is None, "a stream may last as long as it streams"
    await forwarder.aclose()


async def test_one_clients_cookies_never_reach_another():
    cookies: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        cookies.append(request.headers.get("cookie"))
        return httpx.Response(200, headers={"set-cookie": "session=alice; Path=/"}, stream=Body(b"{}"))

    app = await mock_proxy(handler)
    first = await call(app, "/v1/models", b"", method="GET")
    await call(app, "/v1/models", b"", method="GET")
    await call(app, "/v1/models", b"", method="GET", headers=[(b"cookie", b"mine=1")])
    assert first.header(b"set-cookie") == b"session=alice; Path=/", "the upstream's cookie reaches its client"
    assert cookies == [None, None, "mine=1"], "the proxy keeps no cookie jar"


async def test_connections_to_the_upstream_are_reused():
    peers: list[Any] = []

    async def upstream(scope: Any, receive: Any, send: Any) -> None:
        peers.append(scope["client"])
        await Upstream()(scope, receive, send)

    app = await proxy_over(upstream)
    for _ in range(3):
        assert (await call(app, "/v1/models", b"", method="GET")).status == 200
    assert len(set(peers)) == 1, "one pooled connection, not one per request"


@pytest.mark.parametrize("url", ["upstream:8000", "ftp://x", "http://"])
def test_an_upstream_that_is_not_an_http_url_is_refused(url):
    with pytest.raises(ValueError, match="upstream"):
        ProxyConfig(url)


def test_the_config_travels_to_the_workers_through_the_environment(monkeypatch):
    config = ProxyConfig("http://h:1/", api_keys=("a", "", "b"), timeout=None, forwarded_allow_ips=(" 10.0.0.0/8",))
    assert config.upstream == "http://h:1" and config.api_keys == ("a", "b")
    assert config.forwarded_allow_ips == ("10.0.0.0/8",)
    monkeypatch.setenv(ENV_CONFIG, config.to_json())
    monkeypatch.setenv("VLLM_NVEXT_MODE", "nvext")
    app = app_from_env()
    assert app.forwarder.config == config and app.middleware.settings.mode.value == "nvext"


def test_header_filters_drop_hop_by_hop_and_connection_named_headers():
    sent = [(b"te", b"trailers"), (b"x-a", b"1"), (b"upgrade", b"h2c"), (b"expect", b"100-continue")]
    assert request_headers(sent) == [(b"x-a", b"1")]
    got = response_headers([(b"Transfer-Encoding", b"chunked"), (b"Content-Type", b"text/plain")])
    assert got == [(b"content-type", b"text/plain")], "names lowercased, as ASGI wants them"


# --- helpers ----------------------------------------------------------------------------------------


def _scope(
    path: str, *, method: str = "POST", query: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None
) -> dict[str, Any]:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query,
        "headers": list(headers or []),
    }


def _receiver(messages: list[dict[str, Any]], then: dict[str, Any] | None = None) -> Any:
    pending = list(messages)

    async def receive() -> dict[str, Any]:
        if pending:
            return pending.pop(0)
        if then is not None:
            return then
        await asyncio.Event().wait()  # no disconnect ever comes
        raise AssertionError

    return receive


async def _drive(app: Any, scope: dict[str, Any], messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, _receiver(messages), send)
    return sent


# --- the command ----------------------------------------------------------------------------------


@pytest.fixture
def served(monkeypatch):
    """`proxy.serve` recorded instead of run; the environment it writes is restored after the test."""
    from vllm_nvext import proxy
    from vllm_nvext.tools import cli

    calls: list[tuple[ProxyConfig, Settings, dict[str, Any]]] = []
    monkeypatch.setattr(proxy, "serve", lambda config, settings, **kw: calls.append((config, settings, kw)))
    monkeypatch.setattr(cli, "key_mismatch", lambda config: None)  # no upstream to ask here
    for name in ("VLLM_API_KEY", "VLLM_NVEXT_MODE", "VLLM_NVEXT_MAX_BODY_BYTES"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_proxy_command_serves_the_upstream_with_its_keys_mode_and_workers(served, capsys):
    from vllm_nvext.tools import cli

    argv = ["proxy", "--upstream", "http://10.0.0.5:8000/", "--port", "9001", "--mode", "nvext", "--workers", "3"]
    assert cli.main([*argv, "--api-key", "a", "--api-key", "b", "--timeout", "0"]) == 0
    config, settings, kw = served[0]
    assert config == ProxyConfig("http://10.0.0.5:8000", api_keys=("a", "b"), timeout=None)
    assert settings.mode.value == "nvext" and kw == {"host": "127.0.0.1", "port": 9001, "workers": 3}
    assert "proxy on http://127.0.0.1:9001 in front of http://10.0.0.5:8000 (mode nvext, 3 workers)" in (
        capsys.readouterr().out
    )


def test_proxy_command_takes_the_key_and_settings_from_the_environment(served, monkeypatch):
    from vllm_nvext.tools import cli

    monkeypatch.setenv("VLLM_API_KEY", "env-key")
    monkeypatch.setenv("VLLM_NVEXT_MODE", "both")
    monkeypatch.setenv("VLLM_NVEXT_MAX_BODY_BYTES", "1000")
    assert cli.main(["proxy", "--upstream", "http://h:1"]) == 0
    config, settings, kw = served[0]
    assert config.api_keys == ("env-key",) and config.timeout == 600.0 and kw["workers"] == 1
    assert settings.mode.value == "both" and settings.max_body_bytes == 1000


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["--upstream", "localhost:8000"], {}, "upstream: expected an http:// or https:// URL"),
        (["--upstream", "http://h:1"], {"VLLM_NVEXT_MAX_BODY_BYTES": "-1"}, "VLLM_NVEXT_MAX_BODY_BYTES"),
    ],
)
def test_proxy_command_refuses_a_bad_setting_in_one_line(served, monkeypatch, capsys, argv, env, says):
    from vllm_nvext.tools import cli

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert cli.main(["proxy", *argv]) == 2 and served == []
    err = capsys.readouterr().err
    assert err.startswith("vllm-nvext proxy: error: ") and says in err and err.count("\n") == 1


def test_proxy_command_refuses_zero_workers(served, capsys):
    from vllm_nvext.tools import cli

    with pytest.raises(SystemExit):
        cli.main(["proxy", "--upstream", "http://h:1", "--workers", "0"])
    assert "expected a positive integer" in capsys.readouterr().err


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_hands_uvicorn_the_settings_through_the_environment(monkeypatch, tmp_path, workers):
    import uvicorn

    from vllm_nvext import proxy

    runs: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: runs.append((app, kw)))
    for name in (ENV_CONFIG, "VLLM_NVEXT_MODE", "VLLM_NVEXT_ALLOW_MODE_HEADER", "VLLM_NVEXT_MAX_BODY_BYTES"):
        monkeypatch.setenv(name, "")  # recorded, so what serve() writes is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "")
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
    monkeypatch.setattr("tempfile.mkdtemp", lambda prefix: str(tmp_path))
    config = ProxyConfig("http://h:1", api_keys=("k",))
    proxy.serve(
        config,
        Settings(mode="nvext", allow_mode_header=False, max_body_bytes=7),
        host="0.0.0.0",
        port=1,
        workers=workers,
    )
    app, kw = runs[0]
    assert app == "vllm_nvext.proxy:app_from_env" and kw["factory"] and kw["workers"] == workers
    assert kw["server_header"] is False and kw["date_header"] is False, "the upstream's own pass through"
    assert kw["access_log"] is False, "no log line per request"
    assert kw["proxy_headers"] is False, "uvicorn never takes a client's X-Forwarded-For for its address"
    built = app_from_env()
    assert built.forwarder.config == config
    assert built.middleware.settings == Settings(mode="nvext", allow_mode_header=False, max_body_bytes=7)
    import os

    assert (os.environ.get("PROMETHEUS_MULTIPROC_DIR") == str(tmp_path)) == (workers > 1), "summed over workers"


def test_the_proxy_server_process_answers_and_stops():
    """`tools.server.ProxyServer` (the e2e kind): the real command, in front of an upstream that is down."""
    import time

    from vllm_nvext.tools.server import ProxyServer, free_port

    dead = f"http://127.0.0.1:{free_port()}"
    with ProxyServer(upstream=dead, name="unit") as server:
        deadline = time.monotonic() + 60
        while True:
            try:
                resp = httpx.get(server.url + "/health", timeout=5)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, server.log_tail()
                time.sleep(0.1)
        assert resp.status_code == 502 and resp.json()["error"]["type"] == "BadGatewayError"
    assert server.proc is not None and server.proc.poll() is not None, "stopped with its process group"


def test_the_upstreams_parser_and_connector_flags_reach_the_middleware(served):
    """What the middleware reads from vLLM's arguments when mounted, it reads from the proxy's flags."""
    from vllm_nvext.tools import cli

    transfer = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer"}
    argv = ["proxy", "--upstream", "http://h:1", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"]
    assert cli.main([*argv, "--tool-call-parser", "hermes", "--kv-transfer-config", json.dumps(transfer)]) == 0
    config = served[0][0]
    seen: list[dict[str, Any]] = []
    app = NvextProxy(config, Settings())

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope)

    app.middleware = middleware  # type: ignore[assignment]
    asyncio.run(app({"type": "http", "headers": []}, _receiver([]), _receiver([])))
    args = _vllm_compat.server_args(seen[0])
    assert _vllm_compat.hides_reasoning_ids(args), "ids withheld under include_reasoning: false stay null"
    assert _vllm_compat.builds_paths_from_request_ids(args)
    assert _vllm_compat.api_keys(seen[0]) == []


def test_without_flags_the_upstream_has_no_parser(served):
    from vllm_nvext.tools import cli

    assert cli.main(["proxy", "--upstream", "http://h:1"]) == 0
    args = NvextProxy(served[0][0], Settings()).server_args
    assert not _vllm_compat.hides_reasoning_ids(args) and not _vllm_compat.builds_paths_from_request_ids(args)


def test_a_kv_transfer_config_that_is_not_json_is_refused(served, capsys):
    from vllm_nvext.tools import cli

    assert cli.main(["proxy", "--upstream", "http://h:1", "--kv-transfer-config", "{oops"]) == 2
    assert capsys.readouterr().err.startswith("vllm-nvext proxy: error: ")


# --- the front door (X-Forwarded-*, header bytes, `OPTIONS *`, /metrics, keys, memory, start-up) --------


def _seen_headers() -> tuple[list[list[tuple[bytes, bytes]]], Any]:
    """An upstream recording each request's raw headers, as its server got them."""
    seen: list[list[tuple[bytes, bytes]]] = []

    async def upstream(scope: Any, receive: Any, send: Any) -> None:
        seen.append(list(scope["headers"]))
        await Upstream()(scope, receive, send)

    return seen, upstream


def _values(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [v for n, v in headers if n == name]


SPOOFED = [(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-proto", b"https"), (b"forwarded", b"for=6.6.6.6"),
           (b"x-real-ip", b"6.6.6.6"), (b"x-forwarded-host", b"evil.test")]  # fmt: skip


async def test_a_client_cannot_choose_the_address_the_upstream_sees():
    seen, upstream = _seen_headers()
    app = proxy_to(await serve(upstream))
    await call(app, "/v1/models", b"", method="GET", headers=SPOOFED, scope_extra={"client": ("203.0.113.9", 5)})
    got = seen[0]
    assert _values(got, b"x-forwarded-for") == [b"203.0.113.9"], "the peer, never the client's claim"
    assert _values(got, b"x-forwarded-proto") == [b"http"], "the scheme the client used with the proxy"
    assert not _values(got, b"forwarded") and not _values(got, b"x-real-ip") and not _values(got, b"x-forwarded-host")


async def test_a_trusted_hop_in_front_gets_the_peer_appended_to_its_chain():
    seen, upstream = _seen_headers()
    app = proxy_to(await serve(upstream), forwarded_allow_ips=("10.1.0.0/16",))
    sent = [
        (b"x-forwarded-for", b"198.51.100.1"),
        (b"x-forwarded-for", b"198.51.100.2"),
        (b"x-forwarded-proto", b"https"),
    ]
    await call(app, "/v1/models", b"", method="GET", headers=sent, scope_extra={"client": ("10.1.2.3", 5)})
    await call(app, "/v1/models", b"", method="GET", headers=sent, scope_extra={"client": ("10.2.0.1", 5)})
    trusted, untrusted = seen
    assert _values(trusted, b"x-forwarded-for") == [b"198.51.100.1, 198.51.100.2, 10.1.2.3"]
    assert _values(trusted, b"x-forwarded-proto") == [b"https"], "the trusted hop's scheme is kept"
    assert _values(untrusted, b"x-forwarded-for") == [b"10.2.0.1"]
    assert _values(untrusted, b"x-forwarded-proto") == [b"http"]


def test_forwarded_allow_ips_takes_uvicorns_syntax_and_refuses_the_rest(served, capsys, monkeypatch):
    from vllm_nvext.tools import cli

    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "127.0.0.1, 10.0.0.0/8")
    assert cli.main(["proxy", "--upstream", "http://h:1"]) == 0
    assert served[0][0].forwarded_allow_ips == ("127.0.0.1", "10.0.0.0/8")
    assert cli.main(["proxy", "--upstream", "http://h:1", "--forwarded-allow-ips", "*"]) == 0
    assert cli.main(["proxy", "--upstream", "http://h:1", "--forwarded-allow-ips", "nginx"]) == 2
    assert "forwarded-allow-ips" in capsys.readouterr().err


@pytest.mark.parametrize("value", [b"caf\xe9", b"caf\xc3\xa9", b"\xff\xfe x"], ids=["latin-1", "utf-8", "bytes"])
async def test_header_bytes_reach_the_upstream_as_the_client_sent_them(value):
    seen, upstream = _seen_headers()
    app = proxy_to(await serve(upstream))
    await call(app, "/v1/models", b"", method="GET", headers=[(b"x-request-id", value)])
    assert _values(seen[0], b"x-request-id") == [value]


async def test_options_asterisk_is_stocks_404_not_a_500():
    app = proxy_to("http://127.0.0.1:1")
    result = await call(app, "*", b"", method="OPTIONS", headers=[])
    assert (result.status, result.body) == (404, b'{"detail":"Not Found"}')


async def test_metrics_in_front_of_a_mounted_server_name_each_family_once():
    """The upstream's text is what a server that mounts vllm-nvext exposes (prometheus_client's own exposition
    of the same families: `# TYPE vllm_nvext:requests_total counter`). Read as Prometheus reads it: a second
    `# TYPE` (or `# HELP`) line for one name refuses the whole scrape."""
    metrics.count_refusal("nvext", 400)
    metrics.count_request("chat", "nvext", "auto", "unary")
    mounted = own_metrics()  # the exposition of a process that counts with vllm-nvext, as vLLM's /metrics has it
    assert b"# TYPE vllm_nvext:requests_total counter" in mounted and b"# TYPE vllm_nvext:refusals_total" in mounted
    upstream_text = mounted + b"# HELP vllm:up Up.\n# TYPE vllm:up gauge\nvllm:up 1.0\n"
    app = await mock_proxy(lambda request: reply(200, upstream_text))
    text = (await call(app, "/metrics", b"", method="GET")).body.decode()
    for kind in ("TYPE", "HELP"):
        names = re.findall(rf"^# {kind} (\S+)", text, re.MULTILINE)
        repeated = sorted({name for name in names if names.count(name) > 1})
        assert not repeated, f"# {kind} twice (Prometheus refuses the scrape): {repeated}"
    assert text.startswith(mounted.decode()), "the upstream's families, as it sent them"
    assert "vllm:up 1.0" in text


def _warning(config: ProxyConfig) -> str | None:
    from vllm_nvext.tools import cli

    return cli.key_mismatch(config)


def _keyed(key: str | None) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        auth = dict(scope["headers"]).get(b"authorization")
        if key is not None and auth != f"Bearer {key}".encode():
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error":"Unauthorized"}'})
            return
        await Upstream()(scope, receive, send)

    return app


@pytest.mark.parametrize(
    ("upstream_key", "proxy_keys", "says"),
    [
        (None, ("k",), "answers /v1 without a key"),
        ("k", (), "proxy has none"),
        ("k", ("other",), "refuses the proxy's --api-key"),
        ("k", ("k",), None),
        (None, (), None),
    ],
)
async def test_a_key_the_upstream_does_not_share_is_said_at_start_up(upstream_key, proxy_keys, says):
    url = await serve(_keyed(upstream_key))
    warning = await asyncio.to_thread(_warning, ProxyConfig(url, api_keys=proxy_keys))
    assert (warning is None) if says is None else (warning is not None and says in warning), warning


def test_the_command_prints_the_key_warning(served, monkeypatch, capsys):
    from vllm_nvext.tools import cli

    monkeypatch.setattr(cli, "key_mismatch", lambda config: "the upstream answers /v1 without a key")
    assert cli.main(["proxy", "--upstream", "http://h:1", "--api-key", "k"]) == 0
    assert "vllm-nvext proxy: warning: the upstream answers /v1 without a key" in capsys.readouterr().err


_START_UP_THEN_REQUESTS = """
import asyncio, json, sys
from tests.unit import asgi
from tests.unit.test_proxy import serve, proxy_to, NVEXT_IDS, _receiver
from vllm_nvext.proxy import Forwarder

async def main():
    app = proxy_to(await serve(asgi.Upstream(body=json.dumps({"choices": [{"index": 0, "text": "x"}]}).encode())))
    sent = []
    async def send(message):
        sent.append(message)
    lifespan = asyncio.ensure_future(app({"type": "lifespan"}, _receiver([{"type": "lifespan.startup"}]), send))
    while not sent:
        await asyncio.sleep(0.05)
    assert sent == [{"type": "lifespan.startup.complete"}], sent
    before = set(sys.modules)
    for path, body in [
        ("/v1/completions", {"model": "m", "prompt": "a", **NVEXT_IDS}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "a"}], **NVEXT_IDS}),
        ("/invocations", {"model": "m", "prompt": "a", **NVEXT_IDS}),
        ("/invocations", {"model": "m", "messages": [{"role": "user", "content": "a"}], **NVEXT_IDS}),
        ("/v1/responses", {"model": "m", "input": "a", **NVEXT_IDS}),
    ]:
        await asgi.call(app, path, json.dumps(body).encode())
    await asgi.call(app, "/metrics", b"", method="GET")
    print(json.dumps(sorted(set(sys.modules) - before)))
    lifespan.cancel()
    await app.forwarder.aclose()

asyncio.run(main())
"""


def test_no_request_imports_a_module_after_start_up():
    """Every import a request reaches (vLLM's request models for /invocations, pydantic, the counters)
    happens at start-up, off the loop: a first request never stalls the worker's other streams."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", _START_UP_THEN_REQUESTS], cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


_HELD = """
import asyncio, json, sys, tracemalloc
from tests.unit import asgi
from vllm_nvext import Settings
from vllm_nvext.proxy import NvextProxy, ProxyConfig

async def main():
    app = NvextProxy(ProxyConfig(sys.argv[1]), Settings())
    body = json.dumps({"model": "m", "prompt": "a" * 20_000_000, "nvext": {"extra_fields": ["completion_token_ids"]}})
    body = body.encode()
    messages = [body[i : i + 65536] for i in range(0, len(body), 65536)]  # as a server hands it over
    await asgi.call(app, "/v1/completions", b'{"model": "m", "prompt": "a"}')  # the pool's connection
    tracemalloc.start()
    result = await asgi.call(app, "/v1/completions", body, request_cuts=range(65536, len(body), 65536))
    print(json.dumps([result.status, tracemalloc.get_traced_memory()[1] / len(body)]))
    await app.forwarder.aclose()

asyncio.run(main())
"""


def test_an_opted_in_body_is_held_at_most_three_times_over():
    """tracemalloc's peak over one 20 MB opted-in completions request through the proxy, its upstream in
    another process: the body joined, decoded and rewritten (3.3x measured; while the upstream answers, the
    rewritten body alone). Before: 14x (orjson's decode alone held ~12x a long string; aiohttp joined the
    body to its headers; the client's bytes and the decoded body stayed held while the upstream answered)."""
    import subprocess
    import sys

    from vllm_nvext.tools.server import free_port

    root = Path(__file__).resolve().parents[2]
    port = free_port()
    upstream = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--factory",
            "tests.unit.asgi:Upstream",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--lifespan",
            "off",
        ],  # fmt: skip
        cwd=root,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.get(url, timeout=1)
                break
            except httpx.TransportError:
                import time

                time.sleep(0.05)
        done = subprocess.run([sys.executable, "-c", _HELD, url], cwd=root, capture_output=True, text=True, timeout=300)
    finally:
        upstream.terminate()
        upstream.wait(30)
    assert done.returncode == 0, done.stderr[-3000:]
    status, peak = json.loads(done.stdout.strip().splitlines()[-1])
    assert status == 200 and peak < 3.5, f"the proxy held {peak:.1f}x the body"


# --- capture (docs/capture.md) ------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, b"Bearer wrong"])
async def test_the_capture_read_api_is_under_the_proxys_key(tmp_path, authorization):
    from tests.support.capture import make_turn

    settings = Settings(capture=f"sqlite:///{tmp_path / 'c.sqlite3'}")
    app = await proxy_over(_keyed_upstream, keys=("k",), settings=settings)
    sink = app.middleware.sink
    assert sink is not None
    sink.submit(make_turn("run-1", [1, 2], [3]))
    assert sink.flush()
    path = "/v1/nvext/sessions/run-1"
    refused = await call(
        app, path, b"", method="GET", headers=[(b"authorization", authorization)] if authorization else []
    )
    assert refused.status == 401 and refused.body == b'{"error":"Unauthorized"}'  # the upstream's, never a turn
    read = await call(app, path, b"", method="GET", headers=[(b"authorization", b"Bearer k")])
    assert read.status == 200 and [t["prompt_token_ids"] for t in json.loads(read.body)["turns"]] == [[1, 2]]
    sink.close()


def test_the_capture_settings_travel_to_the_workers_through_the_environment(tmp_path, monkeypatch):
    from vllm_nvext.config import capture_environ

    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    monkeypatch.setenv(ENV_CONFIG, ProxyConfig("http://h:1/").to_json())
    for name, value in capture_environ(Settings(capture=url, capture_retention_s=60)).items():
        monkeypatch.setenv(name, value)
    app = app_from_env()
    assert app.middleware.settings.capture == url and app.middleware.settings.capture_retention_s == 60
    assert app.middleware.sink is not None
    app.middleware.sink.close()

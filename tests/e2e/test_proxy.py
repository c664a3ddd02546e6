"""`vllm-nvext proxy` in front of stock vLLM 0.32 (the `raw` server, with `--api-key`).

The translation tests run through it as the `proxy` param of `translated`; these are what only a
proxy can get wrong: streams passed as they come, the upstream's own auth answers, a client that
goes away aborting the engine's request, an upstream that is down, and every other route byte for
byte; and hidden-state capture in front of a stock server with the package's connector (`hs_stock`).
Marker `e2e_proxy`: `make test-e2e-proxy`, a pytest run of its own.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import time

import httpx
import pytest

from tests.e2e.test_parity import _example
from tests.helpers import (
    API_KEY,
    CHAT,
    COMPLETIONS,
    DIALECTS,
    greedy,
    http_client,
    post,
    rows,
    run_parity,
    sse_events,
    stream_digest,
    websocket_refusal,
)
from tests.support.servers import listen_port, ready
from vllm_nvext.capture.store import open_sink
from vllm_nvext.tools.server import ProxyServer

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_proxy]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_a_stream_that_opts_into_nothing_is_stock_vllms(proxy, raw, path):
    body = greedy(path, stream=True, stream_options={"include_usage": True})
    assert stream_digest(post(proxy, path, body)) == stream_digest(post(raw, path, body))


def test_a_translated_stream_arrives_as_a_stream(proxy):
    """Events framed as vLLM frames them, no length: the response is streamed (that each event leaves
    before the next exists is proven in tests/unit/test_proxy.py; the tiny model is too fast to see it)."""
    body = {**greedy(COMPLETIONS, stream=True, max_tokens=900, ignore_eos=True), **DIALECTS["nvext"]}
    with proxy.stream("POST", COMPLETIONS, json=body) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in resp.headers
        first = next(line for line in resp.iter_lines() if line.startswith("data: {"))
        assert json.loads(first[6:])["nvext"]["completion_token_ids"], "a translated event"


@pytest.mark.parametrize(
    "body",
    [
        {"return_token_ids": True},
        {"nvext": {"extra_fields": ["completion_token_ids"]}},
        {"nvext": {"extra_fields": "garbage"}},  # would be the proxy's 400: the upstream's 401 comes first
        {"nvext": "garbage"},
    ],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong"])
def test_without_the_key_the_client_gets_the_upstreams_own_401(proxy_server, raw_server, body, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    request = {**greedy(CHAT), **body}
    got = httpx.post(proxy_server.url + CHAT, json=request, headers=headers, timeout=60)
    stock = httpx.post(raw_server.url + CHAT, json=request, headers=headers, timeout=60)
    assert stock.status_code == 401
    assert (got.status_code, got.content) == (stock.status_code, stock.content)


def test_codex_websocket_attempt_is_answered_426_by_the_proxy(proxy_server):
    """docs/protocol.md §11.4: the proxy answers /v1/responses upgrades as the mounts do, after the key check."""
    assert websocket_refusal(proxy_server.url)[0] == 426
    assert websocket_refusal(proxy_server.url, auth=False)[0] == 403  # not proxied: closed, nothing of its own


def test_with_the_key_the_request_is_translated(proxy):
    got = post(proxy, CHAT, {**greedy(CHAT), **DIALECTS["nvext"]})
    assert got["nvext"]["completion_token_ids"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("GET", "/health", None),
        ("GET", "/version", None),
        ("POST", "/tokenize", {"model": "tiny", "prompt": "Hello there"}),
        ("POST", "/detokenize", {"model": "tiny", "tokens": [1, 2, 3]}),
        ("GET", "/no/such/route", None),
        ("DELETE", "/v1/models", None),
        ("POST", "/v1/embeddings", {"model": "tiny", "input": "x"}),
    ],
)
def test_every_other_route_is_forwarded_byte_for_byte(proxy, raw, method, path, body):
    got = proxy.request(method, path, json=body)
    stock = raw.request(method, path, json=body)
    assert got.status_code == stock.status_code, (got.text, stock.text)
    assert got.headers.get("content-type") == stock.headers.get("content-type"), (got.headers, stock.headers)
    if (method, path) == ("GET", "/v1/models"):

        def stable(models):  # each model's `created` and permission ids differ per answer
            return [{k: v for k, v in m.items() if k not in ("created", "permission")} for m in models["data"]]

        assert stable(got.json()) == stable(stock.json())
    else:
        assert got.content == stock.content, (got.content, stock.content)


def test_metrics_are_vllms_then_the_proxys_own(proxy, proxy_server):
    post(proxy, CHAT, {**greedy(CHAT), **DIALECTS["nvext"]})
    text = httpx.get(proxy_server.url + "/metrics", timeout=30).text
    assert "vllm:num_requests_running" in text, "the upstream's own metrics"
    counted = re.findall(r'^vllm_nvext:requests_total\{[^}]*dialect="nvext"[^}]*\} ([0-9.e+]+)$', text, re.M)
    assert counted and sum(float(v) for v in counted) >= 1, "the proxy's counters, after vLLM's"
    families = re.findall(r"^# TYPE (\S+)", text, re.M)
    assert len(families) == len(set(families)), "no family twice (one Prometheus could not read)"


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.M))


@pytest.mark.parametrize("dialect", ["vllm", "nvext"])
def test_clients_that_go_away_mid_stream_leave_nothing_running(proxy, proxy_server, raw_server, dialect):
    """Streams cut after their first event: the engine ends up idle, the proxy serves on, logs no error.

    That the upstream request is closed when the client goes (so vLLM aborts it) is proven in
    tests/unit/test_proxy.py: the tiny model often finishes 900 tokens before a cut reaches it.
    """
    body = {**greedy(COMPLETIONS, stream=True, max_tokens=900, ignore_eos=True), **DIALECTS[dialect]}
    payload = json.dumps(body).encode()
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", int(proxy_server.url.rsplit(":", 1)[1])), timeout=60) as sock:
            sock.sendall(
                f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
                + payload
            )
            received = b""
            while b"data: {" not in received:  # the first event
                chunk = sock.recv(4096)
                assert chunk, "the proxy answered the stream"
                received += chunk
    deadline = time.monotonic() + 120
    while _running(raw_server.url) > 0:
        assert time.monotonic() < deadline, "the engine still runs requests whose clients went away"
        time.sleep(0.2)
    assert post(proxy, COMPLETIONS, {**greedy(COMPLETIONS), **DIALECTS[dialect]})["choices"]
    log = proxy_server.log_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


def test_hidden_states_are_captured_through_the_proxy(proxy_hs_server):
    """In front of a stock server with the package's hidden-states connector: the parity check's
    files load and match, and the capture example checks every file it gets the path of."""
    status, table, _, _ = run_parity("--url", proxy_hs_server.url, "--hidden-states", "--api-key", API_KEY)
    assert status == 0, table
    equal = rows(table, "hidden states equal")
    assert equal and all("PASS" in line for line in equal), table
    result = _example("hidden_states_capture.py", proxy_hs_server.url, API_KEY)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all hidden-state files check out" in result.stdout


def test_an_upstream_that_is_down_is_a_502_in_vllms_envelope(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, never listening: refused
        with ProxyServer(upstream=dead, name="proxy-down", port=listen_port()) as down:
            resp = _when_listening(
                down.url, lambda client: client.post(CHAT, json={**greedy(CHAT), **DIALECTS["nvext"]})
            )
    body = resp.json()
    assert resp.status_code == 502 and body["error"]["code"] == 502 and body["error"]["type"] == "BadGatewayError"
    assert "127.0.0.1" not in resp.text and str(dead.rsplit(":", 1)[1]) not in resp.text, "no address"


def _when_listening(url: str, request, timeout: float = 60.0) -> httpx.Response:
    """The proxy's answer once it listens (its /health is the dead upstream's: a 502, not a readiness signal)."""
    deadline = time.monotonic() + timeout
    with http_client(url, timeout=30) as client:
        while True:
            try:
                return request(client)
            except httpx.ConnectError:
                assert time.monotonic() < deadline, "the proxy never listened"
                time.sleep(0.2)


# --- the front door (docs/scaling-out.md, "The proxy as a front door") --------------------------------


def _raw_request(url: str, head: bytes) -> bytes:
    """One request written byte for byte (what httpx would refuse or normalize); the whole answer."""
    host, port = url.rsplit("/", 1)[1].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_options_asterisk_is_answered_as_stock_answers_it(proxy_server, raw_server):
    head = b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    got, stock = _raw_request(proxy_server.url, head), _raw_request(raw_server.url, head)
    assert got.split(b"\r\n", 1)[0] == stock.split(b"\r\n", 1)[0] == b"HTTP/1.1 404 Not Found"
    assert got.rsplit(b"\r\n\r\n", 1)[1] == stock.rsplit(b"\r\n\r\n", 1)[1], (got, stock)
    assert "Traceback" not in proxy_server.log_text()


def test_the_upstream_logs_the_clients_address_never_one_the_client_chose(proxy, raw_server):
    """vLLM trusts X-Forwarded-For from 127.0.0.1 (uvicorn's proxy headers): the proxy writes it itself."""
    spoofed = "198.51.100.77"
    assert proxy.get("/v1/models", headers={"X-Forwarded-For": spoofed}).status_code == 200
    deadline = time.monotonic() + 10
    while '"GET /v1/models HTTP/1.1" 200' not in raw_server.log_text()[-2000:] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert spoofed not in raw_server.log_text(), "the upstream logged the address the client made up"


def test_request_id_header_bytes_reach_vllm_as_sent(proxy_server, raw_server):
    """vLLM names the request after X-Request-Id: through the proxy it is the id stock makes of the same bytes."""
    body = json.dumps(greedy(CHAT)).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n".encode()
    )
    request = head + b"X-Request-Id: caf\xe9\r\n\r\n" + body
    got, stock = _raw_request(proxy_server.url, request), _raw_request(raw_server.url, request)
    got_id = json.loads(got.rsplit(b"\r\n\r\n", 1)[1])["id"]
    assert got_id == json.loads(stock.rsplit(b"\r\n\r\n", 1)[1])["id"] and "caf\xe9" in got_id


def test_a_proxy_whose_key_the_upstream_refuses_says_so_at_start_up(raw_server, proxy_server):
    with ProxyServer(
        upstream=raw_server.url, args=["--api-key", "not-the-key"], name="proxy-other-key", port=listen_port()
    ) as other:
        _when_listening(other.url, lambda client: client.get("/health"))
        assert "vllm-nvext proxy: warning: the upstream refuses the proxy's --api-key" in other.log_text()
    assert "warning:" not in proxy_server.log_text(), "the proxy with the upstream's key says nothing"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_a_capturing_proxy_in_front_of_vllm_rs_sends_no_null_id_keys(proxy_capture_rust033_server, path):
    """`vllm-nvext proxy --capture` in front of vLLM 0.33's real vllm-rs: the proxy asks vllm-rs for the ids its
    store records; the client that asked for none gets vllm-rs's stream as vllm-rs writes it without ids (its
    token-id keys left out, never `null`), and the session holds the ids (docs/scaling-out.md, vLLM's Rust frontend)."""
    body = greedy(path, stream=True, stream_options={"include_usage": True})
    session = "rs" + path.replace("/", "-")  # rs-v1-chat-completions, rs-v1-completions
    with http_client(ready("rust033").url, auth=True) as raw:  # the proxy's upstream, stock vllm-rs
        stock = raw.post(path, json=body)
    with http_client(proxy_capture_rust033_server.url, auth=True) as proxy:
        got = proxy.post(path, json=body, headers={"x-nvext-session-id": session})
        assert got.status_code == 200 and stock.status_code == 200, got.text
        assert b"token_ids" not in stock.content, "vllm-rs writes no id key when none was asked"
        assert b"token_ids" not in got.content, "nor does the proxy that asked for them for its store"
        events = sse_events(got.content)
        assert stream_digest(events) == stream_digest(sse_events(stock.content))
        deadline = time.monotonic() + 30  # the store's writer thread writes the turn once the answer is over
        while (read := proxy.get(f"/v1/nvext/sessions/{session}")).status_code == 404 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert read.status_code == 200, read.text
    turns = read.json()["turns"]
    assert len(turns) == 1, turns
    (turn,) = turns
    assert turn["prompt_token_ids"] and len(turn["completion_token_ids"]) == turn["usage"]["completion_tokens"]


def test_a_keyless_capturing_proxy_in_front_of_keyed_vllm_hands_out_no_session(raw_server, tmp_path):
    """The docs' `vllm-nvext proxy --upstream U --capture URL` without --api-key, in front of the keyed `raw`: a
    session it captured (a client with the upstream's key generates through it) is never read nor deleted through it,
    with or without a key (the request goes on to vLLM: its 401, or its 404 for a route it lacks), and its start-up
    says so (docs/capture.md, The read API only behind a key)."""
    from vllm_nvext.middleware.sessions import NOT_SERVED_KEYLESS

    store = f"sqlite:///{tmp_path / 'capture.sqlite3'}"
    with ProxyServer(upstream=raw_server.url, args=["--capture", store], name="proxy-keyless-capture",
                     port=listen_port()) as keyless:  # fmt: skip
        victim = {"authorization": f"Bearer {API_KEY}", "x-nvext-session-id": "victim"}
        chat = _when_listening(keyless.url, lambda client: client.post(CHAT, json=greedy(CHAT), headers=victim))
        assert chat.status_code == 200, chat.text
        path = "/v1/nvext/sessions/victim"
        with http_client(keyless.url, auth=False, timeout=30) as client:  # the key only where a request names it
            deadline = time.monotonic() + 30  # the store's writer records the turn once the answer is over
            while not _stored_sessions(store) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert _stored_sessions(store) == ["victim"], "captured"
            for method in ("GET", "DELETE"):
                refused = client.request(method, path)
                assert refused.status_code == 401 and "token_ids" not in refused.text, (method, refused.text)
                keyed = client.request(method, path, headers={"authorization": f"Bearer {API_KEY}"})
                assert keyed.status_code in (404, 405) and "token_ids" not in keyed.text, (method, keyed.text)
        assert _stored_sessions(store) == ["victim"], "nothing deleted"
        assert NOT_SERVED_KEYLESS in keyless.log_text()


def _stored_sessions(store: str) -> list[str]:
    from vllm_nvext.capture.store import open_backend

    backend = open_backend(store, read_only=True)
    try:
        return list(backend.sessions(None))
    finally:
        backend.close()


def test_sigterm_writes_the_turns_queued_behind_a_busy_store(raw_server, tmp_path):
    """`vllm-nvext proxy --capture` in front of stock vLLM, 10 turns queued behind a busy store (another connection
    holds its write lock) when the proxy is sent SIGTERM: it says it is writing them, and all 10 are in the store
    once it has ended (docs/capture.md, the store); before, uvicorn re-raised the signal and none was written."""
    url = f"sqlite:///{tmp_path / 'capture.sqlite3'}"
    proxy = ProxyServer(upstream=raw_server.url, args=("--api-key", API_KEY, "--capture", url), name="proxy-sigterm",
                        port=listen_port())  # fmt: skip
    said = "writing the 10 queued turns before exit"
    try:
        proxy.start().wait_ready(120)
        busy = sqlite3.connect(tmp_path / "capture.sqlite3", isolation_level=None)
        busy.execute("BEGIN IMMEDIATE")  # the proxy's writer waits for the store (its busy timeout: 5 s)
        try:
            with http_client(proxy.url) as client:
                for _ in range(10):
                    post(client, CHAT, greedy(CHAT, max_tokens=1), {"x-nvext-session-id": "sigterm"})
            assert proxy.proc is not None
            proxy.proc.send_signal(signal.SIGTERM)
            while said not in proxy.log_text() and proxy.proc.poll() is None:
                time.sleep(0.05)
        finally:
            busy.execute("ROLLBACK")
            busy.close()
        proxy.proc.wait(60)
        assert said in proxy.log_text(), proxy.log_tail()
    finally:
        proxy.stop()
    sink = open_sink(url)
    try:
        turns = sink.read("sigterm") or []
    finally:
        sink.close()
    assert len(turns) == 10 and all(t["prompt_token_ids"] and t["completion_token_ids"] for t in turns)

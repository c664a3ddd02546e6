"""The ASGI pitfalls other middlewares fell into, each through `NvextMiddleware` on recorded answers.

Body replay handing over to the server's own `receive`, a client that leaves before its body,
the size cap reached without a Content-Length, a unary answer in several messages, and CRLF or
CR line ends in a stream.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tests.recorded import recording
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings
from vllm_nvext.asgi import RequestHeaders, set_header

NVEXT_IDS = {"extra_fields": ["completion_token_ids"]}


def _scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "root_path": "", "headers": headers}


def _nvext_body(rec) -> bytes:
    body = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    return json.dumps({**body, "nvext": NVEXT_IDS}).encode()


async def test_after_the_replayed_body_the_app_gets_the_servers_own_receive():
    """A streaming app waits on `receive` for the disconnect: it must see the server's message."""
    rec = recording("chat_stream_ids")
    body = _nvext_body(rec)
    disconnect = {"type": "http.disconnect"}
    server_messages = [{"type": "http.request", "body": body, "more_body": False}, disconnect]
    seen: list[dict[str, Any]] = []

    async def receive():
        return server_messages.pop(0)

    async def app(scope, app_receive, send):
        seen.append(await app_receive())  # the (rewritten) body
        seen.append(await app_receive())  # then whatever the server says next
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[dict[str, Any]] = []

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await NvextMiddleware(app, settings=Settings(mode=Mode.NVEXT))(_scope(rec.path, headers), receive, send)
    assert seen[0]["type"] == "http.request" and b"nvext" not in seen[0]["body"]
    assert b'"return_token_ids":true' in seen[0]["body"]
    assert seen[1] is disconnect, "the server's own message: no fake disconnect, no endless empty bodies"
    assert server_messages == []


async def test_a_whole_body_that_opts_out_reaches_the_app_then_the_servers_own_receive():
    rec = recording("chat_stream_ids")
    body = json.dumps({k: v for k, v in rec.request.items() if k != "return_token_ids"}).encode()
    disconnect = {"type": "http.disconnect"}
    server_messages = [{"type": "http.request", "body": memoryview(body), "more_body": False}, disconnect]
    seen: list[dict[str, Any]] = []

    async def receive():
        return server_messages.pop(0)

    async def app(scope, app_receive, send):
        seen.extend([await app_receive(), await app_receive()])

    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await NvextMiddleware(app, settings=Settings(mode=Mode.NVEXT))(_scope(rec.path, headers), receive, None)
    assert seen == [{"type": "http.request", "body": body, "more_body": False}, disconnect]
    assert type(seen[0]["body"]) is bytes and seen[1] is disconnect


async def test_a_client_that_leaves_before_its_body_reaches_no_app():
    rec = recording("chat_unary_ids")
    upstream = Upstream(body=rec.body)

    async def receive():
        return {"type": "http.disconnect"}

    async def send(message):
        raise AssertionError("nothing is sent to a client that left")

    headers = [(b"content-type", b"application/json"), (b"content-length", b"100")]
    await NvextMiddleware(upstream, settings=Settings())(_scope(rec.path, headers), receive, send)
    assert upstream.calls == 0


async def test_the_cap_is_enforced_without_a_content_length():
    """Chunked transfer: no length to trust, the bytes are counted as they arrive."""
    rec = recording("chat_unary_ids")
    upstream = Upstream(body=rec.body)
    body = json.dumps({"return_token_ids": True, "prompt": "x" * 3000}).encode()
    parts = [body[i : i + 500] for i in range(0, len(body), 500)]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]
    read = 0

    async def receive():
        nonlocal read
        read += 1
        return messages.pop(0)

    sent: list[dict[str, Any]] = []

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]
    await NvextMiddleware(upstream, settings=Settings(max_body_bytes=1000))(_scope(rec.path, headers), receive, send)
    assert sent[0]["status"] == 413 and upstream.calls == 0
    assert read < len(parts), "the body stops being read once the cap is passed"
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 413 and "1000" in error["message"]


async def test_a_unary_answer_in_several_messages_is_reshaped_whole():
    rec = recording("completions_unary_ids")
    cuts = tuple(range(1, len(rec.body), max(1, len(rec.body) // 7)))
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=rec.body, cuts=cuts)
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    result = await call(app, rec.path, _nvext_body(rec))
    got = json.loads(result.body)
    want = json.loads(rec.body)
    assert got["nvext"]["completion_token_ids"] == want["choices"][0]["token_ids"]
    assert got["choices"][0]["token_ids"] is None
    assert result.header(b"content-length") == str(len(result.body)).encode()
    assert len(result.body_messages) == 1, "one message with the right length, once complete"


def _with_line_ends(body: bytes, eol: bytes) -> bytes:
    return body.replace(b"\n", eol)


async def _stream_through(rec, body: bytes, mode: Mode) -> bytes:
    cuts = tuple(range(3, len(body), 11))  # line ends split across messages too
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=body, cuts=cuts)
    app = NvextMiddleware(upstream, settings=Settings(mode=mode))
    return (await call(app, rec.path, _nvext_body(rec))).body


async def test_crlf_and_cr_streams_are_reshaped_event_by_event():
    """vLLM writes LF; a proxy in between may write CRLF or CR. Each event keeps its line ends."""
    rec = recording("chat_stream_ids")
    for eol in (b"\r\n", b"\r"):
        body = _with_line_ends(rec.body, eol)
        out = await _stream_through(rec, body, Mode.NVEXT)
        blocks = [b for b in out.split(eol * 2) if b]
        assert blocks[-1] == b"data: [DONE]" and out.endswith(eol * 2)
        events = [json.loads(b[6:]) for b in blocks[:-1]]
        ids = [i for e in events if e.get("choices") for i in e["nvext"]["completion_token_ids"]]
        want = [i for e in rec.events() if e.get("choices") for c in e["choices"] for i in (c.get("token_ids") or [])]
        assert ids == want, f"{eol!r}: the ids under nvext are vLLM's, in order"
        assert all(not c.get("token_ids") for e in events for c in e.get("choices", []))


async def test_crlf_stream_in_vllm_placement_passes_byte_for_byte():
    rec = recording("chat_stream_ids")
    body = _with_line_ends(rec.body, b"\r\n")
    request = json.dumps(rec.request).encode()  # return_token_ids: vLLM placement, nothing to change
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=body, cuts=(5, 50, 51))
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.VLLM))
    assert (await call(app, rec.path, request)).body == body


NAMES = st.sampled_from([b"content-length", b"content-type", b"x-data-parallel-rank", b"host"])


@given(
    headers=st.lists(st.tuples(NAMES, st.sampled_from([b"1", b"2", b""])), max_size=6),
    name=NAMES,
    replace=st.booleans(),
    as_tuple=st.booleans(),
)
def test_a_set_header_leaves_the_others_in_order_and_its_own_last(headers, name, replace, as_tuple):
    """vLLM reads the first of a repeated header: a replaced one is there once, after the others."""
    scope = {"headers": tuple(headers) if as_tuple else list(headers)}
    set_header(scope, name, b"new", replace=replace)
    if not replace and any(n == name for n, _ in headers):
        assert scope["headers"] == list(headers), "a header the client sent is kept"
    else:
        assert scope["headers"] == [(n, v) for n, v in headers if n != name] + [(name, b"new")]


HEADER_NAMES = st.sampled_from([b"content-length", b"content-type", b"x-data-parallel-rank", b"x-nvext-mode", b"host"])


@given(headers=st.lists(st.tuples(HEADER_NAMES, st.sampled_from([b"1", b"12", b"-1", b"x", b""])), max_size=8))
def test_the_headers_read_are_the_ones_vllm_reads(headers):
    """The first Content-Type and X-data-parallel-rank, the last Content-Length, every mode header."""
    read = RequestHeaders.read({"headers": headers})
    first = {n: v for n, v in reversed(headers)}
    lengths = [v for n, v in headers if n == b"content-length"]
    want = RequestHeaders(
        content_type=first.get(b"content-type"),
        content_length=int(lengths[-1]) if lengths and lengths[-1].isdigit() else -1,
        dp_rank=first.get(b"x-data-parallel-rank"),
        modes=[v for n, v in headers if n == b"x-nvext-mode"],
    )
    assert read == want

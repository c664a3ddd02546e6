"""The ASGI pitfalls other middlewares fell into, each through `NvextMiddleware` on recorded answers.

Body replay handing over to the server's own `receive`, a client that leaves before its body,
the size cap reached without a Content-Length, a unary answer in several messages, and CRLF or
CR line ends in a stream.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.recorded import recording
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings, _vllm_compat
from vllm_nvext.asgi import (
    Replay,
    RequestHeaders,
    first_header,
    read_as_json,
    replay_body,
    set_header,
)

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


@pytest.mark.parametrize("length", [b"9" * 5000, b"0" * 4990 + b"1234", b"0" * 30])
@pytest.mark.parametrize("pieces", [1, 2])
async def test_a_content_length_of_thousands_of_digits_is_read_not_a_500(length, pieces):
    """A Content-Length longer than `int` reads (4300 digits) is a number all the same: past 18
    significant digits larger than any cap, its leading zeros ignored. The request is answered as
    with any other length (a server in front may refuse such a header; the middleware never 500s):
    a body in pieces declared larger than the cap gets the 413 of any such body."""
    rec = recording("chat_unary_ids")
    upstream = Upstream(body=rec.body)
    body = _nvext_body(rec)
    parts = [body] if pieces == 1 else [body[:10], body[10:]]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(parts) - 1} for i, p in enumerate(parts)]

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message):
        sent.append(message)

    headers = [(b"content-type", b"application/json"), (b"content-length", length)]
    await NvextMiddleware(upstream, settings=Settings())(_scope(rec.path, headers), receive, send)
    if pieces == 2 and length.startswith(b"9"):
        assert sent[0]["status"] == 413
        assert "byte limit" in json.loads(sent[1]["body"])["error"]["message"]
        return
    assert sent[0]["status"] == 200 and upstream.calls == 1
    assert b'"nvext"' not in upstream.received  # the request was read and rewritten, not passed on
    assert json.loads(sent[1]["body"])["nvext"]["completion_token_ids"]


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


async def _received(receive, calls: int) -> list[Any]:
    return [await receive() for _ in range(calls)]


@given(calls=st.integers(1, 4), body=st.sampled_from([b"", b"{}", b'{"a": 1}']))
async def test_a_replayed_whole_body_is_what_the_general_replay_gives(calls, body):
    """`replay_body` (the one-message case, no Python of ours after the body) against `Replay`:
    the same messages, then the server's own, called only when the app asks."""

    def server() -> tuple[Any, list[int]]:
        asked: list[int] = []

        async def receive():
            asked.append(1)
            return {"type": "http.disconnect", "n": len(asked)}

        return receive, asked

    (fast_server, fast_asked), (general_server, general_asked) = server(), server()
    fast = replay_body(body, fast_server)
    assert fast_asked == [], "nothing is received before the app asks"
    got = await _received(fast, calls)
    assert got == await _received(Replay([body], False, general_server), calls)
    assert got[0] == {"type": "http.request", "body": body, "more_body": False} and got[0]["body"] is body
    assert len(fast_asked) == len(general_asked) == calls - 1


HEADER_NAMES = st.sampled_from([b"content-type", b"content-length", b"x-nvext-mode", b"x-data-parallel-rank", b"host"])
HEADER_VALUES = st.sampled_from([b"application/json", b"text/plain", b"Application/X+JSON; q=1", b"12", b"x", b""])


@given(headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=6), untyped_json=st.booleans())
def test_the_request_headers_are_read_in_one_pass_as_starlette_reads_each(headers, untyped_json):
    """`RequestHeaders.read` in one pass against `first_header` and `read_as_json`, the rules
    vLLM's routes read by: the first Content-Type, the last Content-Length, every mode header."""
    scope = {"headers": headers}
    read = RequestHeaders.read(scope)
    assert read.content_type == first_header(scope, b"content-type")
    assert read.dp_rank == first_header(scope, b"x-data-parallel-rank")
    assert read.modes == [v for n, v in headers if n == b"x-nvext-mode"]
    lengths = [v for n, v in headers if n == b"content-length"]
    assert read.content_length == (int(lengths[-1]) if lengths and lengths[-1].isdigit() else -1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_vllm_compat, "untyped_body_is_json", lambda: untyped_json)
        assert RequestHeaders.read(scope).json_body is read_as_json(read.content_type)

"""Capture's edge cases (docs/capture.md): what a client, the store and the read API show where vLLM's answer, a
session id, another process or a second request of the same session is not the usual one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import sse_events
from tests.recorded import recording
from tests.support.capture import hold_writer
from tests.unit.asgi import Upstream, call
from tests.unit.test_proxy import _stop_what_started, proxy_over  # noqa: F401 (a fixture: the servers started stop)
from tests.unit.test_proxy import call as proxy_call
from vllm_nvext import NvextMiddleware, Settings
from vllm_nvext.capture import continuation
from vllm_nvext.capture.continuation import Memory
from vllm_nvext.capture.store import Sink

JSON = (b"content-type", b"application/json")
SESSION = (b"x-nvext-session-id", b"edge-1")
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
PROMPT = [1, 2, 3]


@pytest.fixture(autouse=True)
def _read_api_without_a_key(monkeypatch):
    """These servers check no API key: their read API is served as an operator opens it (docs/capture.md)."""
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE_API", "open")


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(ids: list[int] | None, content: str = "a", finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": finish, "token_ids": ids}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "tiny",
            "choices": [{**choice, **extra}]}  # fmt: skip


def _stream(middle: bytes, ids: bool = True, pad: int = 1200) -> bytes:
    """A chat stream as vLLM writes it with ids (`ids`) or without: a first chunk with the prompt ids, `pad` chunks
    of 200 characters (past the tap's bulk read, STREAM_READ_BYTES), `middle`, a last chunk with the finish."""
    first = _chunk(None, "")
    first["choices"][0].pop("token_ids")
    first["prompt_token_ids"] = PROMPT if ids else None
    body = [_event(first), _event(_chunk([4, 5] if ids else None))]
    body += [_event(_chunk([7] if ids else None, "x" * 200)) for _ in range(pad)]
    return b"".join([*body, middle, _event(_chunk([6] if ids else None, finish="stop")), b"data: [DONE]\n\n"])


def _app(body: bytes, tmp_path: Path | None, pure: bool) -> NvextMiddleware:
    upstream = Upstream(content_type="text/event-stream", body=body, cuts=(7, 5000))
    capture = None if tmp_path is None else f"sqlite:///{tmp_path / f'capture-{pure}.sqlite3'}"
    return NvextMiddleware(upstream, capture=capture, pure_python=pure)


def _stored(app: NvextMiddleware, session: str = "edge-1") -> list[dict[str, Any]] | None:
    sink: Sink | None = app.sink
    assert sink is not None and sink.flush()
    turns = sink.read(session)
    sink.close()
    return turns


# --- 1. the tap never breaks the client's answer --------------------------------------------------------------

# An event too deep for a JSON decoder (a digit run past 18 sends it to the standard library's, which recurses).
TOO_DEEP = b"data: " + b"[" * 100_000 + b"1" * 30 + b"]" * 100_000 + b"\n\n"
# A chunk the tap fails on: a logprob no float holds (JSON allows it; vLLM never writes it).
HUGE_LOGPROB = {"logprobs": {"content": [{"token": "b", "logprob": 10**400, "bytes": None, "top_logprobs": []}]}}


def _renderer(seen: list[continuation.Continuation | None]) -> type[Upstream]:
    """An upstream that notes in `seen`, where vLLM's renderer reads it (capture/render_hook.py), the request's turn."""

    class Renderer(Upstream):
        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            seen.append(continuation.TURN.get())
            await super().__call__(scope, receive, send)

    return Renderer


async def _chat(app: NvextMiddleware, *headers: tuple[bytes, bytes]) -> bytes:
    result = await call(app, "/v1/chat/completions", json.dumps(CHAT).encode(), headers=(JSON, *headers))
    assert result.status == 200
    return result.body


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
async def test_an_event_the_tap_cannot_decode_reaches_the_client_unchanged_and_the_turn_goes_on(pure, tmp_path):
    app = _app(_stream(TOO_DEEP), tmp_path, pure)
    assert await _chat(app, SESSION) == _stream(TOO_DEEP, ids=False), "vLLM's answer without ids, the event as sent"
    (turn,) = _stored(app) or []
    assert turn["prompt_token_ids"] == PROMPT
    assert turn["completion_token_ids"] == [4, 5, *[7] * 1200, 6] and turn["finish_reason"] == "stop"


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
async def test_a_chunk_the_tap_fails_on_ends_the_turn_there_and_the_client_gets_the_whole_answer(pure, tmp_path):
    bad, plain = _event(_chunk([9], **HUGE_LOGPROB)), _event(_chunk(None, **HUGE_LOGPROB))
    app = _app(_stream(bad), tmp_path, pure)
    assert await _chat(app, SESSION) == _stream(plain, ids=False), "every event, as vLLM writes it without ids"
    (turn,) = _stored(app) or []
    assert turn["completion_token_ids"] == [4, 5, *[7] * 1200], "what was read before the chunk"
    assert turn["finish_reason"] is None, "incomplete, as a stream cut short"


async def test_a_turn_the_tap_failed_on_is_never_continued(tmp_path, monkeypatch):
    """VLLM_NVEXT_CONTINUE_IDS: the next request of the session finds no turn to continue (vLLM's own rendering)."""
    monkeypatch.setattr(continuation, "MEMORY", Memory())
    seen: list[continuation.Continuation | None] = []
    renderer = _renderer(seen)

    bad = _event(_chunk([9], **HUGE_LOGPROB))
    for middle in (b"", bad, b""):  # a good turn, one the tap fails on, and the next request
        app = NvextMiddleware(renderer(content_type="text/event-stream", body=_stream(middle, pad=2)),
                              capture=f"sqlite:///{tmp_path / 'capture.sqlite3'}")  # fmt: skip
        await _chat(app, SESSION)
        app.sink.close()  # type: ignore[union-attr]
    assert [len(t.previous) if t else None for t in seen] == [0, 1, 1], "the failed turn is not among them"
    assert continuation.TURN.get() is None
    (good,) = [t.served() for t in seen[2].previous]  # type: ignore[union-attr]
    assert list(good[1]) == [4, 5, 7, 7, 6], "the first turn, whole"


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
async def test_a_unary_answer_the_tap_fails_on_reaches_the_client_as_without_capture(pure, tmp_path):
    answer = {"id": "chatcmpl-2", "object": "chat.completion", "created": 1, "model": "tiny",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "b"}, "finish_reason": "stop",
                           "token_ids": [9], **HUGE_LOGPROB}], "prompt_token_ids": PROMPT}  # fmt: skip
    body = json.dumps(answer).encode()
    app = NvextMiddleware(Upstream(body=body), capture=f"sqlite:///{tmp_path / 'c.sqlite3'}", pure_python=pure)
    result = await call(app, "/v1/chat/completions", json.dumps({**CHAT, "stream": False}).encode(),
                        headers=(JSON, SESSION))  # fmt: skip
    expected = {**answer, "prompt_token_ids": None, "choices": [{**answer["choices"][0], "token_ids": None}]}
    assert result.status == 200 and json.loads(result.body) == expected, "vLLM's ids never reach the client"
    (turn,) = _stored(app) or []
    assert turn["prompt_token_ids"] == PROMPT and turn["request_id"] == "chatcmpl-2"
    assert turn["completion_token_ids"] is None and turn["finish_reason"] is None, "not read: null, never []"


# --- 2. session ids of dots alone, and other odd ids ----------------------------------------------------------

DOTS = [".", "..", "..."]


def _unary(answer_id: str) -> bytes:
    choice = {"index": 0, "message": {"role": "assistant", "content": "b"}, "finish_reason": "stop", "token_ids": [9]}
    answer = {"id": answer_id, "object": "chat.completion", "created": 1, "model": "tiny", "choices": [choice]}
    return json.dumps({**answer, "prompt_token_ids": PROMPT}).encode()


async def _sessions_call(app: Any, method: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    """`method` on the read API at `raw` (the path as the client sent it; `path` decoded, as a server gives it)."""
    from urllib.parse import unquote_to_bytes

    path = unquote_to_bytes(raw).decode("utf-8", "surrogateescape")
    result = await call(app, path, b"", method=method, headers=(), scope_extra={"raw_path": raw})
    return result.status, json.loads(result.body)


@pytest.mark.parametrize("dots", DOTS)
async def test_a_session_header_of_dots_alone_is_skipped_and_the_turn_is_its_own_session(dots, store_url):
    app = NvextMiddleware(Upstream(body=_unary("chatcmpl-3")), capture=store_url)
    request = json.dumps({**CHAT, "stream": False}).encode()
    result = await call(app, "/v1/chat/completions", request, headers=(JSON, (b"x-nvext-session-id", dots.encode())))
    assert result.status == 200 and json.loads(result.body)["choices"][0]["token_ids"] is None
    sink = app.sink
    assert sink is not None and sink.flush()
    assert list(sink.backend.sessions(None)) == ["chatcmpl-3"], "nothing captured under the dots"
    (turn,) = sink.read("chatcmpl-3") or []
    assert turn["session_source"] == "request_id" and turn["completion_token_ids"] == [9]
    for method in ("GET", "DELETE"):
        status, body = await _sessions_call(app, method, f"/v1/nvext/sessions/{dots}".encode())
        assert (status, body["error"]["param"]) == (400, "session_id")
    sink.close()


@pytest.mark.parametrize("answer_id", ["..", "a/b", "x" * 300])
async def test_a_turn_named_by_a_response_id_that_is_no_session_id_is_not_recorded(answer_id, store_url):
    app = NvextMiddleware(Upstream(body=_unary(answer_id)), capture=store_url)
    result = await call(app, "/v1/chat/completions", json.dumps({**CHAT, "stream": False}).encode(), headers=(JSON,))
    assert result.status == 200 and json.loads(result.body)["id"] == answer_id, "the client's answer as vLLM's"
    sink = app.sink
    assert sink is not None and sink.flush()
    assert list(sink.backend.sessions(None)) == [] and sink.tally.recorded_turns == 0
    sink.close()


RULE = "session_id: expected 1 to 256 letters, digits or the characters . _ : ~ -, not dots alone"
ODD = [  # (the path's last segment as the client sent it, the status GET and DELETE answer)
    *[(d.encode(), 400) for d in DOTS],
    (b"%2E%2E", 400),  # dots, percent-encoded
    (b"a%2Fb", 400),  # an encoded slash: the id would be `a/b`
    (b"..%2F..%2Fetc%2Fpasswd", 400),
    (b"x" * 257, 400),
    (b"x" * 256, 404),  # the longest id: valid, not held
    ("é".encode().replace(b"\xc3", b"%C3").replace(b"\xa9", b"%A9"), 400),
    (b"%F0%9F%98%80", 400),  # an emoji
    (b"a%00b", 400),
    (b"a%20b", 400),
    (b".a", 404),  # dots with a letter: an id
    (b"run-1..", 404),
]


@pytest.mark.parametrize(("segment", "status"), ODD, ids=[s.decode()[:24] for s, _ in ODD])
async def test_odd_session_ids_on_get_and_delete_are_a_400_naming_session_id_or_a_404(segment, status, store_url):
    app = NvextMiddleware(Upstream(status=404, body=b'{"detail":"Not Found"}'), capture=store_url)
    sink = app.sink
    assert sink is not None
    for method in ("GET", "DELETE"):
        got, body = await _sessions_call(app, method, b"/v1/nvext/sessions/" + segment)
        assert (got, body["error"]["param"], body["error"]["code"]) == (status, "session_id", status)
        if status == 400:  # the rule, never the id sent back
            assert body["error"]["message"] == RULE
    sink.close()


# --- 3. one SQLite file, several processes: a session deleted and reused elsewhere ----------------------------


def _answer(prompt: list[int], completion: list[int]) -> Upstream:
    """vLLM's unary chat answer with ids: `prompt`, then `completion`."""
    choice = {"index": 0, "message": {"role": "assistant", "content": "b"}, "finish_reason": "stop",
              "token_ids": completion}  # fmt: skip
    answer = {"id": "chatcmpl-4", "object": "chat.completion", "created": 1, "model": "tiny", "choices": [choice]}
    return Upstream(body=json.dumps({**answer, "prompt_token_ids": prompt}).encode())


async def _turn(app: NvextMiddleware, prompt: list[int], completion: list[int]) -> None:
    app.app = _answer(prompt, completion)
    result = await call(app, "/v1/chat/completions", json.dumps({**CHAT, "stream": False}).encode(),
                        headers=(JSON, SESSION))  # fmt: skip
    assert result.status == 200
    assert app.sink is not None and app.sink.flush()


async def test_a_session_deleted_and_reused_by_another_process_does_not_bring_its_old_turn_back(tmp_path):
    """Two servers on one SQLite file (each its own store writer, as two API-server processes): A records two turns,
    B deletes the session and records two new ones, A records the next. It extends B's last turn, as the file holds
    it, not A's deleted one."""
    url = f"sqlite:///{tmp_path / 'shared.sqlite3'}"
    a, b = NvextMiddleware(Upstream(), capture=url), NvextMiddleware(Upstream(), capture=url)
    await _turn(a, [1, 2], [3])
    await _turn(a, [1, 2, 3, 4], [5])  # A holds this one as the session's last
    status, body = await _sessions_call(b, "DELETE", b"/v1/nvext/sessions/edge-1")
    assert (status, body) == (200, {"session_id": "edge-1", "deleted": True})
    await _turn(b, [8, 9], [10])
    await _turn(b, [8, 9, 10, 11], [12])
    await _turn(a, [8, 9, 10, 11, 12, 13], [14])  # extends B's last turn
    status, body = await _sessions_call(a, "GET", b"/v1/nvext/sessions/edge-1")
    assert status == 200
    turns = body["turns"]
    assert [t["prompt_token_ids"] for t in turns] == [[8, 9], [8, 9, 10, 11], [8, 9, 10, 11, 12, 13]]
    assert [(t["index"], t["extends_previous"], t["break"]) for t in turns] == [
        (0, None, None), (1, True, None), (2, True, None)]  # fmt: skip
    for app in (a, b):
        app.sink.close()  # type: ignore[union-attr]


async def test_delete_forgets_the_sessions_turns_for_continue_ids_in_this_process(tmp_path, monkeypatch):
    """VLLM_NVEXT_CONTINUE_IDS: after `DELETE`, the session's next request finds no turn to continue."""
    monkeypatch.setattr(continuation, "MEMORY", Memory())
    seen: list[continuation.Continuation | None] = []
    renderer = _renderer(seen)

    app = NvextMiddleware(Upstream(), capture=f"sqlite:///{tmp_path / 'capture.sqlite3'}")
    other = (b"x-nvext-session-id", b"edge-2")
    for headers in ((SESSION,), (other,), (SESSION, (b"x-claude-code-agent-id", b"sub-1"))):
        app.app = renderer(content_type="text/event-stream", body=_stream(b"", pad=1))
        result = await call(app, "/v1/chat/completions", json.dumps(CHAT).encode(), headers=(JSON, *headers))
        assert result.status == 200
    assert app.sink is not None and app.sink.flush(), "the turns are in the store"
    assert await _sessions_call(app, "DELETE", b"/v1/nvext/sessions/edge-1") == (
        200, {"session_id": "edge-1", "deleted": True})  # fmt: skip
    for headers in ((SESSION,), (SESSION, (b"x-claude-code-agent-id", b"sub-1")), (other,)):
        app.app = renderer(content_type="text/event-stream", body=_stream(b"", pad=1))
        await call(app, "/v1/chat/completions", json.dumps(CHAT).encode(), headers=(JSON, *headers))
    assert [len(t.previous) for t in seen if t is not None] == [0, 0, 0, 0, 0, 1], "only edge-2 still continues"
    app.sink.close()  # type: ignore[union-attr]


async def test_a_delete_right_after_a_turn_ends_leaves_no_turn_of_it_behind(tmp_path):
    """The client has its whole answer, its turn still waits in the store writer's queue (the writer held, as under
    load), and the client DELETEs the session: the turn is written first and deleted with the rest, so the
    session does not come back (docs/capture.md: `DELETE` removes a session at once). The writer is released
    when the DELETE starts waiting for it, or else once the store's delete ran: either way, no timing."""
    app = NvextMiddleware(Upstream(), capture=f"sqlite:///{tmp_path / 'capture.sqlite3'}")
    sink = app.sink
    assert sink is not None
    await _turn(app, [1, 2], [3])
    gate, delete, flush = hold_writer(sink), sink.backend.delete, sink.flush

    def delete_then_release(session_id: str) -> bool:
        found = delete(session_id)
        gate.set()
        return found

    def release_then_flush(timeout: float | None = None) -> bool:
        gate.set()
        return flush(timeout)

    sink.backend.delete = delete_then_release  # type: ignore[method-assign]
    sink.flush = release_then_flush  # type: ignore[method-assign]
    app.app = _answer([1, 2, 3, 4], [5])
    result = await call(app, "/v1/chat/completions", json.dumps({**CHAT, "stream": False}).encode(),
                        headers=(JSON, SESSION))  # fmt: skip
    assert result.status == 200  # the client has its answer; its turn is queued, not written
    assert await _sessions_call(app, "DELETE", b"/v1/nvext/sessions/edge-1") == (
        200, {"session_id": "edge-1", "deleted": True})  # fmt: skip
    assert sink.flush()
    status, body = await _sessions_call(app, "GET", b"/v1/nvext/sessions/edge-1")
    sink.close()
    assert (status, body["error"]["param"]) == (404, "session_id"), f"the deleted session came back: {body}"


async def test_a_delete_the_store_writer_cannot_reach_in_time_is_a_503_and_deletes_nothing(tmp_path, monkeypatch):
    """The writer is stuck behind a turn queued before the DELETE: the client gets 503 (retry), never a 200 that
    the queued turn would undo, and the session is as it was."""
    from vllm_nvext.capture import store

    app = NvextMiddleware(Upstream(), capture=f"sqlite:///{tmp_path / 'capture.sqlite3'}")
    sink = app.sink
    assert sink is not None
    await _turn(app, [1, 2], [3])
    gate = hold_writer(sink)
    app.app = _answer([1, 2, 3, 4], [5])
    await call(app, "/v1/chat/completions", json.dumps({**CHAT, "stream": False}).encode(), headers=(JSON, SESSION))
    monkeypatch.setattr(store, "CLOSE_WAIT_S", 0.05)
    status, body = await _sessions_call(app, "DELETE", b"/v1/nvext/sessions/edge-1")
    assert (status, body["error"]["message"]) == (503, "the capture store is unavailable")
    gate.set()
    assert sink.flush(10)
    status, body = await _sessions_call(app, "GET", b"/v1/nvext/sessions/edge-1")
    sink.close()
    assert status == 200 and [t["completion_token_ids"] for t in body["turns"]] == [[3], [5]]


# --- 4. `vllm-nvext proxy --capture` in front of vLLM's Rust frontend ------------------------------------------

RUST_STREAMS = ["chat_stream_ids", "chat_stream_ids_logprobs", "chat_stream_ids_long", "completions_stream_ids",
                "completions_stream_ids_logprobs", "completions_stream_ids_long"]  # fmt: skip
ID_KEYS = ("token_ids", "prompt_token_ids")


def _vllm_rs(version: str, rec: Any) -> Any:
    """vllm-rs as recorded: its /version (`rust_frontend_version`, as the 0.33 binary writes it) and the stream."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def answer_version(request: Request) -> JSONResponse:
        return JSONResponse({"version": f"{version}.0", "rust_frontend_version": f"{version}.0"})

    async def answer(request: Request) -> Response:
        assert (await request.json())["return_token_ids"] is True, "the ids are turned on upstream"
        return Response(rec.body, media_type=rec.content_type)

    routes = [Route("/version", answer_version), Route(rec.path, answer, methods=["POST"])]
    return Starlette(routes=routes)


def _id_layout(events: list[dict[str, Any]]) -> set[tuple[str, str, bool]]:
    """Where a stream carries an id key, and whether null: ("root" | "choice", key, null)."""
    found = {("root", k, e[k] is None) for e in events for k in ID_KEYS if k in e}
    return found | {("choice", k, c[k] is None) for e in events for c in e.get("choices") or () for k in ID_KEYS
                    if k in c}  # fmt: skip


@pytest.mark.parametrize("version", ["0.33", "0.34"])
@pytest.mark.parametrize("name", RUST_STREAMS)
async def test_the_proxy_capturing_in_front_of_vllm_rs_deletes_the_id_keys_vllm_rs_leaves_out(name, version, tmp_path):
    """vllm-rs leaves a stream's id keys out where no ids were asked; the proxy turns them on for capture, and the
    client must get them as vllm-rs leaves them: no `"token_ids":null` the stock server never writes."""
    rec = recording(f"vllm-{version}-rust/{name}")
    plain = recording(f"vllm-{version}-rust/{name.split('_ids')[0]}_plain")  # the same request, no ids asked
    app = await proxy_over(_vllm_rs(version, rec), settings=Settings(capture=f"sqlite:///{tmp_path / 'c.sqlite3'}"))
    await app.forwarder._read_version()
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}  # the client asks for nothing
    result = await proxy_call(app, rec.path, json.dumps(request).encode(), headers=(JSON, SESSION))
    assert result.status == 200
    got = sse_events(result.body)
    assert _id_layout(got) == _id_layout(plain.events()), "the id keys where vllm-rs writes them without ids"
    expected = json.loads(json.dumps(rec.events()))
    for event in expected:
        for choice in event["choices"]:
            for key in ID_KEYS:
                choice.pop(key, None)
        if "prompt_token_ids" in event:  # chat's root: left out by 0.33, null from 0.34 (its plain stream's)
            event["prompt_token_ids"] = None
            if version == "0.33":
                del event["prompt_token_ids"]
    assert got == expected, "every other byte is vllm-rs's own"
    (turn,) = _stored(app.middleware) or []
    sent = rec.events()
    assert turn["completion_token_ids"] == [i for e in sent for c in e["choices"] for i in c.get("token_ids") or []]
    assert turn["prompt_token_ids"] == next(e.get("prompt_token_ids") or e["choices"][0].get("prompt_token_ids")
                                            for e in sent if e["choices"])  # fmt: skip


@pytest.mark.parametrize("version", ["0.33", "0.34"])
@pytest.mark.parametrize("name", ["chat_stream_ids", "completions_stream_ids"])
async def test_a_client_asking_nvext_ids_through_the_proxy_to_vllm_rs_gets_no_null_id_keys_either(name, version):
    rec = recording(f"vllm-{version}-rust/{name}")
    app = await proxy_over(_vllm_rs(version, rec))
    await app.forwarder._read_version()
    request = {**{k: v for k, v in rec.request.items() if k != "return_token_ids"},
               "nvext": {"extra_fields": ["completion_token_ids"]}}  # fmt: skip
    result = await proxy_call(app, rec.path, json.dumps(request).encode(), headers=(JSON,))
    got = sse_events(result.body)
    ids = [i for e in rec.events() for c in e["choices"] for i in c.get("token_ids") or []]
    assert [i for e in got for i in (e.get("nvext") or {}).get("completion_token_ids") or []] == ids
    assert not any(k in c for e in got for c in e["choices"] for k in ID_KEYS), "vLLM's copies left out"
    assert all(e.get("prompt_token_ids", None) is None for e in got)
    assert (b'"prompt_token_ids":null' in result.body) == (version == "0.34" and name.startswith("chat"))


# --- 5. overlapping turns of one session --------------------------------------------------------------------


def _short_stream(request_id: str, prompt: list[int], ids: list[int]) -> bytes:
    """A chat stream with ids: the role chunk with the prompt ids, one chunk per id, the finish."""
    first = {"id": request_id, "object": "chat.completion.chunk", "created": 1, "model": "tiny",
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}], "prompt_token_ids": prompt}  # fmt: skip
    chunks = [{**_chunk([i]), "id": request_id} for i in ids]
    chunks[-1]["choices"][0]["finish_reason"] = "stop"
    return b"".join([_event(first), *map(_event, chunks), b"data: [DONE]\n\n"])


class _Overlap:
    """vLLM answering three requests of one session (header `x-which`): `a` sends its first event, then waits for
    `gate` while `b` is served whole; `c` comes after both. What each request's renderer saw of its session's
    turns (`continuation.TURN`: what VLLM_NVEXT_CONTINUE_IDS splices from) is kept in `seen`."""

    BODIES = {"a": _short_stream("chatcmpl-a", [1, 2, 3], [4, 5]), "b": _short_stream("chatcmpl-b", [1, 2, 3], [6]),
              "c": _short_stream("chatcmpl-c", [1, 2, 3, 4, 5, 9], [10])}  # fmt: skip

    def __init__(self) -> None:
        import asyncio

        self.gate, self.waiting = asyncio.Event(), asyncio.Event()
        self.seen: dict[str, list[tuple[list[int], list[int]]]] = {}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        which = dict(scope["headers"])[b"x-which"].decode()
        turn = continuation.TURN.get()
        assert turn is not None
        self.seen[which] = [(list(p or ()), list(c or ())) for p, c, *_ in (t.served() for t in turn.previous)]
        while (await receive()).get("more_body"):
            pass
        body = self.BODIES[which]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        first = body.index(b"\n\n") + 2
        await send({"type": "http.response.body", "body": body[:first], "more_body": True})
        if which == "a":
            self.waiting.set()
            await self.gate.wait()
        await send({"type": "http.response.body", "body": body[first:], "more_body": False})


async def test_overlapping_turns_are_stored_as_they_end_and_never_continue_one_still_running(tmp_path, monkeypatch):
    """docs/capture.md "Overlapping turns": `b` starts while `a` streams and ends first. The store holds `b` then
    `a` (the order they ended), `a`'s `extends_previous` compared with `b`; `b` had no turn to continue (`a` was
    still running); `c`, after both, may continue either, the one begun last first."""
    import asyncio

    monkeypatch.setattr(continuation, "MEMORY", Memory())
    upstream = _Overlap()
    app = NvextMiddleware(upstream, capture=f"sqlite:///{tmp_path / 'capture.sqlite3'}")

    async def request(which: str) -> bytes:
        return await _chat(app, SESSION, (b"x-which", which.encode()))

    a = asyncio.create_task(request("a"))
    await upstream.waiting.wait()  # `a` is streaming
    assert sse_events(await request("b"))[-1]["choices"][0]["finish_reason"] == "stop"
    upstream.gate.set()
    assert sse_events(await a)[-1]["choices"][0]["finish_reason"] == "stop"
    await request("c")
    assert upstream.seen == {"a": [], "b": [], "c": [([1, 2, 3], [6]), ([1, 2, 3], [4, 5])]}
    assert app.sink is not None and app.sink.flush(), "the turns are in the store"
    status, body = await _sessions_call(app, "GET", b"/v1/nvext/sessions/edge-1")
    assert status == 200
    stored = [(t["index"], t["request_id"], t["completion_token_ids"], t["extends_previous"]) for t in body["turns"]]
    assert stored == [(0, "chatcmpl-b", [6], None), (1, "chatcmpl-a", [4, 5], False), (2, "chatcmpl-c", [10], True)]
    assert body["turns"][1]["break"]["index"] == 3, "`a` leaves `b`'s ids where `b`'s answer begins"
    app.sink.close()  # type: ignore[union-attr]

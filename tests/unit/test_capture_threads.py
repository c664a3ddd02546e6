"""One trajectory per agent thread, request kinds, and sessions by URL (docs/capture.md: Session keys, Request
kinds, Sessions by URL).

Over vLLM 0.32's recorded answers through the middleware, on FastAPI apps mounted as vLLM mounts each (the plugin
inside vLLM's own key check, `--middleware` outside it, both as `vllm-nvext serve` mounts them), and through the
real `vllm-nvext proxy` app in front of a served upstream.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from tests.recorded import recording
from tests.unit.asgi import Upstream, call
from tests.unit.test_capture_tap import _app, _turns
from tests.unit.test_proxy import _stop_what_started, proxy_over  # noqa: F401 (a fixture: the servers started stop)
from vllm_nvext import NvextMiddleware
from vllm_nvext.capture import continuation
from vllm_nvext.capture.continuation import Memory
from vllm_nvext.capture.keys import header_key
from vllm_nvext.capture.record import Turn
from vllm_nvext.capture.tap import Collector
from vllm_nvext.config import Settings
from vllm_nvext.middleware import url
from vllm_nvext.plugin import NvextPlugin

JSON = (b"content-type", b"application/json")
KEY = "sk-threads"
CT = {"content-type": "application/json"}


def _chat() -> tuple[Any, bytes]:
    rec = recording("chat_unary_ids")
    return rec, json.dumps({k: v for k, v in rec.request.items() if k != "return_token_ids"}).encode()


async def _send_all(tmp_path: Path, requests: list[tuple[tuple[bytes, bytes], ...]]) -> list[Turn]:
    rec, body = _chat()
    app = _app(Upstream(content_type=rec.content_type, body=rec.body), tmp_path)
    for headers in requests:
        assert (await call(app, rec.path, body, headers=(JSON, *headers))).status == 200
    return _turns(app)


async def test_codex_subagent_threads_are_trajectories_of_their_own_with_their_group_and_parent(tmp_path):
    group = (b"session-id", b"codex-sess-1")  # shared by the root thread and every subagent it spawns
    spawned = ((b"x-codex-parent-thread-id", b"thread-root"), (b"x-openai-subagent", b"collab_spawn"))
    turns = await _send_all(tmp_path, [
        (group, (b"thread-id", b"thread-root")),
        (group, (b"thread-id", b"thread-a"), *spawned),  # two parallel collab_spawn subagents
        (group, (b"thread-id", b"thread-b"), *spawned),
        (group, (b"thread-id", b"thread-a"), *spawned),
    ])  # fmt: skip
    by_thread = {t.session_id: [u for u in turns if u.session_id == t.session_id] for t in turns}
    assert sorted(by_thread) == ["thread-a", "thread-b", "thread-root"], "one trajectory per thread, never merged"
    assert [t.index for t in by_thread["thread-a"]] == [0, 1], "a subagent's turns are its own, in order"
    for turn in turns:
        assert (turn.session_source, turn.group_id) == ("thread-id", "codex-sess-1")
        expected = None if turn.session_id == "thread-root" else "thread-root"
        assert turn.parent_id == expected and turn.to_json()["group_id"] == "codex-sess-1"


async def test_a_claude_code_subagent_is_its_own_thread_within_its_session(tmp_path):
    session = (b"x-claude-code-session-id", b"cc-7")
    sub = ((b"x-claude-code-agent-id", b"agent-x"), (b"x-claude-code-parent-agent-id", b"agent-root"))
    turns = await _send_all(tmp_path, [(session,), (session, *sub), (session,)])
    root = [t for t in turns if t.session_id == "cc-7"]
    (child,) = [t for t in turns if t.session_id == "cc-7:agent-x"]
    assert [t.index for t in root] == [0, 1], "the root thread's turns, without the subagent's between them"
    assert root[1].extends_previous is not None, "compared with the root's own previous turn"
    assert (child.group_id, child.agent_id, child.parent_id, child.index) == ("cc-7", "agent-x", "agent-root", 0)
    assert all(t.group_id == "cc-7" and t.session_source == "x-claude-code-session-id" for t in root)


def _kind(kind: str) -> tuple[bytes, bytes]:
    return (b"x-codex-turn-metadata", json.dumps({"turn_id": "t-1", "request_kind": kind}).encode())


async def test_codex_request_kinds_are_recorded_and_a_side_request_starts_a_new_segment(tmp_path):
    thread = (b"thread-id", b"th-1")
    turns = await _send_all(tmp_path, [(thread, _kind("turn")), (thread, _kind("compaction")), (thread, _kind("turn"))])
    assert [t.request_kind for t in turns] == ["turn", "compaction", "turn"]
    assert [t.to_json()["request_kind"] for t in turns] == ["turn", "compaction", "turn"]
    # The same prompt each time: a plain turn after a turn compares (false: it does not repeat the answer) ...
    alone = await _send_all(tmp_path / "plain", [(thread, _kind("turn")), (thread, _kind("turn"))])
    assert alone[1].extends_previous is False and alone[1].break_ is not None
    # ... a compaction is never compared with the turn before it, nor the turn after it with the compaction.
    assert [(t.extends_previous, t.break_) for t in turns[1:]] == [(None, None), (None, None)]
    for value in (b"not json", b'{"request_kind": 7}', b'["turn"]', json.dumps({"request_kind": "a/b"}).encode()):
        assert header_key([thread, (b"x-codex-turn-metadata", value)]).request_kind is None, value


class _NoSink:
    def submit(self, turn: Any) -> None:
        pass


def _served(thread: bytes, prompt: list[int], completion: list[int], kind: str = "turn") -> Any:
    """A finished chat turn of Codex thread `thread` in the continuation memory; what the memory gave it."""
    headers = [(b"session-id", b"group"), (b"thread-id", thread), _kind(kind)]
    tap = Collector.of(_NoSink(), "/v1/chat/completions", headers, None, 1.0)
    assert tap is not None
    given = tap.continuation
    tap.body({"id": "chatcmpl-1", "prompt_token_ids": prompt, "choices": [{"index": 0, "token_ids": completion,
              "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}]})  # fmt: skip
    tap.finish()
    return given


def test_continue_ids_continue_each_thread_from_its_own_turns_and_never_a_side_request(monkeypatch):
    monkeypatch.setattr(continuation, "MEMORY", Memory())
    assert _served(b"thread-a", [1, 2], [3]).previous == []
    assert _served(b"thread-b", [7, 8], [9]).previous == [], "another thread of the group: nothing to continue"
    assert _served(b"thread-a", [50, 51], [52], kind="compaction") is None, "a compaction is never continued"
    after = _served(b"thread-a", [1, 2, 3, 4], [5])
    previous = [turn.served()[:2] for turn in after.previous]
    assert [(list(p or ()), list(c or ())) for p, c in previous] == [([1, 2], [3])], (
        "thread-a continues its own turn: not thread-b's, not the compaction's"
    )


# Sessions by URL: `/nvext/sessions/{id}` before any route, on FastAPI apps mounted as vLLM mounts each.


def _vllm_app(kind: str, url: str, monkeypatch: pytest.MonkeyPatch, ran: list[str]) -> Any:
    rec, _ = _chat()
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE", url)
    app = FastAPI()
    app.state.args = SimpleNamespace(api_key=[KEY])

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        ran.append("/v1/models")
        return {"object": "list", "data": [{"id": rec.request["model"], "object": "model"}]}

    @app.get("/health")
    async def health() -> Response:
        ran.append("/health")
        return Response(status_code=200)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        ran.append("/v1/chat/completions")
        assert (await request.json())["return_token_ids"] is True, "capture turned ids on"
        return Response(rec.body, media_type="application/json")

    if kind in ("plugin", "both"):
        NvextPlugin().attach_router(app)  # before vLLM's own middleware: inside its key check
    app.add_middleware(AuthenticationMiddleware, tokens=[KEY])
    if kind in ("middleware", "both"):
        app.add_middleware(NvextMiddleware)  # `--middleware`: added last, outermost
    return app


async def _get(app: Any, method: str, path: str, key: str | None = KEY, body: bytes | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        headers["content-type"] = "application/json"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.request(method, path, headers=headers, content=body)


def _sink(app: Any) -> Any:
    stack = app.middleware_stack or app.build_middleware_stack()
    app.middleware_stack = stack
    while not isinstance(stack, NvextMiddleware):
        stack = stack.app
    return stack.sink


MOUNTS = ["middleware", "plugin", "both"]


@pytest.mark.parametrize("kind", MOUNTS)
async def test_a_base_url_under_nvext_sessions_names_the_session_before_any_header(kind, tmp_path, monkeypatch):
    ran: list[str] = []
    app = _vllm_app(kind, f"sqlite:///{tmp_path}/c.sqlite3", monkeypatch, ran)
    base = "/nvext/sessions/rollout-17/v1"
    models = await _get(app, "GET", base + "/models")
    assert models.status_code == 200 and models.json() == (await _get(app, "GET", "/v1/models")).json()
    rec, body = _chat()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        headers = {"authorization": f"Bearer {KEY}", "x-nvext-session-id": "from-header", "thread-id": "t", **CT}
        answer = await client.post(base + "/chat/completions", content=body, headers=headers)
    assert answer.status_code == 200 and answer.json()["choices"][0]["token_ids"] is None, "stock vLLM's answer"
    sink = _sink(app)
    assert sink.flush()
    (turn,) = [Turn.from_json(t) for t in sink.read("rollout-17") or []]
    assert (turn.session_source, turn.prompt_token_ids) == ("url", json.loads(rec.body)["prompt_token_ids"])
    assert sink.read("from-header") is None and sink.read("t") is None, "the URL names it before any header"
    read = await _get(app, "GET", "/nvext/sessions/other/v1/nvext/sessions/rollout-17")
    assert read.status_code == 200 and read.json()["turns"][0]["session_source"] == "url", "the read API under it"
    sink.close()


@pytest.mark.parametrize("kind", MOUNTS)
async def test_a_prefixed_route_is_under_the_key_check_of_the_route_it_names(kind, tmp_path, monkeypatch):
    ran: list[str] = []
    app = _vllm_app(kind, f"sqlite:///{tmp_path}/c.sqlite3", monkeypatch, ran)
    _, body = _chat()
    for path, method, sent in (("/v1/models", "GET", None), ("/v1/chat/completions", "POST", body)):
        stock = await _get(app, method, path, key=None, body=sent)
        for key in (None, "sk-wrong"):
            prefixed = await _get(app, method, "/nvext/sessions/r-1" + path, key=key, body=sent)
            assert (prefixed.status_code, prefixed.content) == (401, stock.content), (path, key)
            assert prefixed.headers["content-type"] == stock.headers["content-type"]
        bad = await _get(app, method, "/nvext/sessions/bad!id" + path, key=None, body=sent)
        assert bad.status_code == 401, "refused for the key before the id is even looked at"
    assert ran == [], "no route ran for a request without the key"
    assert (await _get(app, "GET", "/nvext/sessions/r-1/health", key=None)).status_code == 200, "as /health: open"
    assert _sink(app).read("r-1") is None
    _sink(app).close()


@pytest.mark.parametrize("kind", MOUNTS)
@pytest.mark.parametrize("segment", ["bad!id", "a%2Fb", "x" * 257, "..."])
async def test_an_invalid_session_segment_is_a_400_naming_it(kind, segment, tmp_path, monkeypatch):
    ran: list[str] = []
    app = _vllm_app(kind, f"sqlite:///{tmp_path}/c.sqlite3", monkeypatch, ran)
    answer = await _get(app, "GET", f"/nvext/sessions/{segment}/v1/models")
    assert answer.status_code == 400 and ran == []
    error = answer.json()["error"]
    assert error["param"] == "session_id" and "/nvext/sessions/{session_id}/" in error["message"]
    assert error["message"] == url.BAD_SEGMENT, "never echoes the client's input"
    _sink(app).close()


async def test_the_proxy_forwards_a_prefixed_request_to_the_route_it_names_under_its_key(tmp_path):
    seen: list[str] = []
    rec, body = _chat()

    async def upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append(scope["raw_path"].decode())
        while (await receive()).get("more_body"):
            pass
        answer = rec.body if scope["path"] == "/v1/chat/completions" else b'{"object":"list","data":[]}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": answer})

    settings = Settings.create(capture=f"sqlite:///{tmp_path}/c.sqlite3")
    proxy = await proxy_over(upstream, keys=(KEY,), settings=settings)
    bearer = (b"authorization", f"Bearer {KEY}".encode())
    models = await call(proxy, "/nvext/sessions/roll-9/v1/models", b"", method="GET", headers=(bearer,))
    assert models.status == 200 and seen == ["/v1/models"], "the upstream gets the route the prefix names"
    chat = await call(proxy, "/nvext/sessions/roll-9/v1/chat/completions", body, headers=(JSON, bearer))
    assert chat.status == 200 and seen[-1] == "/v1/chat/completions"
    keyless = await call(proxy, "/nvext/sessions/roll-9/v1/models", b"", method="GET", headers=())
    assert (keyless.status, keyless.body) == (401, b'{"error":"Unauthorized"}') and len(seen) == 2
    sink = proxy.middleware.sink
    assert sink is not None and sink.flush()
    (turn,) = sink.read("roll-9") or []
    assert turn["session_source"] == "url" and turn["prompt_token_ids"] == json.loads(rec.body)["prompt_token_ids"]
    sink.close()


async def test_each_threads_atif_document_says_how_it_nests_in_its_run(tmp_path):
    """docs/trainer-formats.md, Subagents: a thread of its own is a document of its own, whose `extra` names its run
    (`group_id`) and the session of the thread that spawned it (`parent_session_id`), so a trainer nests them; each
    valid ATIF v1.7 (its authors' schema, vendored)."""
    from tests.unit.test_capture_formats import check_atif
    from vllm_nvext.capture.atif import trajectory

    claude = (b"x-claude-code-session-id", b"cc-9")
    codex = (b"session-id", b"codex-9")
    turns = await _send_all(tmp_path, [
        (claude,),
        (claude, (b"x-claude-code-agent-id", b"agent-x")),  # spawned by the main agent
        (claude, (b"x-claude-code-agent-id", b"agent-y"), (b"x-claude-code-parent-agent-id", b"agent-x")),
        (codex, (b"thread-id", b"thread-root")),
        (codex, (b"thread-id", b"thread-a"), (b"x-codex-parent-thread-id", b"thread-root")),
    ])  # fmt: skip
    docs = {}
    for session in dict.fromkeys(t.session_id for t in turns):
        doc = trajectory(session, [t.to_json() for t in turns if t.session_id == session])
        check_atif(doc)
        docs[session] = doc.get("extra")
    assert docs == {
        "cc-9": None,  # the run's root: nothing to nest in
        "cc-9:agent-x": {"group_id": "cc-9", "parent_session_id": "cc-9"},
        "cc-9:agent-y": {"group_id": "cc-9", "parent_session_id": "cc-9:agent-x"},
        "thread-root": {"group_id": "codex-9"},
        "thread-a": {"group_id": "codex-9", "parent_session_id": "thread-root"},
    }

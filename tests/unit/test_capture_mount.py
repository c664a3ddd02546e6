"""One capture per process: `vllm-nvext serve` mounts both `--middleware` and the plugin in one API-server process,
built here as vLLM builds them (the plugin's `attach_router` inside vLLM's key check, `--middleware` added last,
outermost). Both mounts capture into one sink with one writer thread, and the lifespan's shutdown writes its queue
out and closes the store once (docs/capture.md, Mounts)."""

from __future__ import annotations

import json
import threading
from collections.abc import MutableMapping
from types import SimpleNamespace
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from tests.support.capture_app import ANSWER
from vllm_nvext import NvextMiddleware
from vllm_nvext.capture.store import open_sink
from vllm_nvext.plugin import NvextPlugin

KEY = "sk-mount"
WRITER = "vllm-nvext-capture"  # the sink's writer thread


def _writers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == WRITER}


def _both_mounts(url: str, monkeypatch: Any) -> tuple[FastAPI, list[NvextMiddleware]]:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE", url)
    app = FastAPI()
    app.state.args = SimpleNamespace(api_key=[KEY])

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        await request.body()
        return Response(json.dumps(ANSWER), media_type="application/json")

    NvextPlugin().attach_router(app)  # before vLLM's own middleware: inside its key check
    app.add_middleware(AuthenticationMiddleware, tokens=[KEY])
    app.add_middleware(NvextMiddleware)  # `--middleware`: added last, outermost
    app.middleware_stack = stack = app.build_middleware_stack()
    mounts = []
    while hasattr(stack, "app"):
        if isinstance(stack, NvextMiddleware):
            mounts.append(stack)
        stack = stack.app
    return app, mounts


async def _chat(app: FastAPI, session: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEY}", "x-nvext-session-id": session, "content-type": "application/json"}
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.post("/v1/chat/completions", content=body, headers=headers)


async def _lifespan(app: FastAPI) -> list[str]:
    """The lifespan's start-up and shut-down, as uvicorn runs them: what the server hears."""
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[str] = []

    async def receive() -> MutableMapping[str, Any]:
        return messages.pop(0)

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message["type"])

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    return sent


async def test_both_mounts_of_one_process_capture_into_one_sink_with_one_writer(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    before = _writers()
    app, mounts = _both_mounts(url, monkeypatch)
    assert len(mounts) == 2, "the plugin and --middleware, each an NvextMiddleware"
    outer, inner = mounts
    assert outer.sink is not None and outer.sink is inner.sink, "one sink for the process"
    sink = outer.sink
    assert len(_writers() - before) == 1, "one writer thread for the process"
    closes = []
    close = sink.backend.close

    def counted_close() -> None:
        closes.append(1)
        close()

    sink.backend.close = counted_close  # type: ignore[method-assign]
    for session in ("run-a", "run-b", "run-a"):
        answer = await _chat(app, session)
        assert answer.status_code == 200, answer.text
    assert await _lifespan(app) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert sink.closed and closes == [1], "the queue written out and the store closed once, by either mount"
    assert sink.tally.recorded_turns == 3 and sink.tally.dropped_turns == {}, "each turn recorded once"
    reader = open_sink(url)
    try:
        assert [t["index"] for t in reader.read("run-a") or []] == [0, 1]
        assert [t["completion_token_ids"] for t in reader.read("run-b") or []] == [[4, 5]]
    finally:
        reader.close()


async def test_a_server_started_again_in_the_process_captures_into_a_sink_of_its_own(tmp_path, monkeypatch):
    """Once its server shut down, the process's capture is opened anew by the next server's mounts."""
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    first, (mount, _) = _both_mounts(url, monkeypatch)
    assert await _lifespan(first) == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
    assert mount.sink is not None and mount.sink.closed
    again, (outer, inner) = _both_mounts(url, monkeypatch)
    assert outer.sink is inner.sink and outer.sink is not mount.sink and outer.sink is not None
    assert (await _chat(again, "run-c")).status_code == 200
    assert outer.sink.flush() and [t["index"] for t in outer.sink.read("run-c") or []] == [0]
    outer.sink.close()

"""The capture's read API, `GET`/`DELETE /v1/nvext/sessions/{id}`, through the middleware in both mounts,
under vLLM's own key check (its `AuthenticationMiddleware`): no key, no read. The ATIF export is checked
against the schema of Harbor's ATIF v1.7 models (tests/fixtures/formats/)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from tests.support.capture import make_turn
from tests.unit.asgi import Upstream
from vllm_nvext import NvextMiddleware, Settings
from vllm_nvext.capture import store as store_module
from vllm_nvext.config import ConfigError
from vllm_nvext.middleware import sessions

KEY = "sk-capture"
SCHEMA = json.loads(
    (Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "atif-v1.7.schema.json").read_text()
)


def _mount(kind: str, url: str) -> Any:
    """`--middleware` (outside vLLM's key check) or the plugin (inside it), each over vLLM's own check."""
    vllm = Upstream(status=404, body=b'{"detail":"Not Found"}')
    if kind == "middleware":
        return NvextMiddleware(AuthenticationMiddleware(vllm, [KEY]), capture=url)
    return AuthenticationMiddleware(NvextMiddleware(vllm, capture=url), [KEY])


def _sink_of(app: Any) -> store_module.Sink:
    mw = app if isinstance(app, NvextMiddleware) else app.app
    assert mw.sink is not None
    return mw.sink


async def _call(app: Any, method: str, path: str, key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        return await client.request(method, path, headers=headers)


def call(app: Any, method: str, path: str, key: str | None = KEY) -> httpx.Response:
    return asyncio.run(_call(app, method, path, key))


@pytest.fixture(params=["middleware", "plugin"])
def app(request, store_url, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)  # what `vllm serve --api-key` gives the middleware's own check
    mounted = _mount(request.param, store_url)
    sink = _sink_of(mounted)
    sink.submit(make_turn("run-1", [1, 2, 3], [4, 5], usage={"prompt_tokens": 3, "completion_tokens": 2}))
    sink.submit(make_turn("run-1", [1, 2, 3, 4, 5, 6], [7], logprobs=[-0.25]))
    assert sink.flush()
    yield mounted
    sink.close()


def test_a_session_reads_as_json_with_the_key(app):
    answer = call(app, "GET", "/v1/nvext/sessions/run-1")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-length"] == str(len(answer.content))
    body = answer.json()
    assert body["session_id"] == "run-1" and body["next_index"] is None
    assert [t["index"] for t in body["turns"]] == [0, 1]
    assert [t["extends_previous"] for t in body["turns"]] == [None, True]
    assert body["turns"][1]["prompt_token_ids"] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_no_key_no_read_and_no_delete(app, key):
    for method in ("GET", "DELETE"):
        answer = call(app, method, "/v1/nvext/sessions/run-1", key=key)
        assert answer.status_code == 401, (method, answer.text)
        assert "prompt_token_ids" not in answer.text
    assert call(app, "GET", "/v1/nvext/sessions/run-1").status_code == 200  # nothing was deleted


def test_an_unknown_session_is_a_404_in_vllms_envelope(app):
    answer = call(app, "GET", "/v1/nvext/sessions/no-such-run")
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "NotFoundError"
    assert answer.json()["error"]["param"] == "session_id"


@pytest.mark.parametrize(
    ("path", "param"),
    [
        ("/v1/nvext/sessions/" + "a" * 257, "session_id"),
        ("/v1/nvext/sessions/..%2F..%2Fetc%2Fpasswd", "session_id"),
        ("/v1/nvext/sessions/a%20b", "session_id"),
        ("/v1/nvext/sessions/", "session_id"),
        ("/v1/nvext/sessions/run-1?format=xml", "format"),
        ("/v1/nvext/sessions/run-1?start=-1", "start"),
    ],
)
def test_bad_input_is_a_400_naming_the_parameter(app, path, param):
    answer = call(app, "GET", path)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_delete_removes_the_session(app):
    answer = call(app, "DELETE", "/v1/nvext/sessions/run-1")
    assert answer.status_code == 200 and answer.json() == {"session_id": "run-1", "deleted": True}
    assert call(app, "GET", "/v1/nvext/sessions/run-1").status_code == 404
    assert call(app, "DELETE", "/v1/nvext/sessions/run-1").status_code == 404


def test_another_method_is_refused(app):
    assert call(app, "PUT", "/v1/nvext/sessions/run-1").status_code == 405


def test_the_atif_export_is_a_valid_trajectory_with_the_ids(app):
    answer = call(app, "GET", "/v1/nvext/sessions/run-1?format=atif")
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    jsonschema.validate(doc, SCHEMA)
    assert doc["schema_version"] == "ATIF-v1.7" and doc["session_id"] == "run-1"
    steps = doc["steps"]
    assert [s["step_id"] for s in steps] == [1, 2]
    assert steps[0]["metrics"]["prompt_token_ids"] == [1, 2, 3]
    assert steps[0]["metrics"]["completion_token_ids"] == [4, 5]
    assert steps[0]["metrics"]["prompt_tokens"] == 3
    assert steps[1]["metrics"]["logprobs"] == [-0.25]
    assert steps[1]["extra"]["extends_previous"] is True
    assert doc["final_metrics"]["total_steps"] == 2


def test_the_schema_refuses_what_atif_refuses():
    """The vendored schema has teeth: a step without `source` is not a trajectory."""
    bad = {"schema_version": "ATIF-v1.7", "agent": {"name": "a", "version": "1"}, "steps": [{"step_id": 1}]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_a_session_larger_than_a_page_reads_in_pages(app, monkeypatch):
    sink = _sink_of(app)
    for n in range(4):
        sink.submit(make_turn("long", list(range(2000 + n))))
    assert sink.flush()
    monkeypatch.setattr(store_module, "READ_MAX_BYTES", 9000)  # about one turn a page
    from vllm_nvext.capture import api

    monkeypatch.setattr(api, "READ_MAX_BYTES", 9000)
    seen, start = [], 0
    while start is not None:
        page = call(app, "GET", f"/v1/nvext/sessions/long?start={start}").json()
        seen += [t["index"] for t in page["turns"]]
        start = page["next_index"]
    assert seen == [0, 1, 2, 3]


def _app_whose_store_is_gone(tmp_path: Any, monkeypatch: Any) -> NvextMiddleware:
    """A keyed app capturing into a SQLite file whose folder was removed after start-up (every read fails)."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    folder = tmp_path / "store"
    folder.mkdir()
    app = NvextMiddleware(Upstream(), capture=f"sqlite:///{folder / 'c.sqlite3'}")
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
    return app


def test_a_broken_store_is_a_503_without_its_error_or_path(tmp_path, monkeypatch):
    app = _app_whose_store_is_gone(tmp_path, monkeypatch)
    answer = call(app, "GET", "/v1/nvext/sessions/run-1")
    assert answer.status_code == 503
    assert str(tmp_path) not in answer.text and "Error" not in answer.json()["error"]["message"]
    assert app.sink is not None
    app.sink.close()


def test_without_capture_the_route_is_vllms(monkeypatch):
    upstream = Upstream(status=404, body=b'{"detail":"Not Found"}')
    app = NvextMiddleware(upstream)
    assert app.sink is None
    assert call(app, "GET", "/v1/nvext/sessions/run-1").status_code == 404
    assert upstream.calls == 1


def test_read_session_follows_the_pages(app, monkeypatch):
    """`vllm_nvext.client.read_session` over a real socket (uvicorn) in front of the mounted middleware."""
    import socket
    import threading

    import uvicorn

    from vllm_nvext.client import read_session

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def asgi3(scope: Any, receive: Any, send: Any) -> None:  # vLLM's check is not an `async def`
        await app(scope, receive, send)

    server = uvicorn.Server(uvicorn.Config(asgi3, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        session = read_session(f"http://127.0.0.1:{port}", "run-1", api_key=KEY)
        assert [t["index"] for t in session["turns"]] == [0, 1]
        atif = read_session(f"http://127.0.0.1:{port}", "run-1", api_key=KEY, format="atif")
        assert atif["schema_version"] == "ATIF-v1.7"
        import urllib.error

        with pytest.raises(urllib.error.HTTPError) as err:
            read_session(f"http://127.0.0.1:{port}", "run-1")
        assert err.value.code == 401
        err.value.close()
    finally:
        server.should_exit = True
        thread.join(10)


# --- who the read API is served to (docs/capture.md, Threat model) ---------------------------------------------
# Mounted as vLLM mounts each: the plugin (`attach_router`) inside vLLM's key check, `--middleware` outside it, on a
# FastAPI app whose `state.args` holds `--api-key` as vLLM's `build_app` sets it.


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelno, record.getMessage()))


@pytest.fixture
def said():
    """What the middleware logs, on its own logger and on vLLM's (inside vLLM's server)."""
    handler = _Lines()
    loggers = [logging.getLogger(name) for name in ("vllm_nvext", "vllm.nvext")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
    yield handler.lines
    for logger in loggers:
        logger.removeHandler(handler)


def _vllm_app(kind: str, url: str, key: str | None, monkeypatch: pytest.MonkeyPatch) -> Any:
    from types import SimpleNamespace

    from fastapi import FastAPI

    from vllm_nvext.plugin import NvextPlugin

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE", url)
    app = FastAPI()
    app.state.args = SimpleNamespace(api_key=[key] if key else None)
    if kind == "plugin":
        NvextPlugin().attach_router(app)  # before vLLM's own middleware: inside its key check
    if key:
        app.add_middleware(AuthenticationMiddleware, tokens=[key])
    if kind == "middleware":
        app.add_middleware(NvextMiddleware)  # `--middleware`: added last, outermost
    return app


async def _start_up(app: Any) -> None:
    """The lifespan's start-up and shut-down, as uvicorn runs them."""
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def _stored(url: str) -> store_module.Sink:
    sink = store_module.open_sink(url)
    sink.submit(make_turn("run-1", [1, 2, 3], [4, 5]))
    assert sink.flush()
    return sink


@pytest.mark.parametrize("kind", ["middleware", "plugin"])
def test_a_server_without_a_key_serves_no_read_api_and_says_so_at_start_up(kind, tmp_path, monkeypatch, said):
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    sink = _stored(url)
    app = _vllm_app(kind, url, None, monkeypatch)
    asyncio.run(_start_up(app))
    for method in ("GET", "DELETE"):
        answer = call(app, method, "/v1/nvext/sessions/run-1", key=None)
        assert answer.status_code == 404 and "prompt_token_ids" not in answer.text, (method, answer.text)
        assert answer.json() == {"detail": "Not Found"}, "vLLM's own: the route is not there"
    assert sink.read("run-1") is not None, "nothing was deleted"
    warnings = [m for level, m in said if level == logging.WARNING and "/v1/nvext/sessions" in m]
    assert warnings == [sessions.NOT_SERVED_KEYLESS], "said once at start-up"
    sink.close()


@pytest.mark.parametrize("kind", ["middleware", "plugin"])
def test_an_operator_opens_the_read_api_without_a_key_explicitly_and_is_warned(kind, tmp_path, monkeypatch, said):
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    sink = _stored(url)
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE_API", "open")
    app = _vllm_app(kind, url, None, monkeypatch)
    asyncio.run(_start_up(app))
    answer = call(app, "GET", "/v1/nvext/sessions/run-1", key=None)
    assert answer.status_code == 200 and answer.json()["turns"][0]["prompt_token_ids"] == [1, 2, 3]
    assert [m for level, m in said if level == logging.WARNING] == [sessions.SERVED_KEYLESS]
    sink.close()


@pytest.mark.parametrize("kind", ["middleware", "plugin"])
def test_with_a_key_the_read_api_is_served_behind_it_and_off_serves_it_to_no_one(kind, tmp_path, monkeypatch, said):
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    sink = _stored(url)
    keyed = _vllm_app(kind, url, KEY, monkeypatch)
    asyncio.run(_start_up(keyed))
    assert call(keyed, "GET", "/v1/nvext/sessions/run-1").status_code == 200
    assert call(keyed, "GET", "/v1/nvext/sessions/run-1", key=None).status_code == 401
    assert (logging.INFO, sessions.SERVED_KEYED) in said and not [m for lv, m in said if lv >= logging.WARNING]
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE_API", "off")  # export only: `vllm-nvext sessions export`
    off = _vllm_app(kind, url, KEY, monkeypatch)
    asyncio.run(_start_up(off))
    for method in ("GET", "DELETE"):
        answer = call(off, method, "/v1/nvext/sessions/run-1")
        assert answer.status_code in (404, 405) and "prompt_token_ids" not in answer.text, (method, answer.text)
    assert sink.read("run-1") is not None and (logging.INFO, sessions.OFF) in said
    sink.close()


def test_a_bad_capture_api_setting_stops_start_up_naming_it(monkeypatch):
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE_API", "public")
    with pytest.raises(ConfigError, match="VLLM_NVEXT_CAPTURE_API: expected one of keyed|open|off"):
        Settings.from_env()


# --- bad input and failures of the read API ---------------------------------------------------------------------


@pytest.mark.parametrize("start", ["²", "١٢", "１"])
def test_a_start_of_other_digits_than_0_to_9_is_a_400_naming_start(app, start):
    answer = call(app, "GET", f"/v1/nvext/sessions/run-1?start={start}")
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "start"


def test_a_503_of_the_read_api_is_logged_with_the_kind_of_failure(tmp_path, monkeypatch, caplog):
    app = _app_whose_store_is_gone(tmp_path, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="vllm_nvext.capture"):
        assert call(app, "GET", "/v1/nvext/sessions/run-1").status_code == 503
    (line,) = [r.getMessage() for r in caplog.records if "read API" in r.getMessage()]
    assert line == "vllm-nvext capture: the read API answered GET with a 503: the store failed (FileNotFoundError)"
    assert str(tmp_path) not in caplog.text, "never a path"
    assert app.sink is not None
    app.sink.close()


# --- what a read takes from the event loop ----------------------------------------------------------------------


async def _read_beside_a_ticker(app: Any, paths: list[str]) -> list[tuple[list[tuple[int, bytes]], Any]]:
    """Reads of `paths` at once, beside another client's work on the same loop (a ticker always ready to run): each
    read's body messages with the ticker's count when each was sent, and its headers."""
    ticks = 0
    running = True

    async def ticker() -> None:
        nonlocal ticks
        while running:
            ticks += 1
            await asyncio.sleep(0)

    async def read(path: str) -> tuple[list[tuple[int, bytes]], Any]:
        pieces: list[tuple[int, bytes]] = []
        start: dict[str, Any] = {}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message.get("body"):
                pieces.append((ticks, bytes(message["body"])))

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        path, _, query = path.partition("?")
        scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "query_string": query.encode(),
                 "headers": [(b"authorization", f"Bearer {KEY}".encode())]}  # fmt: skip
        await app(scope, receive, send)
        assert start["status"] == 200
        return pieces, dict(start["headers"])

    other = asyncio.ensure_future(ticker())
    try:
        return await asyncio.gather(*(read(p) for p in paths))
    finally:
        running = False
        await other


def test_large_reads_go_out_piece_by_piece_the_loop_serving_others_between_them(tmp_path, monkeypatch):
    """Four reads of a ~6 MB session at once (both formats): each goes out in pieces of at most a MiB, made one
    step at a time in the reads' thread, and another client's work on the loop runs between them; the bodies are
    the ones a whole read gives (the ATIF one byte for byte `atif.trajectory`'s)."""
    from vllm_nvext.capture import api
    from vllm_nvext.capture.atif import trajectory

    monkeypatch.setenv("VLLM_API_KEY", KEY)
    app = NvextMiddleware(Upstream(), capture=f"sqlite:///{tmp_path / 'c.sqlite3'}")
    sink = app.sink
    assert sink is not None
    for n in range(3):
        sink.submit(make_turn("big", list(range(n, 300_000 + n)), [7] * 1000, logprobs=[-0.5] * 1000))
    assert sink.flush()
    turns = sink.read("big")
    assert turns is not None
    atif_body = json.dumps(trajectory("big", turns), separators=(",", ":")).encode()
    paths = ["/v1/nvext/sessions/big", "/v1/nvext/sessions/big?format=atif"] * 2
    for (pieces, headers), path in zip(asyncio.run(_read_beside_a_ticker(app, paths)), paths, strict=True):
        body = b"".join(p for _, p in pieces)
        if path.endswith("atif"):
            assert body == atif_body
        else:
            assert json.loads(body) == {"session_id": "big", "turns": turns, "next_index": None}
            assert headers[b"content-length"] == str(len(body)).encode()
        assert max(len(p) for _, p in pieces) <= api.READ_PIECE_BYTES and len(body) > 5 * api.READ_PIECE_BYTES
        sent_at = [t for t, _ in pieces]
        assert len(set(sent_at)) >= 3, f"{path}: the other client's work ran between the pieces: {sent_at}"
    sink.close()


def test_a_page_past_a_sessions_end_is_empty_in_json_and_a_404_naming_start_in_atif(app):
    """`?start=` past the last turn of a session the store holds: JSON answers the empty page; ATIF, whose trajectory
    holds one step at least, answers 404 naming `start`, never "session not found" for a session that is there."""
    page = call(app, "GET", "/v1/nvext/sessions/run-1?start=7")
    assert page.status_code == 200 and page.json() == {"session_id": "run-1", "turns": [], "next_index": None}
    atif = call(app, "GET", "/v1/nvext/sessions/run-1?start=7&format=atif")
    assert atif.status_code == 404 and atif.json()["error"]["param"] == "start", atif.text
    assert "not found" not in atif.json()["error"]["message"] and "start" in atif.json()["error"]["message"]
    missing = call(app, "GET", "/v1/nvext/sessions/no-such?format=atif")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "session_id"

"""The capture's read API, `GET`/`DELETE /v1/nvext/sessions/{id}`, through the middleware in both mounts,
under vLLM's own key check (its `AuthenticationMiddleware`): no key, no read. The ATIF export is checked
against the schema of Harbor's ATIF models (tests/fixtures/atif/)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from tests.support.capture import make_turn
from tests.unit.asgi import Upstream
from vllm_nvext import NvextMiddleware
from vllm_nvext.capture import store as store_module

KEY = "sk-capture"
SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "atif" / "trajectory.schema.json").read_text())


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
    assert doc["schema_version"] == "ATIF-v1.4" and doc["session_id"] == "run-1"
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
    bad = {"schema_version": "ATIF-v1.4", "agent": {"name": "a", "version": "1"}, "steps": [{"step_id": 1}]}
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


def test_a_broken_store_is_a_503_without_its_error_or_path(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    folder = tmp_path / "store"
    folder.mkdir()
    app = NvextMiddleware(Upstream(), capture=f"sqlite:///{folder / 'c.sqlite3'}")
    for p in folder.iterdir():
        p.unlink()
    folder.rmdir()
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
        assert atif["schema_version"] == "ATIF-v1.4"
        import urllib.error

        with pytest.raises(urllib.error.HTTPError) as err:
            read_session(f"http://127.0.0.1:{port}", "run-1")
        assert err.value.code == 401
        err.value.close()
    finally:
        server.should_exit = True
        thread.join(10)

"""`_vllm_compat.auth_refuses` against vLLM's own `AuthenticationMiddleware` (the installed 0.32).

The middleware, mounted outside vLLM's key check, answers nothing itself for a request that check
refuses: so its replica must refuse exactly what vLLM refuses, on every translated route
(docs/protocol.md §9, §10).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from tests.helpers import COMPLETIONS
from tests.unit.asgi import Upstream, call
from vllm_nvext import NvextMiddleware, _vllm_compat
from vllm_nvext.protocol import ENDPOINT_PATHS

KEY = "sk-right"
AUTHORIZATIONS = {
    "no key": None,
    "right key": f"Bearer {KEY}",
    "lower-case scheme": f"bearer {KEY}",
    "wrong key": "Bearer sk-wrong",
    "wrong scheme": f"Basic {KEY}",
    "scheme only": "Bearer",
    "empty": "",
}
# Every translated route, and routes outside it either side of vLLM's guarded prefixes.
PATHS = [*ENDPOINT_PATHS, "/v1/models", "/health", "/detokenize", "/v2/x", "/inference/v1/generate", "/cohere/x"]


def _scope(path: str, method: str, authorization: str | None, root_path: str, app: Any) -> dict[str, Any]:
    headers = [(b"content-type", b"application/json")]
    if authorization is not None:
        headers.append((b"authorization", authorization.encode("latin-1")))
    return {
        "type": "http",
        "method": method,
        "path": root_path + path,
        "root_path": root_path,
        "headers": headers,
        "app": app,
    }


def _vllm_refuses(scope: dict[str, Any], tokens: list[str]) -> bool:
    """What vLLM's own key check answers: True for its 401."""
    statuses: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        statuses.append(200)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    asyncio.run(AuthenticationMiddleware(app, tokens)(scope, receive, send))  # type: ignore[arg-type]
    return statuses == [401]


@pytest.mark.parametrize("root_path", ["", "/proxy"])
@pytest.mark.parametrize("method", ["POST", "OPTIONS"])
@pytest.mark.parametrize("path", PATHS)
def test_the_key_check_refuses_exactly_what_vllms_refuses(path, method, root_path):
    app = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=[KEY, "sk-other"])))
    for name, authorization in AUTHORIZATIONS.items():
        scope = _scope(path, method, authorization, root_path, app)
        ours = _vllm_compat.auth_refuses(scope)
        assert ours == _vllm_refuses(scope, [KEY, "sk-other"]), (path, method, root_path, name)
        if path == "/invocations" or method == "OPTIONS":
            assert not ours, "vLLM guards neither /invocations nor OPTIONS"


def _no_api_key() -> SimpleNamespace:
    """A server started without `--api-key` (vLLM reads VLLM_API_KEY as it builds its app)."""
    return SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=None)))


def test_the_key_comes_from_vllm_api_key_when_the_server_has_no_api_key(monkeypatch):
    for path, name in itertools.product(ENDPOINT_PATHS, AUTHORIZATIONS):
        monkeypatch.delenv("VLLM_API_KEY", raising=False)
        scope = _scope(path, "POST", AUTHORIZATIONS[name], "", _no_api_key())
        assert not _vllm_compat.auth_refuses(scope), "no key configured: nothing is refused"
        monkeypatch.setenv("VLLM_API_KEY", KEY)
        scope = _scope(path, "POST", AUTHORIZATIONS[name], "", _no_api_key())
        assert _vllm_compat.auth_refuses(scope) == _vllm_refuses(scope, [KEY]), (path, name)
    # --api-key wins over VLLM_API_KEY, as in vLLM.
    with_args = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=["sk-cli"])))
    assert _vllm_compat.auth_refuses(_scope(COMPLETIONS, "POST", f"Bearer {KEY}", "", with_args))
    assert not _vllm_compat.auth_refuses(_scope(COMPLETIONS, "POST", "Bearer sk-cli", "", with_args))


def test_the_guarded_prefixes_are_read_from_the_installed_vllm(vllm_at, tmp_path):
    import vllm.entrypoints.serve.middleware.authenticate as theirs

    assert _vllm_compat.guarded_prefixes() == theirs.GUARDED_PREFIX == _vllm_compat.GUARDED_PREFIX
    root = tmp_path / "vllm"
    rule = root / "entrypoints/serve/middleware/authenticate.py"
    rule.parent.mkdir(parents=True)
    rule.write_text('GUARDED_PREFIX = ("/v9",)\n')
    vllm_at(root)
    assert _vllm_compat.guarded_prefixes() == ("/v9",), "a vLLM with another rule is followed"
    for unreadable in ("GUARDED_PREFIX = (1, 2)\n", "GUARDED_PREFIX = (f(),)\n", "x = (", ""):
        rule.write_text(unreadable)
        vllm_at(root)
        assert _vllm_compat.guarded_prefixes() == _vllm_compat.GUARDED_PREFIX, "else the pinned copy"
    vllm_at(None)
    assert _vllm_compat.guarded_prefixes() == _vllm_compat.GUARDED_PREFIX, "without vLLM: the pinned copy"


@pytest.mark.parametrize("path", sorted(ENDPOINT_PATHS))
@pytest.mark.parametrize(
    "body",
    [
        {"model": "tiny", "prompt": "x", "nvext": {"extra_fields": "garbage"}},
        {"model": "tiny", "prompt": [5], "echo": True, "nvext": {"extra_fields": ["completion_token_ids"]}},
        {"model": {"a": 1}, "prompt": [5], "echo": True, "nvext": {"extra_fields": ["completion_token_ids"]}},
    ],
    ids=["invalid nvext", "echoed id prompt", "dict model"],
)
def test_a_request_vllm_refuses_reaches_it_untouched_and_a_keyless_invocations_is_translated(path, body):
    """Outermost, a refused request goes to vLLM as sent (its 401); /invocations is not guarded."""
    raw = json.dumps(body).encode()
    upstream = Upstream(body=b'{"error": "Unauthorized"}', status=401)
    app = NvextMiddleware(upstream)
    scope_app = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=[KEY])))
    headers = ((b"content-type", b"application/json"),)
    result = asyncio.run(call(app, path, raw, headers=headers, app_state=scope_app))
    if path == "/invocations":
        if "garbage" in raw.decode():
            assert result.status == 400 and json.loads(result.body)["error"]["param"] == "nvext.extra_fields"
            assert upstream.calls == 0, "the same 400 as with a key: one route, one rule"
        return
    assert result.status == 401 and upstream.calls == 1 and upstream.received == raw, "vLLM got the client's bytes"
    assert upstream.received_scope is not None and upstream.received_scope["path"] == path


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"model": "tiny", "input": "x", "nvext": {"extra_fields": "garbage"}}),
        ("/v1/responses", {"model": "tiny", "input": "x", "return_token_ids": True}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [], "nvext": {"extra_fields": "garbage"}}),
        ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [], "return_token_ids": True}),
    ],
)
def test_a_keyless_agent_route_request_reaches_vllm_untouched(path, body):
    """/v1/responses and /v1/messages are under /v1: outermost, a keyless request gets vLLM's 401, not our 400."""
    raw = json.dumps(body).encode()
    upstream = Upstream(body=b'{"error": "Unauthorized"}', status=401)
    scope_app = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=[KEY])))
    headers = ((b"content-type", b"application/json"),)
    result = asyncio.run(call(NvextMiddleware(upstream), path, raw, headers=headers, app_state=scope_app))
    assert result.status == 401 and upstream.calls == 1 and upstream.received == raw, "vLLM got the client's bytes"


def test_a_servers_keys_are_read_once_as_vllm_reads_them(monkeypatch):
    """vLLM builds its check with the keys of its start (VLLM_API_KEY included); so does the replica."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    server = _no_api_key()
    refused = _scope(COMPLETIONS, "POST", "Bearer sk-later", "", server)
    assert _vllm_compat.auth_refuses(refused)
    monkeypatch.setenv("VLLM_API_KEY", "sk-later")  # after the start: vLLM's check still wants KEY
    assert _vllm_compat.auth_refuses(refused) == _vllm_refuses(refused, [KEY]) is True
    assert not _vllm_compat.auth_refuses(_scope(COMPLETIONS, "POST", f"Bearer {KEY}", "", server))
    restarted = _no_api_key()  # a new server (new args) reads the environment again
    assert not _vllm_compat.auth_refuses(_scope(COMPLETIONS, "POST", "Bearer sk-later", "", restarted))
    # Without a server (no `app.state.args`), the environment as it reads now.
    assert not _vllm_compat.auth_refuses(_scope(COMPLETIONS, "POST", "Bearer sk-later", "", None))
    monkeypatch.delenv("VLLM_API_KEY")
    assert not _vllm_compat.auth_refuses(_scope(COMPLETIONS, "POST", "Bearer nothing", "", None))

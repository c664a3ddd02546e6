"""Capture that can be trusted with the prompts (docs/capture.md, Threat model): the read API of the real
`vllm-nvext proxy` command without a key, the Redis store's password kept off the command line (a real
redis-server that requires it), and a body key that never merges two clients' sessions unless the operator says so."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from tests.support.capture import make_turn
from tests.support.redis_server import redis_server
from tests.unit.asgi import Upstream, call
from tests.unit.test_capture_edges import _unary
from tests.unit.test_proxy import _keyed_upstream
from vllm_nvext import NvextMiddleware
from vllm_nvext.capture.store import open_sink
from vllm_nvext.middleware import sessions
from vllm_nvext.tools import cli
from vllm_nvext.tools.server import ProxyServer
from vllm_nvext.tools.sessions import PASSWORD_IN_ARGV

ROOT = Path(__file__).resolve().parents[2]
JSON = (b"content-type", b"application/json")
PASSWORD = "s3cret-capture-pw"


@pytest.fixture
def keyed_upstream() -> Iterator[str]:
    """vLLM with `--api-key k` (401 without it), served over HTTP on a free port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_keyed_upstream, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off"))  # fmt: skip
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def _get(url: str, key: str | None = None) -> httpx.Response:
    """GET through a proxy that may still be starting (connection refused until it listens)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return httpx.get(url, headers={"authorization": f"Bearer {key}"} if key else {}, timeout=10)
        except httpx.TransportError:
            assert time.monotonic() < deadline, "the proxy did not start"
            time.sleep(0.1)


def test_a_keyless_capturing_proxy_serves_no_read_api_unless_opened_and_says_so(tmp_path, keyed_upstream):
    """The docs' `vllm-nvext proxy --upstream U --capture URL`, without --api-key, in front of a keyed vLLM: nobody
    reads a session through it (the request goes on to the upstream, which refuses it or knows no such route), and
    its start-up says so; `--capture-api open` serves it to anyone, and says that."""
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    sink = open_sink(url)
    sink.submit(make_turn("run-1", [1, 2, 3], [4]))
    assert sink.flush()
    sink.close()
    path = "/v1/nvext/sessions/run-1"
    with ProxyServer(upstream=keyed_upstream, args=("--capture", url), name="keyless-capture") as proxy:
        keyless, keyed = _get(proxy.url + path), _get(proxy.url + path, "k")
        assert (keyless.status_code, keyless.json()) == (401, {"error": "Unauthorized"}), "the upstream's refusal"
        assert (keyed.status_code, keyed.content) == (200, b"{}"), "the upstream's own answer, never the turns"
        deleted = httpx.delete(proxy.url + path, timeout=10)
        assert deleted.status_code == 401 and "prompt_token_ids" not in deleted.text
        assert sessions.NOT_SERVED_KEYLESS in proxy.log_text()
    with ProxyServer(upstream=keyed_upstream, args=("--capture", url, "--capture-api", "open"), name="open") as proxy:
        opened = _get(proxy.url + path)
        assert opened.status_code == 200 and opened.json()["turns"][0]["prompt_token_ids"] == [1, 2, 3]
        assert sessions.SERVED_KEYLESS in proxy.log_text()


def test_the_redis_password_comes_from_a_variable_or_a_file_never_the_command_line(tmp_path, monkeypatch, capsys):
    with redis_server(PASSWORD) as with_password:
        bare = with_password.replace(f":{PASSWORD}@", "")
        assert PASSWORD not in bare
        password_file = tmp_path / "capture-password"
        password_file.write_text(PASSWORD + "\n")
        for name, value in (("VLLM_NVEXT_CAPTURE_PASSWORD", PASSWORD), ("VLLM_NVEXT_CAPTURE_PASSWORD_FILE", "")):
            monkeypatch.delenv("VLLM_NVEXT_CAPTURE_PASSWORD", raising=False)
            monkeypatch.setenv(name, value or str(password_file))
            sink = open_sink(bare)
            sink.submit(make_turn(f"pw-{name[-4:].lower()}", [1, 2], [3]))
            assert sink.flush()
            assert sink.tally.recorded_turns == 1 and sink.tally.dropped_turns == {}, name
            sink.close()
        # The command, in a process of its own: the password in a file, the command line without it.
        env = {"VLLM_NVEXT_CAPTURE_PASSWORD_FILE": str(password_file)}
        command = [sys.executable, "-m", "vllm_nvext.tools.cli", "sessions", "export", "--store", bare]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env={**_environ_without_password(), **env})  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert sorted(json.loads(line)["session_id"] for line in done.stdout.splitlines()) == ["pw-file", "pw-word"]
        assert PASSWORD not in " ".join(command) and "warning" not in done.stderr
        # A password written on the command line still works, and is warned about.
        monkeypatch.delenv("VLLM_NVEXT_CAPTURE_PASSWORD_FILE")
        assert cli.main(["sessions", "export", "--store", with_password, "--output", str(tmp_path / "o")]) == 0
        err = capsys.readouterr().err
        assert f"vllm-nvext sessions: warning: {PASSWORD_IN_ARGV}" in err and PASSWORD not in err


def _environ_without_password() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("VLLM_NVEXT_CAPTURE_PASSWORD")}


def test_a_password_variable_and_file_both_set_or_a_file_unreadable_stop_start_up(tmp_path, monkeypatch):
    from vllm_nvext.config import ConfigError, capture_password

    with pytest.raises(ConfigError, match="set one, not both"):
        capture_password({"VLLM_NVEXT_CAPTURE_PASSWORD": "a", "VLLM_NVEXT_CAPTURE_PASSWORD_FILE": "/x"})
    missing = str(tmp_path / "no-such-file")
    with pytest.raises(ConfigError, match="the file cannot be read") as raised:
        capture_password({"VLLM_NVEXT_CAPTURE_PASSWORD_FILE": missing})
    assert missing not in str(raised.value), "never the path"


# --- a body key (docs/capture.md, Session keys) ----------------------------------------------------------------


def _two_clients(url: str, body_keys: bool | None) -> None:
    """Two clients of one app, each its own conversation, both sending the app's constant `prompt_cache_key`."""
    request = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "prompt_cache_key": "my-app"}).encode()  # fmt: skip
    for answer_id in ("chatcmpl-a", "chatcmpl-b"):
        app = NvextMiddleware(Upstream(body=_unary(answer_id)), capture=url, capture_body_keys=body_keys)
        result = asyncio.run(call(app, "/v1/chat/completions", request, headers=(JSON,)))
        assert result.status == 200
        assert app.sink is not None and app.sink.flush()
        app.sink.close()


def _sessions(url: str) -> dict[str, list[Any]]:
    sink = open_sink(url)
    try:
        return {sid: [t["session_source"] for t in sink.read(sid) or []] for sid in sink.backend.sessions(None)}
    finally:
        sink.close()


def test_a_body_key_never_merges_two_clients_sessions_unless_the_operator_lets_body_keys_name_them(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    _two_clients(url, None)
    assert _sessions(url) == {"chatcmpl-a": ["request_id"], "chatcmpl-b": ["request_id"]}, "a session each"
    opted = f"sqlite:///{tmp_path / 'opted.sqlite3'}"
    _two_clients(opted, True)  # VLLM_NVEXT_CAPTURE_BODY_KEYS=1: the operator's clients each send a key of their own
    assert _sessions(opted) == {"my-app": ["prompt_cache_key", "prompt_cache_key"]}, "each turn says which key"

"""Hostile request ids against the real hidden-states connector (conftest's `hs` server).

vLLM takes the request id from the client's `X-Request-Id` header and the connector names its
files after it. Whatever the header holds, every capture lands in `shared_storage_path` under a
bounded, sanitized name, nothing is created anywhere else, and the server stays up.
The requests go through `http.client`, which sends any byte but CR and LF as is (httpx refuses
control characters before they reach the server); the server's HTTP parser lets HTAB and bytes
0x80-0xff through to vLLM and answers 400 to the other control characters.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import API_KEY, CHAT, COMPLETIONS, MODEL_NAME
from vllm_nvext import hidden_states
from vllm_nvext.client import extract
from vllm_nvext.hidden_states import HiddenStatesError

pytestmark = pytest.mark.e2e

MARK = "hostile" + uuid.uuid4().hex[:8]  # in every hostile id: its trace anywhere is findable
PROMPT = [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]
# `<sanitized prefix, at most 64>-<32 hex>.safetensors`, and the writer's `.lock` next to it.
STORED_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}-[0-9a-f]{32}\.safetensors(\.lock)?")


def _key() -> str:
    return os.environ.get("VLLM_NVEXT_HS_API_KEY") or API_KEY


def _post(url: str, path: str, body: dict[str, Any], request_id: bytes | None) -> tuple[int, Any]:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None, url
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=300)
    try:
        conn.putrequest("POST", path)
        payload = json.dumps(body).encode()
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(payload)))
        conn.putheader("Authorization", f"Bearer {_key()}")
        if request_id is not None:
            conn.putheader("X-Request-Id", request_id)
        conn.endheaders(payload)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, data.decode("latin-1")


def _completion(url: str, prompt: list[int], request_id: bytes | None = None, **extra: Any) -> tuple[int, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    return _post(url, COMPLETIONS, {**body, **extra}, request_id)


def _health(url: str) -> int:
    parts = urllib.parse.urlsplit(url)
    assert parts.hostname is not None, url
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status
    finally:
        conn.close()


def _captured(status: int, body: Any, prompt: list[int]) -> str:
    """The path of a capture that verifies (the loader checks the tensors and the ids)."""
    assert status == 200, f"HTTP {status}: {str(body)[:500]}"
    ids = extract(body)
    assert ids.prompt_token_ids == prompt
    path = (ids.kv_transfer_params or {}).get("hidden_states_path")
    assert path, f"no hidden_states_path in {ids.kv_transfer_params}"
    loaded = hidden_states.load(path, expect_token_ids=prompt, timeout=60.0)
    assert loaded.num_tokens == len(prompt)
    return path


@pytest.fixture(scope="module")
def storage(hs_server) -> Path:
    """The connector's `shared_storage_path`, read off a normal capture."""
    return Path(os.path.dirname(_captured(*_completion(hs_server.url, PROMPT), PROMPT)))


@pytest.fixture(scope="module")
def sentinel() -> Iterator[Path]:
    """A directory the hostile ids aim at; it must stay empty (and is left for a look if not)."""
    path = Path(tempfile.mkdtemp(prefix=f"{MARK}-"))
    yield path
    with contextlib.suppress(OSError):
        path.rmdir()


def _hostile_ids(sentinel: Path) -> dict[str, bytes]:
    up = "/.." * 16  # more than enough to climb from the storage directory to /
    return {
        "long-300": b"L" * 300 + MARK.encode(),
        "long-4000": b"x" * 4000 + MARK.encode(),
        "absolute": f"{up}{sentinel}/x{MARK}".encode(),
        "new-directory": f"{up}{sentinel}/sub/x{MARK}".encode(),
        "relative": ("../" * 16 + str(sentinel).lstrip("/") + f"/x{MARK}").encode(),
        "root": f"{up}/x{MARK}".encode(),
        "through-a-non-directory": f"{up}/dev/null/x{MARK}".encode(),
        "non-ascii": f"ä漢字-é-{MARK}".encode(),
        "empty": b"",
        "dot": b".",
        "dotdot": b"..",
        "tab-and-obs-text": b"a\tb\x85c\xffd" + MARK.encode(),
        "slashes": f"a/b/c/{MARK}".encode(),
    }


def test_other_control_characters_are_refused_by_the_http_server(hs_server):
    """The HTTP parser answers 400 before vLLM sees the request (HTAB is the one it lets through)."""
    for request_id in (b"a\x01b", b"a\x1bb", b"a\x7fb", b"a\x08" + MARK.encode()):
        status, body = _completion(hs_server.url, PROMPT, request_id)
        assert (status, body) == (400, "Invalid HTTP request received."), request_id
        assert _health(hs_server.url) == 200


def _traces(top: Path, depth: int) -> list[str]:
    """Paths under `top` (at most `depth` levels) whose name holds MARK."""
    found = []
    for root, dirs, files in os.walk(top):
        level = len(Path(root).relative_to(top).parts)
        found += [os.path.join(root, n) for n in dirs + files if MARK in n]
        if level >= depth:
            dirs[:] = []
    return found


def test_hostile_request_ids_are_captured_inside_the_storage_directory(hs_server, storage, sentinel):
    for name, request_id in _hostile_ids(sentinel).items():
        status, body = _completion(hs_server.url, PROMPT, request_id)
        assert _health(hs_server.url) == 200, f"X-Request-Id {name!r} took the server down"
        assert status == 200, (name, status, body)
        path = _captured(status, body, PROMPT)
        assert os.path.dirname(os.path.realpath(path)) == os.path.realpath(storage), (name, path)
        assert STORED_NAME.fullmatch(os.path.basename(path)), (name, path)
    assert list(sentinel.iterdir()) == [], "a file was written where a hostile id pointed"
    outside = [
        p for p in _traces(Path(tempfile.gettempdir()), 4) if p != str(sentinel) and not p.startswith(f"{storage}/")
    ]
    assert outside == [], "files or directories were created outside the storage directory"
    assert [n for n in os.listdir("/") if MARK in n] == []
    assert not os.path.exists(f"{sentinel}/sub")


def test_storage_directory_holds_only_bounded_names(hs_server, storage, sentinel):
    # After the hostile ids above (pytest runs a file's tests in order), as after any request.
    _captured(*_completion(hs_server.url, PROMPT, f"{MARK}/../../x".encode()), PROMPT)
    entries = sorted(os.listdir(storage))
    assert entries and all(STORED_NAME.fullmatch(n) for n in entries), [
        n for n in entries if not STORED_NAME.fullmatch(n)
    ]
    assert all((storage / n).is_file() for n in entries), "no subdirectory is created"


def test_identical_request_ids_sent_at_once_keep_distinct_files(hs_server):
    prompts = [[49 + i, 50, 51, 52 + i] for i in range(6)]
    request_id = f"same-{MARK}".encode()
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: _completion(hs_server.url, p, request_id), prompts))
    # Each file holds its own request's ids: the loader checks them against that request's prompt.
    paths = [_captured(status, body, prompt) for (status, body), prompt in zip(answers, prompts, strict=True)]
    assert len(set(paths)) == len(prompts)


def test_a_client_chosen_path_is_ignored_without_allow_custom_save_path(hs_server, storage, sentinel):
    target = f"{sentinel}/chosen-{MARK}.safetensors"
    status, body = _completion(hs_server.url, PROMPT, kv_transfer_params={"hidden_states_path": target})
    path = _captured(status, body, PROMPT)
    assert os.path.dirname(path) == str(storage) and path != target
    assert not os.path.exists(target)


def test_the_server_still_serves_chat_captures_afterwards(hs_server):
    assert _health(hs_server.url) == 200
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
    status, answer = _post(hs_server.url, CHAT, {**body, "return_token_ids": True}, None)
    assert status == 200, answer
    ids = extract(answer)
    assert ids.prompt_token_ids
    path = ids.kv_transfer_params["hidden_states_path"]
    assert hidden_states.load(path, expect_token_ids=ids.prompt_token_ids, timeout=60.0).num_tokens == len(
        ids.prompt_token_ids
    )


def test_a_capture_that_cannot_be_written_fails_alone(hs_server, storage):
    """A storage directory gone (here: a file in its place) fails the capture, not the server."""
    moved = storage.with_name(storage.name + ".moved")
    storage.rename(moved)
    storage.write_bytes(b"not a directory")
    try:
        status, body = _completion(hs_server.url, PROMPT, f"broken-{MARK}".encode())
        alive = _health(hs_server.url)
    finally:
        storage.unlink()
        moved.rename(storage)
    assert status == 200, body
    assert alive == 200
    path = extract(body).kv_transfer_params["hidden_states_path"]
    with pytest.raises(HiddenStatesError, match="not found.*Hidden-states capture failed"):
        hidden_states.load(path, timeout=60.0)
    log = getattr(hs_server, "log_path", None)  # a local server's log (not one named by VLLM_NVEXT_HS_URL)
    if log is not None:
        assert f"Hidden-states capture failed (lock not created) for req_id='cmpl-broken-{MARK}" in log.read_text()
    _captured(*_completion(hs_server.url, PROMPT), PROMPT)  # the next capture works


# --- `allow_custom_save_path` (conftest's `hs_custom`): a client-chosen path, confined ---------------


@pytest.fixture(scope="module")
def custom_storage(hs_custom_server) -> Path:
    return Path(os.path.dirname(_captured(*_completion(hs_custom_server.url, PROMPT), PROMPT)))


def _chosen(url: str, path: Any, request_id: bytes | None = None) -> tuple[int, Any]:
    return _completion(url, PROMPT, request_id, kv_transfer_params={"hidden_states_path": path})


@pytest.mark.parametrize(
    "chosen",
    ["mine.safetensors", f"sub/{MARK}/mine.safetensors", "sub/../again.safetensors"],
)
def test_a_client_chosen_path_inside_the_storage_directory_is_used(hs_custom_server, custom_storage, chosen):
    path = _captured(*_chosen(hs_custom_server.url, chosen), PROMPT)
    assert path == os.path.normpath(os.path.join(custom_storage, chosen))


def test_a_client_chosen_absolute_path_inside_the_storage_directory_is_used(hs_custom_server, custom_storage):
    absolute = str(custom_storage / f"absolute-{MARK}.safetensors")
    assert _captured(*_chosen(hs_custom_server.url, absolute), PROMPT) == absolute


def _refusals(sentinel: Path, storage: Path) -> dict[str, Any]:
    return {
        "absolute-outside": f"{sentinel}/x{MARK}.safetensors",
        "climbing": f"../../../../../../../..{sentinel}/x{MARK}.safetensors",
        "climbing-from-inside": f"sub/../../{storage.name}-{MARK}.safetensors",
        "new-directory-outside": f"{sentinel}/sub/x{MARK}.safetensors",
        "through-a-non-directory": f"/dev/null/x{MARK}",
        "the-directory-itself": ".",
        "empty": "",
        "too-long": "n" * 300,
        "not-a-string": 7,
        "a-list": ["x"],
    }


def test_a_client_chosen_path_outside_is_refused_with_a_clear_error(
    hs_custom_server, custom_storage, storage, sentinel
):
    for name, chosen in _refusals(sentinel, custom_storage).items():
        status, body = _chosen(hs_custom_server.url, chosen)
        assert status == 200, (name, body)
        ids = extract(body)
        assert ids.prompt_token_ids == PROMPT, "the completion itself is served"
        assert list(ids.kv_transfer_params) == ["hidden_states_error"], (name, ids.kv_transfer_params)
        assert ids.kv_transfer_params["hidden_states_error"].startswith("no hidden states captured: "), name
        assert _health(hs_custom_server.url) == 200, name
    assert list(sentinel.iterdir()) == []
    assert not os.path.exists(f"{custom_storage}-{MARK}.safetensors")
    inside = (f"{custom_storage}/", f"{storage}/")
    outside = [p for p in _traces(Path(tempfile.gettempdir()), 4) if p != str(sentinel) and not p.startswith(inside)]
    assert outside == [], "files or directories were created outside the storage directories"
    _captured(*_completion(hs_custom_server.url, PROMPT, f"/../../x{MARK}".encode()), PROMPT)


# --- vLLM's own connector: request ids that are not plain names never reach it --------------


@pytest.mark.e2e_connector
@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"X-Request-Id": "/../../target/" + MARK}, {}, "x-request-id"),
        ({"X-Request-Id": "a" * 129}, {}, "x-request-id"),
        ({}, {"request_id": "..\\" + MARK}, "request_id"),
    ],
)
def test_vllms_connector_gets_no_request_id_that_is_not_a_plain_name(hs_vllm_server, headers, body, param):
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, **body}
    keyless = httpx.post(f"{hs_vllm_server.url}/v1/completions", json=request, headers=headers, timeout=60)
    assert keyless.status_code == 401, "vLLM's key check comes first"
    got = httpx.post(
        f"{hs_vllm_server.url}/v1/completions",
        json=request,
        headers={**headers, "Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert got.status_code == 400 and got.json()["error"]["param"] == param, got.text
    assert MARK not in got.text, "the error never repeats the id"
    assert not [p for p in _traces(Path(tempfile.gettempdir()), 4) if MARK in p], "nothing was written"

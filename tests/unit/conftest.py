"""Fixtures several unit modules share: each replaces one private seam of the package, in one place."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_nvext import _json, _vllm_compat


@pytest.fixture(autouse=True)
def _no_nvext_settings_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unit test starts from the documented defaults: a VLLM_NVEXT_* variable set in the shell
    that runs the suite (VLLM_NVEXT_PURE_PYTHON=1 while trying the pure-Python path) changes no test's
    settings. Tests that read a variable set it themselves. VLLM_NVEXT_REQUIRE_EXTENSION is the suite's
    own switch (the compiled tests must not skip), not a setting."""
    import os

    for name in list(os.environ):
        if name.startswith("VLLM_NVEXT_") and name != "VLLM_NVEXT_REQUIRE_EXTENSION":
            monkeypatch.delenv(name)


def _forget_vllm() -> None:
    """Drop every answer _vllm_compat cached about the installed vLLM (its root, the probes, the key rule)."""
    for value in vars(_vllm_compat).values():
        clear = getattr(value, "cache_clear", None)
        if callable(clear):
            clear()


@pytest.fixture
def vllm_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path | None], None]]:
    """Point what _vllm_compat reads from vLLM's source at another vllm package directory (or None:
    vLLM not installed); the installed vLLM's answers come back after the test."""

    def point(root: Path | None) -> None:
        _forget_vllm()
        monkeypatch.setattr(_vllm_compat, "_vllm_root", lambda: root)

    yield point
    monkeypatch.undo()
    _forget_vllm()


@pytest.fixture
def json_decodes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every document decoded through vllm_nvext._json.loads during the test (how the stream path
    decodes an event), in order."""
    decoded: list[bytes] = []
    real = _json.loads

    def recording(data: bytes) -> Any:
        decoded.append(bytes(data))
        return real(data)

    monkeypatch.setattr(_json, "loads", recording)
    return decoded


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free port of 127.0.0.1 for the session (tests/support/redis_server.py)."""
    from tests.support.redis_server import redis_server

    with redis_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh capture store of each kind: a SQLite file in the test's folder, or the Redis server emptied."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'capture.sqlite3'}"
    url: str = request.getfixturevalue("redis_url")
    import redis

    redis.Redis.from_url(url).flushdb()
    return url

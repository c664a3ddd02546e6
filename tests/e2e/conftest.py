"""The e2e fixtures: each kind's `<name>_server` (tests/support/servers.py registers them), the HTTP
clients on them, `translated` (every mount of vllm-nvext) and `vllm_version` (the version under
test), and the hooks that start only the servers the selected tests use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import http_client
from tests.support.servers import *  # noqa: F403  (every kind's `<name>_server` fixture)
from tests.support.servers import VERSION_KINDS, VERSION_ROLES, Server, _boot, _kinds, _lock, stop_all


def pytest_itemcollected(item: pytest.Item) -> None:
    names = getattr(item, "fixturenames", ())  # every fixture the test uses, through others too
    if "vllm_version" in names or any(f"{n}_server" in names for n, kind in _kinds.items() if kind.reference):
        item.add_marker(pytest.mark.reference)


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: only the servers the selected tests use
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.option.collectonly:
        return
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    # `translated` asks for its server by its param (never all of them).
    used |= {
        f"{_param(item, 'translated')}_server"
        for item in items
        if "vllm_version" not in getattr(item, "fixturenames", ()) and _param(item, "translated") in TRANSLATED
    }
    for name in _kinds:
        if f"{name}_server" in used:
            _boot(name)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_all()


def _version_roles(item: pytest.Item, version: str) -> set[str]:
    if _param(item, "vllm_version") != version:
        return set()
    names = getattr(item, "fixturenames", ())
    roles = {role for name, role in VERSION_ROLES.items() if name in names}
    if "translated" in names:
        roles.add(_param(item, "translated"))
    return roles


class _OneVersionAtATime:
    @pytest.hookimpl(trylast=True)  # after pytest's own reordering, which may split a version's tests
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """The tests of each version together, versions in first-seen order, in the same places."""
        versioned = {i: v for i, item in enumerate(items) if (v := _param(item, "vllm_version")) is not None}
        order = list(dict.fromkeys(versioned.values()))
        moved = [items[i] for i in sorted(versioned, key=lambda i: order.index(versioned[i]))]
        for slot, item in zip(versioned, moved, strict=True):
            items[slot] = item


def _param(item: pytest.Item, name: str) -> Any:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get(name)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_OneVersionAtATime(), "vllm-nvext-one-version-at-a-time")


@pytest.fixture(scope="session")
def vllm_version(request: pytest.FixtureRequest) -> Iterator[str]:
    """The vLLM version under test (parametrised indirectly by tests/e2e/test_versions.py).

    Starts together the servers of this version that the selected tests use, and stops them when
    pytest moves on to the next version (it groups a session-scoped parameter's tests).
    """
    version: str = request.param
    names = sorted(
        {VERSION_KINDS[version][role] for item in request.session.items for role in _version_roles(item, version)}
    )
    for name in names:
        _boot(name)
    yield version
    kinds = [_kinds[name] for name in names]
    for kind in kinds:
        if kind.thread is not None:
            kind.thread.join()
        if kind.server is not None:
            kind.server.terminate()
    for kind in kinds:
        if kind.server is not None:
            kind.server.stop()
        with _lock:  # asked for again (an unusual test order): started afresh
            kind.server, kind.thread, kind.error = None, None, None


# --- clients ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def raw(raw_server: Server) -> Iterator[httpx.Client]:
    with http_client(raw_server.url) as client:
        yield client


@pytest.fixture(scope="session")
def mw(mw_server: Server) -> Iterator[httpx.Client]:
    with http_client(mw_server.url) as client:
        yield client


@pytest.fixture(scope="session")
def plugin(plugin_server: Server) -> Iterator[httpx.Client]:
    with http_client(plugin_server.url) as client:
        yield client


@pytest.fixture(scope="session")
def scale(scale_server: Server) -> Iterator[httpx.Client]:
    with http_client(scale_server.url) as client:
        yield client


@pytest.fixture(scope="session")
def proxy(proxy_server: Server) -> Iterator[httpx.Client]:
    with http_client(proxy_server.url) as client:
        yield client


# The mounts every translation test runs on; `proxy` (out of process) in a pytest run of its own.
TRANSLATED = ("mw", "plugin", "proxy")


@pytest.fixture(scope="session", params=["mw", "plugin", pytest.param("proxy", marks=[pytest.mark.e2e_proxy])])
def translated(request: pytest.FixtureRequest) -> httpx.Client:
    """Each server with vllm-nvext: mounted via --middleware, via the plugin, and the proxy in front of stock vLLM."""
    client: httpx.Client = request.getfixturevalue(request.param)
    return client

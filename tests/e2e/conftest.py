"""The e2e fixtures, on the servers of tests/support/servers.py (which registers every kind and
starts and stops them; each kind's `<name>_server` fixture is imported here).

`vllm_version` is the vLLM a test runs on: .venv's (0.32), unless the marker `vllm_versions` on
its module or on the test lists others (e.g. tests/e2e/test_translation.py); then the test runs
once on each, `raw`, `raw_answer` and `translated` reaching that version's servers. A version
other than .venv's starts its servers when its first test runs and stops them before the next
version's (the tests of each version run together): 0.30 and 0.31 never run side by side. Their
tests (marked `e2e_versions`) run only when `-m` names that group (`make test-e2e-versions`), never
beside .venv's servers: `pytest tests/e2e/test_translation.py` runs .venv's and 0.33's. vLLM 0.33's
Rust frontend ("0.33-rust") runs only the proxy in front of it, its tests marked `e2e_proxy`. vLLM
0.34's tests (marker `e2e_vllm034`) likewise run only when `-m` names their group (`make test-e2e-vllm034`),
0.34's Rust frontend ("0.34-rust", the proxy in front alone) among them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import http_client
from tests.support import servers
from tests.support.agent_clis import *  # noqa: F403  (the real-client group's kinds' fixtures)
from tests.support.refs import APART, CURRENT, PROXY_ONLY, SEPARATE
from tests.support.servers import *  # noqa: F403  (every kind's `<name>_server` fixture)
from tests.support.servers import VERSION_KINDS, VERSION_ROLES, Server

# The mounts of vllm-nvext `translated` runs a test on, per version: `proxy` is `vllm-nvext proxy` in
# front of that version's stock server (marker e2e_proxy: in the proxy group's run for 0.32 and 0.33,
# in the versions group's for 0.30 and 0.31).
MOUNTS: dict[str, tuple[str, ...]] = {CURRENT: ("mw", "plugin", "proxy")}
OTHER_MOUNTS = ("mw", "plugin", "proxy")
# vLLM's Rust frontend (0.33's, 0.34's) loads neither --middleware nor endpoint plugins: the proxy in front alone.
MOUNTS.update(dict.fromkeys(PROXY_ONLY, ("proxy",)))


def _case(version: str | None, mount: str | None) -> Any:
    """One param of `vllm_version` and/or `translated`, with the markers of its group."""
    marks = [pytest.mark.e2e_proxy] if mount == "proxy" or version in PROXY_ONLY else []
    if version is not None and version != CURRENT:
        marks += [pytest.mark.reference, *([pytest.mark.e2e_versions] if version in SEPARATE else [])]
        marks += [getattr(pytest.mark, APART[version])] if version in APART else []
    values = [v for v in (version, mount) if v is not None]
    ids = ([f"vllm-{version}"] if version is not None else []) + ([mount] if mount is not None else [])
    return pytest.param(*values, id="-".join(ids), marks=marks)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`vllm_version` once per version the marker `vllm_versions` lists, each with its mounts for
    `translated`; a test without the marker runs on .venv's vLLM (and `translated` on its mounts)."""
    names = metafunc.fixturenames
    marker = metafunc.definition.get_closest_marker("vllm_versions")
    versions: tuple[str | None, ...] = marker.args if marker is not None and "vllm_version" in names else ()
    # A module with a `translated` of its own (tests/e2e/test_vllm033.py) keeps it, and its params.
    translated = "translated" in names and not hasattr(metafunc.module, "translated")
    argnames = [name for name, used in (("vllm_version", bool(versions)), ("translated", translated)) if used]
    if not argnames:
        return
    cases = [
        _case(version, mount)
        for version in versions or (None,)
        for mount in (MOUNTS.get(version or CURRENT, OTHER_MOUNTS) if translated else (None,))
    ]
    metafunc.parametrize(argnames, cases, indirect=True, scope="session")


def _param(item: pytest.Item, name: str) -> Any:
    callspec = getattr(item, "callspec", None)
    return None if callspec is None else callspec.params.get(name)


def _version(item: pytest.Item) -> str:
    return _param(item, "vllm_version") or CURRENT


def _roles(item: pytest.Item) -> set[str]:
    """The roles of its version's servers this test reaches through `raw`, `raw_answer`, `translated`..."""
    names = getattr(item, "fixturenames", ())
    if "vllm_version" not in names:  # a module's own `raw` (tests/e2e/test_vllm033.py) reaches no version's
        return set()
    roles = {role for name, role in VERSION_ROLES.items() if name in names}
    if "translated" in names and _param(item, "translated") in VERSION_KINDS[_version(item)]:
        roles.add(_param(item, "translated"))
    return roles


def pytest_itemcollected(item: pytest.Item) -> None:
    if servers.fixture_names(reference=True) & set(getattr(item, "fixturenames", ())):
        item.add_marker(pytest.mark.reference)


@pytest.hookimpl(trylast=True)  # after pytest's own ordering and `-m`/`-k` deselection
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for group in ("e2e_versions", *APART.values()):
        if group in (config.option.markexpr or ""):
            continue
        # 0.30 and 0.31's servers (0.34's) never run beside .venv's: only a run that names their group has them.
        apart = [item for item in items if item.get_closest_marker(group) is not None]
        if apart:
            config.hook.pytest_deselected(items=apart)
            items[:] = [item for item in items if item.get_closest_marker(group) is None]
    _one_version_at_a_time(items)
    if config.option.collectonly:
        return
    # Only the servers the selected tests use: each kind's fixture, and the session's version's roles.
    used = {name for item in items for name in getattr(item, "fixturenames", ())} & servers.fixture_names()
    used |= {
        f"{VERSION_KINDS[CURRENT][role]}_server" for item in items if _version(item) == CURRENT for role in _roles(item)
    }
    for name in sorted(used):
        servers.boot(name.removesuffix("_server"))


def _one_version_at_a_time(items: list[pytest.Item]) -> None:
    """The tests of each version other than .venv's together, versions in first-seen order, in the
    same places (pytest's own ordering by param may split them)."""
    versioned = {i: v for i, item in enumerate(items) if (v := _version(item)) != CURRENT}
    order = list(dict.fromkeys(versioned.values()))
    moved = [items[i] for i in sorted(versioned, key=lambda i: order.index(versioned[i]))]
    for slot, item in zip(versioned, moved, strict=True):
        items[slot] = item


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    servers.stop_all()


@pytest.fixture(scope="session")
def vllm_version(request: pytest.FixtureRequest) -> Iterator[str]:
    """The vLLM version under test (its param; .venv's without one).

    Another version's servers that the selected tests use start together here, and every server of
    that version stops when pytest moves on to the next version; .venv's are the session's.
    """
    version: str = getattr(request, "param", CURRENT)
    if version == CURRENT:
        yield version
        return
    servers.start_version(
        version, {role for item in request.session.items if _version(item) == version for role in _roles(item)}
    )
    try:
        yield version
    finally:
        servers.stop_version(version)


# --- clients ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def raw(vllm_version: str) -> Iterator[httpx.Client]:
    """Stock vLLM of the version under test (.venv's and vllm-rs check the API key: the proxy's upstream)."""
    keyed = vllm_version == CURRENT or vllm_version in PROXY_ONLY
    with http_client(servers.version_server(vllm_version, "raw").url, auth=keyed) as client:
        yield client


@pytest.fixture(scope="session")
def translated(request: pytest.FixtureRequest, vllm_version: str) -> Iterator[httpx.Client]:
    """vllm-nvext on the version under test, per its param: mounted via --middleware (`mw`), via the
    endpoint plugin (`plugin`), and on .venv's vLLM and vllm-rs the proxy in front of stock (`proxy`)."""
    with http_client(servers.version_server(vllm_version, request.param).url) as client:
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

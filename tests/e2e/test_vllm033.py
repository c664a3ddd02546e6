"""End to end on vLLM 0.33's real serving code: what only 0.33 has (kv_transfer_params, the CLI).

The servers are vLLM 0.33.0's own `vllm serve` app over a scripted engine core
(scripts/vllm_harness.py; 0.33's engine cannot run without a GPU): routers, `--middleware`,
the endpoint plugin, chat template, detokenizer, logprobs, n>1 fan-out and the
kv_transfer_params plumbing are 0.33's code, only the token ids are scripted. Each answer
through the middleware (mounted by `--middleware` and by the endpoint plugin) is compared with
the same harness without it. The translation matrix of tests/e2e/test_translation.py runs on
these servers too (its marker `vllm_versions` lists 0.33).

The reference venv comes from `make setup-vllm033`; without it every test here fails, naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import BASE, CHAT, COMPLETIONS, http_client, post, stream_digest, strip_volatile
from tests.support.refs import venv_python

pytestmark = [pytest.mark.e2e, pytest.mark.reference]  # the tests without a server use 0.33's venv too

KV_REQUEST = {"kv_transfer_params": {"do_remote_decode": True}}


# --- the 0.33 harness, stock and with vllm-nvext mounted -------------------------------------


@pytest.fixture(scope="session")
def raw(raw033_server) -> Iterator[httpx.Client]:
    with http_client(raw033_server.url, auth=False) as client:
        yield client


@pytest.fixture(scope="session", params=["mw033", "plugin033", pytest.param("proxy033", marks=[pytest.mark.e2e_proxy])])
def translated(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    """vLLM 0.33 with vllm-nvext: mounted via --middleware, via the endpoint plugin, and `vllm-nvext proxy`
    in front of the stock harness (`proxy033`, marker `e2e_proxy`: the proxy group's run)."""
    with http_client(request.getfixturevalue(f"{request.param}_server").url) as client:
        yield client


# --- kv_transfer_params: 0.33 sends it on the finish chunk ------------------------------------


def _kv_body(path: str, stream: bool, dialect: dict) -> dict:
    body = {**BASE[path], "temperature": 0, **KV_REQUEST, **dialect}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def _finish(events: list[dict]) -> dict:
    finishes = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"] is not None]
    assert len(finishes) == 1, "one finish chunk"
    return finishes[0]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_kv_transfer_params_reach_nvext_and_stay_at_the_root_for_an_orchestrator(translated, raw, path, stream):
    expected = post(raw, path, _kv_body(path, stream, {"return_token_ids": True}))
    kv = (_finish(expected) if stream else expected)["kv_transfer_params"]
    assert kv and kv["hidden_states_path"], "vLLM 0.33 sends the connector's payload"
    got = post(
        translated,
        path,
        _kv_body(path, stream, {"nvext": {"extra_fields": ["completion_token_ids"]}}),
        headers={"x-nvext-mode": "nvext"},
    )
    events = got if stream else [got]
    carrier = _finish(events) if stream else got
    assert carrier["nvext"]["kv_transfer_params"] == kv, "nvext carries vLLM's kv_transfer_params"
    # The request carried its own root kv_transfer_params (a prefill/decode orchestrator's): the
    # orchestrator reads vLLM's answer at the root, in every mode (docs/protocol.md §6).
    assert carrier["kv_transfer_params"] == kv, "an orchestrator's handoff stays at the root"
    assert all(e.get("kv_transfer_params") is None for e in events if e is not carrier), "on the finish chunk only"
    if stream:
        later = [e for e in events if e is not carrier and "nvext" in e]
        assert all("kv_transfer_params" not in e["nvext"] for e in later), "on the finish chunk only"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_kv_transfer_params_stay_at_the_root_in_vllm_placement(translated, raw, path, stream):
    body = _kv_body(path, stream, {"return_token_ids": True})
    expected = post(raw, path, body)
    got = post(translated, path, body, headers={"x-nvext-mode": "vllm"})
    if stream:
        assert stream_digest(got) == stream_digest(expected)
        assert _finish(got)["kv_transfer_params"] == _finish(expected)["kv_transfer_params"]
        assert all("nvext" not in e for e in got)
    else:
        assert strip_volatile(got) == strip_volatile(expected)
        assert got["kv_transfer_params"]["hidden_states_path"] and "nvext" not in got


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_kv_transfer_params_in_both_placements_on_a_stream(translated, raw, path):
    body = _kv_body(path, True, {"return_token_ids": True})
    expected = post(raw, path, body)
    got = post(translated, path, body, headers={"x-nvext-mode": "both"})
    kv = _finish(expected)["kv_transfer_params"]
    assert _finish(got)["kv_transfer_params"] == kv and _finish(got)["nvext"]["kv_transfer_params"] == kv
    assert stream_digest([{k: v for k, v in e.items() if k != "nvext"} for e in got]) == stream_digest(expected)


def test_n2_chat_stream_in_vllm_placement_matches_raw(translated, raw):
    body = {**BASE[CHAT], "n": 2, "temperature": 0.8, "seed": 5, "return_token_ids": True, "stream": True, **KV_REQUEST}
    got = post(translated, CHAT, body, headers={"x-nvext-mode": "vllm"})
    expected = post(raw, CHAT, body)
    assert stream_digest(got) == stream_digest(expected)
    assert {c["index"] for e in got for c in e["choices"]} == {0, 1}


# --- the project's vLLM entry points on 0.33 --------------------------------------------------


def _run_033(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv_python("0.33")), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"},
    )


def test_vllm_cli_entry_point_parses_serve_on_033():
    """`python -m vllm_nvext._vllm_cli` (what `vllm-nvext serve` runs) reaches 0.33's `vllm serve`."""
    done = _run_033("-m", "vllm_nvext._vllm_cli", "serve", "--help=Frontend")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--middleware" in done.stdout


def test_hidden_states_connector_matches_033s_connector_api():
    """The CPU connector imports on 0.33 and overrides exactly the hook 0.33's get_finished calls.

    (It cannot run here: 0.33's engine needs a GPU. The real-engine test is on 0.32.)
    """
    check = r"""
import inspect, json
from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as up
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm_nvext.connectors.hidden_states import CPUHiddenStatesConnector as C
init = inspect.getsource(up.ExampleHiddenStatesConnector.__init__)
register = inspect.getsource(up.ExampleHiddenStatesConnector.register_kv_caches)
finished = inspect.getsource(up.ExampleHiddenStatesConnector.get_finished)
print(json.dumps({
    "subclass": issubclass(C, KVConnectorBase_V1) and not inspect.isabstract(C),
    "hook": list(inspect.signature(up.ExampleHiddenStatesConnector._submit_async_write).parameters),
    "called": "self._submit_async_write(pending)" in finished and ".query()" in finished,
    "pending": sorted(up.PendingSave.__dataclass_fields__),
    "extract": list(inspect.signature(up.extract_from_kv_cache).parameters),
    "state": [a for a in ("_lock_fds", "_req_copy_events", "use_lock", "_block_size", "_kv_cache")
              if f"self.{a}" not in init] + [a for a in ("_is_tp_rank_zero",) if f"self.{a}" not in register],
}))
"""
    done = _run_033("-c", check)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts == {
        "subclass": True,
        "hook": ["self", "pending"],
        "called": True,
        "pending": ["block_ids", "filename", "req_id", "token_ids"],
        "extract": facts["extract"],
        "state": [],
    }, "the upstream state and hooks the CPU connector relies on"
    assert len(facts["extract"]) == 3, f"extract_from_kv_cache{facts['extract']}: the connector passes three arguments"

"""`vllm-nvext parity` and the examples, end to end on the real servers.

Parity must pass on the middleware server (alone, against stock vLLM as the baseline, and against
a real Dynamo 1.6.1 with `--dynamo-url`) and must fail, naming the first differing id, when a
proxy alters one id.
The examples run as a user runs them, as subprocesses against the `mw` server.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import API_KEY, proxy, rows, run_parity
from vllm_nvext.client import extract
from vllm_nvext.tools import cli
from vllm_nvext.tools.dynamo_conformance import cases

pytestmark = pytest.mark.e2e

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CASES_PER_BUILTIN_SET = 7  # 2 text prompts x 2 endpoints, 1 messages prompt, 1 id prompt x 2


def test_parity_passes_on_the_middleware_server(mw_server, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    argv = ["parity", "--url", mw_server.url, "--api-key", API_KEY, "--json", str(report_path)]
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    table, progress = captured.out, captured.err
    assert "OK:" in table and "FAILED" not in table
    assert "[1/28]" in progress, "progress goes to stderr"
    compared = rows(table, "completion ids: vllm == nvext")
    token_data = [line for line in table.splitlines() if "chat token_data" in line]
    # The chat token_data case is skipped with a reason, or runs like every other case.
    skipped = any("SKIP" in line and "nvext.token_data" in line for line in token_data)
    assert len(compared) == CASES_PER_BUILTIN_SET - (1 if skipped else 0)
    assert all("PASS" in line and "16 completion ids identical" in line for line in compared)
    assert len(rows(table, "nvext: stream == unary")) == len(compared)
    report = json.loads(report_path.read_text())
    assert report["passed"] is True and report["summary"]["failed"] == 0
    first = report["cases"][0]["requests"]
    assert first["vllm unary"]["placements"] == ["vllm"]
    assert first["nvext unary"]["placements"] == ["nvext"]
    assert first["vllm unary"]["completion_token_ids"] == first["nvext stream"]["completion_token_ids"]


def test_parity_against_stock_vllm_as_the_baseline_passes(mw_server, raw_server, tmp_path):
    report_path = tmp_path / "report.json"
    status, table, _, report = run_parity(
        "--url", mw_server.url, "--baseline-url", raw_server.url, "--api-key", API_KEY,
        "--json", str(report_path), "--max-tokens", "8",
    )  # fmt: skip
    assert status == 0, table
    assert report is not None and report["baseline_url"] == raw_server.url
    assert all("PASS" in line for line in rows(table, "completion ids: vllm == nvext"))
    assert rows(table, "prompt ids == sent ids") and all("PASS" in r for r in rows(table, "prompt ids == sent ids"))


def test_parity_names_the_first_difference_when_the_baseline_alters_an_id(mw_server, raw_server):
    altered: list[tuple[int, int]] = []

    def bump_fourth_id(path, request, status, content_type, body):
        if status != 200 or not content_type.startswith("application/json"):
            return status, body
        obj = json.loads(body)
        ids = obj["choices"][0]["token_ids"]
        altered.append((ids[3] + 1, ids[3]))
        ids[3] += 1
        return status, json.dumps(obj).encode()

    with proxy(raw_server.url, bump_fourth_id) as baseline:
        status, table, _, _ = run_parity("--url", mw_server.url, "--baseline-url", baseline, "--api-key", API_KEY)
    assert status == 1
    assert "FAILED:" in table
    compared = rows(table, "completion ids: vllm == nvext")
    assert compared and len(compared) == len(altered)
    for line, (new, old) in zip(compared, altered, strict=True):
        assert "FAIL" in line and f"completion ids index 3: {new} != {old}" in line, line
    for line, (new, old) in zip(rows(table, "vllm: stream == unary"), altered, strict=True):
        assert "FAIL" in line and f"completion ids index 3: {old} != {new}" in line, line
    assert all("PASS" in line for line in rows(table, "prompt ids: vllm == nvext"))
    assert all("PASS" in line for line in rows(table, "nvext: stream == unary"))


def test_parity_fails_on_a_failed_request_and_says_why(mw_server):
    def refuse_streams(path, request, status, content_type, body):
        if request.get("stream"):
            return 500, b'{"error": {"message": "proxy says no", "type": "InternalServerError", "code": 500}}'
        return status, body

    with proxy(mw_server.url, refuse_streams) as url:
        status, table, _, _ = run_parity("--url", url, "--api-key", API_KEY, "--max-tokens", "4")
    assert status == 1
    failed = rows(table, "nvext stream")
    assert failed and all("FAIL" in line and "HTTP 500: proxy says no" in line for line in failed)
    assert all("SKIP" in line for line in rows(table, "nvext: stream == unary"))
    assert all("PASS" in line for line in rows(table, "completion ids: vllm == nvext"))


def test_wrong_api_key_is_exit_2(mw_server):
    status, table, progress, _ = run_parity("--url", mw_server.url, "--api-key", "wrong")
    assert status == 2 and table == ""
    assert "HTTP 401" in progress and "--api-key" in progress


def test_custom_prompts_file_and_token_prompts_come_back_as_sent(mw_server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt_token_ids": [10, 20, 30, 40, 50]}\n'
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}\n'
    )
    status, table, progress, _ = run_parity(
        "--url", mw_server.url, "--api-key", API_KEY, "--prompts", str(prompts), "--max-tokens", "5"
    )
    assert status == 0, table
    sent = rows(table, "prompt ids == sent ids")
    token_data_skipped = "nvext.token_data on chat  SKIP" in table
    assert len(sent) == (1 if token_data_skipped else 2)  # completions, and chat via nvext.token_data
    assert all("PASS" in line and "5 ids" in line for line in sent)
    assert "#2 chat messages" in table and "3 completion ids identical" in table
    assert "[1/12]" in progress  # 3 cases x 4 requests


def test_hidden_states_without_a_connector_fail_clearly(mw_server):
    status, table, _, _ = run_parity("--url", mw_server.url, "--api-key", API_KEY, "--hidden-states")
    assert status == 1
    loads = rows(table, "hidden states load")
    assert loads and all("FAIL" in line and "no kv_transfer_params.hidden_states_path" in line for line in loads)


@pytest.mark.parametrize("perturb", [False, True], ids=["identical", "perturbed"])
def test_hidden_states_are_loaded_and_compared(mw_server, tmp_path, perturb):
    """A proxy adds hidden-state files the way a connector does, in each dialect's placement."""
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    written: list[str] = []

    def add_hidden_states(path, request, status, content_type, body):
        if status != 200 or not content_type.startswith("application/json"):
            return status, body
        obj = json.loads(body)
        prompt = extract(obj).prompt_token_ids
        hidden = torch.arange(len(prompt) * 2 * 4, dtype=torch.float32).reshape(len(prompt), 2, 4)
        if perturb and "nvext" in request:
            hidden[0, 1, 2] += 0.5
        file = str(tmp_path / f"req-{len(written)}.safetensors")
        safetensors_torch.save_file({"hidden_states": hidden, "token_ids": torch.tensor(prompt)}, file)
        written.append(file)
        if "nvext" in request:
            obj["nvext"]["kv_transfer_params"] = {"hidden_states_path": file}
        else:
            obj["kv_transfer_params"] = {"hidden_states_path": file}
        return status, json.dumps(obj).encode()

    with proxy(mw_server.url, add_hidden_states) as url:
        status, table, _, _ = run_parity("--url", url, "--api-key", API_KEY, "--hidden-states", "--max-tokens", "4")
    loads, equal = rows(table, "hidden states load"), rows(table, "hidden states equal")
    assert loads and all("PASS" in line and ", 2, 4]" in line for line in loads), table
    assert len(equal) == len(loads)
    if perturb:
        assert status == 1
        assert all("FAIL" in line and "max abs diff 0.5" in line for line in equal)
    else:
        assert status == 0, table
        assert all("PASS" in line and "max abs diff 0 " in line for line in equal)


def test_hidden_states_on_a_real_connector_server(hs_server):
    """A CPU server started with vllm_nvext.connectors.hidden_states (conftest's `hs`): real files."""
    url = hs_server.url  # a server run elsewhere when VLLM_NVEXT_HS_URL is set (conftest)
    key = os.environ.get("VLLM_NVEXT_HS_API_KEY") or API_KEY
    status, table, _, _ = run_parity("--url", url, "--hidden-states", *(["--api-key", key] if key else []))
    assert status == 0, table
    assert all("PASS" in line for line in rows(table, "hidden states equal"))
    result = _example("hidden_states_capture.py", url, key)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all hidden-state files check out" in result.stdout


# --- against a real Dynamo 1.6.1 (--dynamo-url) ------------------------------------------------


def _dynamo_row(table: str, case: str) -> tuple[str, str]:
    """(result, detail) of a case's row in a `--dynamo-url` table."""
    for line in table.splitlines():
        if line.startswith(case + " "):
            _, _, result, *detail = re.split(r"\s{2,}", line, maxsplit=3)
            return result, detail[0] if detail else ""
    raise AssertionError(f"no row for {case}:\n{table}")


def test_parity_against_a_real_dynamo_passes(dynamo_server, nvext_dynamo_server, tmp_path):
    report_path = tmp_path / "report.json"
    status, table, progress, report = run_parity(
        "--url", nvext_dynamo_server.url, "--dynamo-url", dynamo_server.url, "--json", str(report_path)
    )
    # On a difference, what both servers said goes into the failure message (the report keeps it too).
    differing = [c for c in (report or {}).get("cases", []) if c["differences"]]
    assert status == 0, table + "\n" + json.dumps(differing, indent=1)[:20000]
    assert f"Dynamo {dynamo_server.url} vs vllm-nvext {nvext_dynamo_server.url} (nvext mode)" in progress
    assert table.rstrip().endswith("OK: 79 cases, 79 agree, 0 differ"), table
    assert _dynamo_row(table, "chat-ids-stream") == ("PASS", "HTTP 200 both")
    # A batch with engine_data: Dynamo answers, vllm-nvext refuses; the allow-list lists it.
    assert _dynamo_row(table, "completions-batch-engine_data") == ("PASS", "HTTP 200 Dynamo, 400 vllm-nvext (allowed)")
    assert report is not None and report["passed"] is True and report["dynamo_url"] == dynamo_server.url
    assert all(case["differences"] == [] for case in report["cases"])


def test_parity_against_dynamo_names_an_id_a_proxy_altered(dynamo_server, nvext_dynamo_server):
    altered: dict[str, tuple[list[int], list[int]]] = {}

    def bump_last_unary_id(path, request, status, content_type, body):
        if status != 200 or request.get("stream"):
            return status, body
        obj = json.loads(body)
        ids = (obj.get("nvext") or {}).get("completion_token_ids")
        if not ids:
            return status, body
        before = list(ids)
        ids[-1] += 1
        altered[json.dumps(request)] = (before, list(ids))
        return status, json.dumps(obj).encode()

    with proxy(nvext_dynamo_server.url, bump_last_unary_id) as url:
        status, table, _, _ = run_parity("--url", url, "--dynamo-url", dynamo_server.url)
    assert status == 1
    assert altered and f"FAILED: 79 cases, {79 - len(altered)} agree, {len(altered)} differ" in table
    ids_case = next(c for c in cases("tiny") if c.name == "chat-ids-unary")
    before, after = altered[json.dumps(ids_case.body)]
    expected = f"nvext.completion_token_ids: Dynamo {json.dumps(before)} vs vllm-nvext {json.dumps(after)}"
    assert _dynamo_row(table, "chat-ids-unary") == ("FAIL", expected)
    assert _dynamo_row(table, "chat-ids-stream")[0] == "PASS"


# --- the examples, run as a user runs them -----------------------------------------------------


def _example(name: str, url: str, api_key: str | None = API_KEY, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(EXAMPLES / name), "--url", url]
    if name.endswith(".sh"):
        command = ["bash", str(EXAMPLES / name), "--url", url]
    if api_key:
        command += ["--api-key", api_key]
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False, **kwargs)


def test_example_openai_sdk_both_dialects(mw_server):
    result = _example("openai_sdk_both_dialects.py", mw_server.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all ids identical across dialects" in result.stdout
    assert result.stdout.count("vLLM dialect answered under 'vllm', nvext dialect under 'nvext'") == 4


def test_example_rl_rollout(mw_server):
    result = _example("rl_rollout.py", mw_server.url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all rollouts check out" in result.stdout
    assert result.stdout.count("(from engine_data)") == 12  # 4 rollouts x (unary, stream, turn 2)


def test_example_parity_sh_writes_a_passing_report(mw_server, tmp_path):
    result = _example("parity.sh", mw_server.url, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parity: all checks passed" in result.stdout
    assert json.loads((tmp_path / "parity-report.json").read_text())["passed"] is True


def test_example_hidden_states_capture_explains_a_missing_connector(mw_server):
    result = _example("hidden_states_capture.py", mw_server.url)
    assert result.returncode == 2
    assert "no kv_transfer_params.hidden_states_path" in result.stderr
    assert "--kv-transfer-config" in result.stderr


def test_examples_fail_when_the_server_refuses_them(mw_server):
    result = _example("openai_sdk_both_dialects.py", mw_server.url, api_key="wrong")
    assert result.returncode == 1
    assert "FAIL AuthenticationError" in result.stdout

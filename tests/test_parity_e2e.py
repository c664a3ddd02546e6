"""`vllm-nvext parity` and the examples, end to end on the real servers.

Parity must pass on the middleware server (alone, and against stock vLLM as the baseline) and
must fail, naming the first differing id, when a proxy in front of stock vLLM alters one id.
The examples run as a user runs them, as subprocesses against the `mw` server.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from vllm_nvext import cli, parity
from vllm_nvext.client import extract
from vllm_nvext.server import free_port

from .conftest import API_KEY

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
FORWARDED_HEADERS = ("authorization", "content-type", "x-nvext-mode")
# (path, request, status, content type, body) -> (status, body)
Edit = Callable[[str, dict[str, Any], int, str, bytes], tuple[int, bytes]]


@contextmanager
def proxy(upstream: str, edit: Edit) -> Iterator[str]:
    """An HTTP proxy in a thread: forwards to `upstream`, lets `edit` change POST answers."""
    http = httpx.Client(base_url=upstream, timeout=120.0)

    class Handler(BaseHTTPRequestHandler):
        def _forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
            upstream_response = http.request(self.command, self.path, content=body or None, headers=headers)
            status, content = upstream_response.status_code, upstream_response.content
            content_type = upstream_response.headers.get("content-type", "application/json")
            if self.command == "POST":
                status, content = edit(self.path, json.loads(body), status, content_type, content)
            self.send_response(status)
            self.send_header("content-type", content_type)
            self.send_header("content-length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        do_GET = do_POST = _forward

        def log_message(self, *args: Any) -> None:  # keep the test output clean
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        http.close()


def run_parity(*argv: str) -> tuple[int, str, str, dict[str, Any] | None]:
    """Parse argv as the CLI does, run parity; (exit status, table, progress, JSON report)."""
    parser = cli.build_parser()
    args = parser.parse_args(["parity", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = parity.run(args, stdout=out, stderr=err)
    report = None
    if args.json_report is not None and args.json_report.exists():
        report = json.loads(args.json_report.read_text())
    return status, out.getvalue(), err.getvalue(), report


def rows(table: str, check: str) -> list[str]:
    return [line for line in table.splitlines() if f"  {check}  " in line]


# --- without servers -------------------------------------------------------------------------


def test_unreachable_server_is_exit_2_with_a_clear_message():
    status, table, progress, _ = run_parity("--url", f"http://127.0.0.1:{free_port()}")
    assert status == 2
    assert "cannot reach http://127.0.0.1:" in progress
    assert table == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{"promt": "typo"}\n', r"prompts.jsonl:2: unknown key\(s\) \['promt'\]"),
        ('{"prompt": "a", "messages": []}\n', "exactly one of"),
        ('{"prompt_token_ids": [1, -2]}\n', "non-negative integers"),
        ("not json\n", "prompts.jsonl:1: not JSON"),
        ("\n\n", "no prompts"),
    ],
)
def test_bad_prompts_file_is_exit_2_naming_the_line(tmp_path, content, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    status, _, progress, _ = run_parity("--url", "http://127.0.0.1:9", "--prompts", str(prompts))
    assert status == 2
    assert re.search(message, progress), progress


def test_parity_is_wired_into_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "vllm_nvext.cli", "parity", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    for option in ("--url", "--baseline-url", "--prompts", "--hidden-states", "--json", "--model", "--max-tokens"):
        assert option in result.stdout


# --- against the real servers ----------------------------------------------------------------

CASES_PER_BUILTIN_SET = 7  # 2 text prompts x 2 endpoints, 1 messages prompt, 1 id prompt x 2


@pytest.mark.e2e
def test_parity_passes_on_the_middleware_server(servers, tmp_path, capsys):
    report_path = tmp_path / "report.json"
    argv = ["parity", "--url", servers["mw"].url, "--api-key", API_KEY, "--json", str(report_path)]
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


@pytest.mark.e2e
def test_parity_against_stock_vllm_as_the_baseline_passes(servers, tmp_path):
    report_path = tmp_path / "report.json"
    status, table, _, report = run_parity(
        "--url", servers["mw"].url, "--baseline-url", servers["raw"].url, "--api-key", API_KEY,
        "--json", str(report_path), "--max-tokens", "8",
    )  # fmt: skip
    assert status == 0, table
    assert report is not None and report["baseline_url"] == servers["raw"].url
    assert all("PASS" in line for line in rows(table, "completion ids: vllm == nvext"))
    assert rows(table, "prompt ids == sent ids") and all("PASS" in r for r in rows(table, "prompt ids == sent ids"))


@pytest.mark.e2e
def test_parity_names_the_first_difference_when_the_baseline_alters_an_id(servers):
    altered: list[tuple[int, int]] = []

    def bump_fourth_id(path, request, status, content_type, body):
        if status != 200 or not content_type.startswith("application/json"):
            return status, body
        obj = json.loads(body)
        ids = obj["choices"][0]["token_ids"]
        altered.append((ids[3] + 1, ids[3]))
        ids[3] += 1
        return status, json.dumps(obj).encode()

    with proxy(servers["raw"].url, bump_fourth_id) as baseline:
        status, table, _, _ = run_parity("--url", servers["mw"].url, "--baseline-url", baseline, "--api-key", API_KEY)
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


@pytest.mark.e2e
def test_parity_fails_on_a_failed_request_and_says_why(servers):
    def refuse_streams(path, request, status, content_type, body):
        if request.get("stream"):
            return 500, b'{"error": {"message": "proxy says no", "type": "InternalServerError", "code": 500}}'
        return status, body

    with proxy(servers["mw"].url, refuse_streams) as url:
        status, table, _, _ = run_parity("--url", url, "--api-key", API_KEY, "--max-tokens", "4")
    assert status == 1
    failed = rows(table, "nvext stream")
    assert failed and all("FAIL" in line and "HTTP 500: proxy says no" in line for line in failed)
    assert all("SKIP" in line for line in rows(table, "nvext: stream == unary"))
    assert all("PASS" in line for line in rows(table, "completion ids: vllm == nvext"))


@pytest.mark.e2e
def test_wrong_api_key_is_exit_2(servers):
    status, table, progress, _ = run_parity("--url", servers["mw"].url, "--api-key", "wrong")
    assert status == 2 and table == ""
    assert "HTTP 401" in progress and "--api-key" in progress


@pytest.mark.e2e
def test_custom_prompts_file_and_token_prompts_come_back_as_sent(servers, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        '{"prompt_token_ids": [10, 20, 30, 40, 50]}\n'
        '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}\n'
    )
    status, table, progress, _ = run_parity(
        "--url", servers["mw"].url, "--api-key", API_KEY, "--prompts", str(prompts), "--max-tokens", "5"
    )
    assert status == 0, table
    sent = rows(table, "prompt ids == sent ids")
    token_data_skipped = "nvext.token_data on chat  SKIP" in table
    assert len(sent) == (1 if token_data_skipped else 2)  # completions, and chat via nvext.token_data
    assert all("PASS" in line and "5 ids" in line for line in sent)
    assert "#2 chat messages" in table and "3 completion ids identical" in table
    assert "[1/12]" in progress  # 3 cases x 4 requests


@pytest.mark.e2e
def test_hidden_states_without_a_connector_fail_clearly(servers):
    status, table, _, _ = run_parity("--url", servers["mw"].url, "--api-key", API_KEY, "--hidden-states")
    assert status == 1
    loads = rows(table, "hidden states load")
    assert loads and all("FAIL" in line and "no kv_transfer_params.hidden_states_path" in line for line in loads)


@pytest.mark.e2e
@pytest.mark.parametrize("perturb", [False, True], ids=["identical", "perturbed"])
def test_hidden_states_are_loaded_and_compared(servers, tmp_path, perturb):
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

    with proxy(servers["mw"].url, add_hidden_states) as url:
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


@pytest.mark.e2e
def test_hidden_states_on_a_real_connector_server(servers):
    """A CPU server started with vllm_nvext.hidden_states_connector (conftest's `hs`): real files."""
    url = os.environ.get("VLLM_NVEXT_HS_URL") or servers["hs"].url
    key = os.environ.get("VLLM_NVEXT_HS_API_KEY") or API_KEY
    status, table, _, _ = run_parity("--url", url, "--hidden-states", *(["--api-key", key] if key else []))
    assert status == 0, table
    assert all("PASS" in line for line in rows(table, "hidden states equal"))
    result = _example("hidden_states_capture.py", url, key)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all hidden-state files check out" in result.stdout


# --- the examples, run as a user runs them -----------------------------------------------------


def _example(name: str, url: str, api_key: str | None = API_KEY, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, str(EXAMPLES / name), "--url", url]
    if name.endswith(".sh"):
        command = ["bash", str(EXAMPLES / name), "--url", url]
    if api_key:
        command += ["--api-key", api_key]
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, check=False, **kwargs)


@pytest.mark.e2e
def test_example_openai_sdk_both_dialects(servers):
    result = _example("openai_sdk_both_dialects.py", servers["mw"].url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all ids identical across dialects" in result.stdout
    assert result.stdout.count("vLLM dialect answered under 'vllm', nvext dialect under 'nvext'") == 4


@pytest.mark.e2e
def test_example_rl_rollout(servers):
    result = _example("rl_rollout.py", servers["mw"].url)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all rollouts check out" in result.stdout
    assert result.stdout.count("(from engine_data)") == 12  # 4 rollouts x (unary, stream, turn 2)


@pytest.mark.e2e
def test_example_parity_sh_writes_a_passing_report(servers, tmp_path):
    result = _example("parity.sh", servers["mw"].url, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parity: all checks passed" in result.stdout
    assert json.loads((tmp_path / "parity-report.json").read_text())["passed"] is True


@pytest.mark.e2e
def test_example_hidden_states_capture_explains_a_missing_connector(servers):
    result = _example("hidden_states_capture.py", servers["mw"].url)
    assert result.returncode == 2
    assert "no kv_transfer_params.hidden_states_path" in result.stderr
    assert "--kv-transfer-config" in result.stderr


@pytest.mark.e2e
def test_examples_fail_when_the_server_refuses_them(servers):
    result = _example("openai_sdk_both_dialects.py", servers["mw"].url, api_key="wrong")
    assert result.returncode == 1
    assert "FAIL AuthenticationError" in result.stdout

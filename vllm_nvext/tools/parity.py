"""`vllm-nvext parity`: A/B-check that both dialects return byte-identical token ids.

Every prompt goes out as chat and as completions, unary and streamed, greedy, once in the vLLM
dialect (`return_token_ids: true`) and once in the Dynamo dialect
(`nvext.extra_fields: ["completion_token_ids"]`): both to `--url` (with the `x-nvext-mode`
header naming the placement), or the vLLM dialect to a stock vLLM at `--baseline-url`. The ids
are read with `vllm_nvext.client` from whichever placement the server used, then checked
(the prompts, requests and verdicts are the pure `parity_checks` module; this one sends and reports):

- each request succeeded and its ids sit in the dialect's placement (docs/protocol.md §1, §3);
- prompt and completion ids are identical across dialects (and equal the sent ids for
  token-id prompts);
- a stream's concatenated ids equal the unary answer, in each dialect;
- with `--hidden-states`, both requests' `kv_transfer_params.hidden_states_path` files load
  (docs/protocol.md §2) with the prompt ids and hold equal tensors.

With `--dynamo-url`, a Dynamo frontend is the baseline instead: each case of the conformance
matrix (`vllm_nvext.tools.dynamo_conformance`: chat and completions, unary and streamed, every nvext
selector, stop/EOS, token_data, seeded n=2, unknown keys) goes as the same bytes to Dynamo and to
`--url` (nvext mode), and the two answers must agree up to the differences
`vllm_nvext.tools.dynamo_differences` allows; one row per case names the first other difference.

Exit status: 0 all checks passed (skips allowed), 1 a check failed or a request failed,
2 a usage error or an unreachable server.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ..config import MODE_HEADER
from .parity_checks import (
    BUILTIN_PROMPTS,
    NVEXT_DIALECT,
    REQUESTS,
    SKIP,
    VLLM_DIALECT,
    Case,
    Outcome,
    Row,
    UsageError,
    build_cases,
    builtin_prompts,
    judge_case,
    load_prompts,
    outcome_report,
    read_answer,
    request_body,
    token_data_unsupported,
)
from .parity_hidden_states import judge_hidden_states
from .parity_run import Target, conclude, resolve_model

if TYPE_CHECKING:
    import httpx

__all__ = ["BUILTIN_PROMPTS", "UsageError", "add_arguments", "run"]

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_TOKENS = 16
CLIENT_EXTRA = "pip install 'vllm-nvext[client]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A/B-check that vLLM's return_token_ids dialect and Dynamo's nvext dialect return "
        "byte-identical token ids: chat and completions, unary and streamed, text and token-id prompts."
    )
    parser.epilog = "exit status: 0 all checks passed, 1 a check or request failed, 2 usage error or unreachable server"
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the vllm-nvext server (default {DEFAULT_URL})")
    baseline = parser.add_mutually_exclusive_group()
    baseline.add_argument(
        "--baseline-url",
        help="a stock vLLM server: the vLLM dialect goes there, the nvext dialect to --url",
    )
    baseline.add_argument(
        "--dynamo-url",
        help="a Dynamo frontend: the conformance cases go as the same bytes there and to --url (nvext mode); "
        "the answers must agree up to vllm_nvext/tools/dynamo_differences.py (--prompts, --hidden-states and "
        "--max-tokens do not apply; --api-key is sent to --url only)",
    )
    parser.add_argument(
        "--prompts",
        type=Path,
        help='JSONL file, one of {"prompt": "text"}, {"prompt_token_ids": [...]}, {"messages": [...]} '
        "per line (optional `max_tokens`); default: a few built-in prompts",
    )
    parser.add_argument(
        "--hidden-states",
        action="store_true",
        help="also load and compare the kv_transfer_params.hidden_states_path files (run on the server's host)",
    )
    parser.add_argument(
        "--hidden-states-atol",
        type=float,
        default=0.0,
        help="largest absolute difference allowed between hidden states (default 0: identical)",
    )
    parser.add_argument("--json", type=Path, dest="json_report", metavar="REPORT.json", help="write a JSON report")
    parser.add_argument("--model", help="served model name (default: the first model --url lists)")
    parser.add_argument(
        "--api-key", default=os.environ.get("VLLM_API_KEY"), help="bearer token (default: $VLLM_API_KEY)"
    )
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="per request (default 16)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per request (default 120)")


def run(
    args: argparse.Namespace,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    transport: httpx.BaseTransport | None = None,
) -> int:
    """Run every check; print the table; return the exit status.

    `transport` replaces httpx's network transport (e.g. `httpx.MockTransport`, `httpx.WSGITransport`).
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    try:
        return _run(args, out, err, transport)
    except UsageError as exc:
        print(f"vllm-nvext parity: error: {exc}", file=err)
        return 2


def _run(args: argparse.Namespace, out: TextIO, err: TextIO, transport: httpx.BaseTransport | None) -> int:
    try:
        import httpx
    except ImportError:
        raise UsageError(f"needs httpx, which is not installed: {CLIENT_EXTRA}") from None
    if getattr(args, "dynamo_url", None):
        from .parity_dynamo import run_dynamo  # the Dynamo baseline's modules, loaded when asked

        return run_dynamo(args, out, err, transport)
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    prompts = load_prompts(args.prompts) if args.prompts is not None else builtin_prompts()
    load_hidden_states = _hidden_states_loader() if args.hidden_states else None
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    nvext_target = Target(args.url.rstrip("/"), dict(auth))
    if args.baseline_url:
        vllm_target = Target(args.baseline_url.rstrip("/"), dict(auth), send_mode_header=False)
    else:
        vllm_target = nvext_target

    with httpx.Client(timeout=args.timeout, transport=transport) as http:
        model = resolve_model(http, nvext_target, args.model)
        if vllm_target is not nvext_target:
            resolve_model(http, vllm_target, model)
        cases = build_cases(prompts)
        print(
            f"vllm-nvext parity: {len(cases)} cases x {len(REQUESTS)} requests, model {model!r}, vLLM dialect -> "
            f"{vllm_target.url}, nvext dialect -> {nvext_target.url}",
            file=err,
            flush=True,
        )
        session = _Session(
            http, vllm_target, nvext_target, model, args.max_tokens, load_hidden_states, args.hidden_states_atol, err
        )
        session.total = len(REQUESTS) * len(cases)
        for case in cases:
            session.check_case(case)

    report = {
        "url": nvext_target.url,
        "baseline_url": args.baseline_url,
        "model": model,
        "max_tokens": args.max_tokens,
        "hidden_states": bool(args.hidden_states),
    }
    summary = "{checks} checks, {passed} passed, {failed} failed, {skipped} skipped"
    return conclude(session.rows, session.case_reports, summary, report, args.json_report, out)


# --- requests ----------------------------------------------------------------------------------


class _Session:
    """Sends each case's requests, prints progress, and collects the verdicts' rows."""

    def __init__(
        self,
        http: httpx.Client,
        vllm_target: Target,
        nvext_target: Target,
        model: str,
        max_tokens: int,
        load_hidden_states: Callable[..., Any] | None,
        atol: float,
        err: TextIO,
    ) -> None:
        self.http = http
        self.targets = {VLLM_DIALECT: vllm_target, NVEXT_DIALECT: nvext_target}
        self.model = model
        self.max_tokens = max_tokens
        self.load_hidden_states = load_hidden_states
        self.atol = atol
        self.err = err
        self.rows: list[Row] = []
        self.case_reports: list[dict[str, Any]] = []
        self.done = 0
        self.total = 0

    def fetch(self, case: Case, dialect: str, stream: bool) -> Outcome:
        import httpx

        self.done += 1
        shape = "stream" if stream else "unary"
        print(f"[{self.done}/{self.total}] {case.label} {case.prompt.preview!r}: {dialect} {shape}", file=self.err)
        self.err.flush()
        target = self.targets[dialect]
        path, body = request_body(case, dialect, stream, self.model, self.max_tokens)
        headers = dict(target.headers)
        if target.send_mode_header:
            headers[MODE_HEADER] = dialect
        try:
            if not stream:
                response = self.http.post(target.url + path, json=body, headers=headers)
                return read_answer(
                    response.status_code, response.headers.get("content-type", ""), response.content, False
                )
            with self.http.stream("POST", target.url + path, json=body, headers=headers) as response:
                content_type = response.headers.get("content-type", "")
                return read_answer(response.status_code, content_type, response.iter_bytes(), True)
        except httpx.HTTPError as exc:
            return Outcome(error=f"request failed: {type(exc).__name__}: {exc}")

    def check_case(self, case: Case) -> None:
        report: dict[str, Any] = {"case": case.label, "prompt": case.prompt.preview, "requests": {}}
        self.case_reports.append(report)
        outcomes: dict[tuple[str, bool], Outcome] = {}
        for dialect, stream in REQUESTS:
            outcome = self.fetch(case, dialect, stream)
            outcomes[(dialect, stream)] = outcome
            report["requests"][f"{dialect} {'stream' if stream else 'unary'}"] = outcome_report(outcome)
            if (dialect, stream) == (NVEXT_DIALECT, False):
                reason = token_data_unsupported(case, outcome)
                if reason is not None:
                    self.total -= len(REQUESTS) - 1  # the other requests of this case are not sent
                    self.rows.append(Row(case.label, "nvext.token_data on chat", SKIP, reason))
                    report["skipped"] = reason
                    return
        self.rows += judge_case(case, outcomes)
        if self.load_hidden_states is not None:
            rows, hidden = judge_hidden_states(
                case,
                outcomes[(VLLM_DIALECT, False)].ids,
                outcomes[(NVEXT_DIALECT, False)].ids,
                self.load_hidden_states,
                self.atol,
            )
            self.rows += rows
            if hidden is not None:
                report["hidden_states"] = hidden


def _hidden_states_loader() -> Callable[..., Any]:
    from .. import hidden_states

    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        raise UsageError(
            f"--hidden-states needs torch and safetensors ({exc}): pip install 'vllm-nvext[hidden-states]'"
        ) from exc
    return hidden_states.load

"""`vllm-nvext parity`: A/B-check that both dialects return byte-identical token ids.

Every prompt goes out as chat and as completions, unary and streamed, greedy, once in the vLLM
dialect (`return_token_ids: true`) and once in the Dynamo dialect
(`nvext.extra_fields: ["completion_token_ids"]`): both to `--url` (with the `x-nvext-mode`
header naming the placement), or the vLLM dialect to a stock vLLM at `--baseline-url`. The ids
are read with `vllm_nvext.client` from whichever placement the server used, then checked:

- each request succeeded and its ids sit in the dialect's placement (PROTOCOL §1, §3);
- prompt and completion ids are identical across dialects (and equal the sent ids for
  token-id prompts);
- a stream's concatenated ids equal the unary answer, in each dialect;
- with `--hidden-states`, both requests' `kv_transfer_params.hidden_states_path` files load
  (PROTOCOL §2) with the prompt ids and hold equal tensors.

Exit status: 0 all checks passed (skips allowed), 1 a check failed or a request failed,
2 a usage error or an unreachable server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .client import TokenIds, TokenIdsError, extract, extract_stream, first_difference, parse_sse

if TYPE_CHECKING:
    import httpx

__all__ = ["BUILTIN_PROMPTS", "add_arguments", "run"]

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_TOKENS = 16
MODE_HEADER = "x-nvext-mode"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# Dynamo's chat clients send a placeholder message next to `nvext.token_data` (PROTOCOL §3).
TOKEN_DATA_PLACEHOLDER = [{"role": "user", "content": "(prompt sent as nvext.token_data)"}]

BUILTIN_PROMPTS: tuple[dict[str, Any], ...] = (
    {"prompt": "The capital of France is"},
    {"prompt": "Unicode: héllo wörld ✓ 日本語"},
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colours."},
        ]
    },
    # Ids below 256 exist in any vocabulary this is pointed at, the tiny model's included.
    {"prompt_token_ids": [72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100]},
)

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
VLLM_DIALECT, NVEXT_DIALECT = "vllm", "nvext"
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")


class UsageError(Exception):
    """Bad arguments, a bad prompts file or an unreachable server: exit status 2."""


@dataclass(frozen=True)
class Prompt:
    """One line of the prompts file (or a built-in prompt)."""

    number: int
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None

    @property
    def preview(self) -> str:
        if self.text is not None:
            shown = self.text
        elif self.token_ids is not None:
            shown = f"{len(self.token_ids)} ids {self.token_ids[:6]}{'...' if len(self.token_ids) > 6 else ''}"
        else:
            shown = " | ".join(str(m.get("content", "")) for m in self.messages or ())
        return shown if len(shown) <= 40 else shown[:37] + "..."


@dataclass(frozen=True)
class Case:
    """One prompt on one endpoint; `kind` names how the prompt is sent."""

    prompt: Prompt
    endpoint: str  # "chat" | "completions"
    kind: str  # "text" | "messages" | "ids" | "token_data"

    @property
    def label(self) -> str:
        return f"#{self.prompt.number} {self.endpoint} {self.kind}"


@dataclass
class Row:
    case: str
    check: str
    status: str
    detail: str = ""


@dataclass
class Outcome:
    """One request's result: the ids, or why there are none."""

    ids: TokenIds | None = None
    error: str | None = None
    status: int | None = None


@dataclass
class Target:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    send_mode_header: bool = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A/B-check that vLLM's return_token_ids dialect and Dynamo's nvext dialect return "
        "byte-identical token ids: chat and completions, unary and streamed, text and token-id prompts."
    )
    parser.epilog = "exit status: 0 all checks passed, 1 a check or request failed, 2 usage error or unreachable server"
    parser.add_argument("--url", default=DEFAULT_URL, help=f"the vllm-nvext server (default {DEFAULT_URL})")
    parser.add_argument(
        "--baseline-url",
        help="a stock vLLM server: the vLLM dialect goes there, the nvext dialect to --url",
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


def run(args: argparse.Namespace, *, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Run every check; print the table; return the exit status."""
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    try:
        return _run(args, out, err)
    except UsageError as exc:
        print(f"vllm-nvext parity: error: {exc}", file=err)
        return 2


def _run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    import httpx

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

    with httpx.Client(timeout=args.timeout) as http:
        model = _resolve_model(http, nvext_target, args.model)
        if vllm_target is not nvext_target:
            _resolve_model(http, vllm_target, model)
        cases = build_cases(prompts)
        print(
            f"vllm-nvext parity: {len(cases)} cases x 4 requests, model {model!r}, vLLM dialect -> "
            f"{vllm_target.url}, nvext dialect -> {nvext_target.url}",
            file=err,
            flush=True,
        )
        checker = _Checker(
            http, vllm_target, nvext_target, model, args.max_tokens, load_hidden_states, args.hidden_states_atol, err
        )
        checker.total = 4 * len(cases)
        for case in cases:
            checker.check_case(case)

    rows = checker.rows
    print(format_table(rows), file=out)
    counts = {s: sum(1 for r in rows if r.status == s) for s in (PASS, FAIL, SKIP)}
    verdict = "FAILED" if counts[FAIL] else "OK"
    print(
        f"\n{verdict}: {len(rows)} checks, {counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped",
        file=out,
    )
    if args.json_report is not None:
        report = {
            "passed": not counts[FAIL],
            "url": nvext_target.url,
            "baseline_url": args.baseline_url,
            "model": model,
            "max_tokens": args.max_tokens,
            "hidden_states": bool(args.hidden_states),
            "summary": {"checks": len(rows), "passed": counts[PASS], "failed": counts[FAIL], "skipped": counts[SKIP]},
            "rows": [asdict(r) for r in rows],
            "cases": checker.case_reports,
        }
        try:
            args.json_report.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        except OSError as exc:
            raise UsageError(f"cannot write the JSON report: {exc}") from exc
    return 1 if counts[FAIL] else 0


# --- prompts -----------------------------------------------------------------------------------


def builtin_prompts() -> list[Prompt]:
    return [_parse_prompt(obj, i + 1, "built-in prompt") for i, obj in enumerate(BUILTIN_PROMPTS)]


def load_prompts(path: Path) -> list[Prompt]:
    """Read a JSONL prompts file; blank lines are skipped. Raises UsageError naming the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read --prompts {path}: {exc}") from exc
    prompts: list[Prompt] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise UsageError(f"{path}:{lineno}: not JSON: {exc}") from exc
        prompts.append(_parse_prompt(obj, len(prompts) + 1, f"{path}:{lineno}"))
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def _parse_prompt(obj: Any, number: int, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object")
    unknown = set(obj) - {*_PROMPT_KEYS, "max_tokens"}
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {sorted(unknown)}; expected one of {list(_PROMPT_KEYS)}")
    given = [k for k in _PROMPT_KEYS if k in obj]
    if len(given) != 1:
        raise UsageError(f"{where}: expected exactly one of {list(_PROMPT_KEYS)}, got {given or 'none'}")
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise UsageError(f"{where}: max_tokens must be a positive integer")
    key, value = given[0], obj[given[0]]
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise UsageError(f"{where}: prompt must be a non-empty string")
        return Prompt(number, text=value, max_tokens=max_tokens)
    if key == "prompt_token_ids":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
        ):
            raise UsageError(f"{where}: prompt_token_ids must be a non-empty list of non-negative integers")
        return Prompt(number, token_ids=list(value), max_tokens=max_tokens)
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value)
    ):
        raise UsageError(f"{where}: messages must be a non-empty list of {{role, content}} objects")
    return Prompt(number, messages=list(value), max_tokens=max_tokens)


def build_cases(prompts: Sequence[Prompt]) -> list[Case]:
    cases: list[Case] = []
    for p in prompts:
        if p.text is not None:
            cases += [Case(p, "chat", "text"), Case(p, "completions", "text")]
        elif p.messages is not None:
            cases.append(Case(p, "chat", "messages"))
        else:
            # Chat has no token-id prompt in the vLLM dialect: the nvext side sends `token_data`,
            # the vLLM side the same ids to completions; skipped where token_data is not honoured.
            cases += [Case(p, "completions", "ids"), Case(p, "chat", "token_data")]
    return cases


# --- requests ----------------------------------------------------------------------------------


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if body.get("message"):
            return str(body["message"])
    return json.dumps(body)[:300]


def _resolve_model(http: httpx.Client, target: Target, wanted: str | None) -> str:
    import httpx

    try:
        response = http.get(target.url + "/v1/models", headers=target.headers)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach {target.url}: {exc}") from exc
    if response.status_code == 401:
        raise UsageError(f"{target.url} refused the request (HTTP 401): pass its key with --api-key")
    if response.status_code != 200:
        raise UsageError(f"{target.url}/v1/models answered HTTP {response.status_code}: {_error_message(response)}")
    try:
        served = [m["id"] for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{target.url}/v1/models did not list models: {exc}") from exc
    if wanted is None:
        if not served:
            raise UsageError(f"{target.url} serves no model")
        return str(served[0])
    if wanted not in served:
        raise UsageError(f"{target.url} does not serve model {wanted!r} (it serves {', '.join(served) or 'nothing'})")
    return wanted


class _Checker:
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

    # Requests -----------------------------------------------------------------------------

    def _body(self, case: Case, dialect: str, stream: bool) -> tuple[str, dict[str, Any]]:
        prompt = case.prompt
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": prompt.max_tokens or self.max_tokens,
            "temperature": 0,
        }
        if case.kind == "token_data" and dialect == VLLM_DIALECT:
            path = COMPLETIONS_PATH
            body["prompt"] = prompt.token_ids
        elif case.endpoint == "chat":
            path = CHAT_PATH
            if case.kind == "token_data":
                body["messages"] = TOKEN_DATA_PLACEHOLDER
            elif prompt.messages is not None:
                body["messages"] = prompt.messages
            else:
                body["messages"] = [{"role": "user", "content": prompt.text}]
        else:
            path = COMPLETIONS_PATH
            body["prompt"] = prompt.token_ids if prompt.token_ids is not None else prompt.text
        if dialect == VLLM_DIALECT:
            body["return_token_ids"] = True
        else:
            nvext: dict[str, Any] = {"extra_fields": ["completion_token_ids"]}
            if case.kind == "token_data":
                nvext["token_data"] = prompt.token_ids
            body["nvext"] = nvext
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return path, body

    def fetch(self, case: Case, dialect: str, stream: bool) -> Outcome:
        import httpx

        self.done += 1
        shape = "stream" if stream else "unary"
        print(f"[{self.done}/{self.total}] {case.label} {case.prompt.preview!r}: {dialect} {shape}", file=self.err)
        self.err.flush()
        target = self.targets[dialect]
        path, body = self._body(case, dialect, stream)
        headers = dict(target.headers)
        if target.send_mode_header:
            headers[MODE_HEADER] = dialect
        try:
            if not stream:
                response = self.http.post(target.url + path, json=body, headers=headers)
                if response.status_code != 200:
                    return Outcome(error=f"HTTP {response.status_code}: {_error_message(response)}",
                                   status=response.status_code)  # fmt: skip
                return Outcome(ids=extract(response.json()), status=200)
            with self.http.stream("POST", target.url + path, json=body, headers=headers) as response:
                if response.status_code != 200:
                    response.read()
                    return Outcome(error=f"HTTP {response.status_code}: {_error_message(response)}",
                                   status=response.status_code)  # fmt: skip
                content_type = response.headers.get("content-type", "")
                if not content_type.startswith("text/event-stream"):
                    return Outcome(error=f"expected text/event-stream, got {content_type!r}", status=200)
                return Outcome(ids=extract_stream(parse_sse(response.iter_bytes())), status=200)
        except httpx.HTTPError as exc:
            return Outcome(error=f"request failed: {type(exc).__name__}: {exc}")
        except (TokenIdsError, ValueError) as exc:
            return Outcome(error=str(exc), status=200)

    # Checks -------------------------------------------------------------------------------

    def _row(self, case: Case, check: str, status: str, detail: str = "") -> None:
        self.rows.append(Row(case.label, check, status, detail))

    def check_case(self, case: Case) -> None:
        report: dict[str, Any] = {"case": case.label, "prompt": case.prompt.preview, "requests": {}}
        self.case_reports.append(report)
        outcomes: dict[tuple[str, bool], Outcome] = {}
        order = [(NVEXT_DIALECT, False), (NVEXT_DIALECT, True), (VLLM_DIALECT, False), (VLLM_DIALECT, True)]
        for dialect, stream in order:
            outcome = self.fetch(case, dialect, stream)
            outcomes[(dialect, stream)] = outcome
            report["requests"][f"{dialect} {'stream' if stream else 'unary'}"] = _outcome_report(outcome)
            if (dialect, stream) == (NVEXT_DIALECT, False) and case.kind == "token_data":
                reason = self._token_data_unsupported(case, outcome)
                if reason is not None:
                    self.total -= 3  # the other three requests of this case are not sent
                    self._row(case, "nvext.token_data on chat", SKIP, reason)
                    report["skipped"] = reason
                    return

        for dialect, stream in sorted(outcomes, key=lambda k: (k[0] != VLLM_DIALECT, k[1])):
            self._request_row(case, dialect, stream, outcomes[(dialect, stream)])
        vllm_u, vllm_s = outcomes[(VLLM_DIALECT, False)].ids, outcomes[(VLLM_DIALECT, True)].ids
        nvext_u, nvext_s = outcomes[(NVEXT_DIALECT, False)].ids, outcomes[(NVEXT_DIALECT, True)].ids

        if case.prompt.token_ids is not None:
            self._compare_to_sent(case, {"vllm unary": vllm_u, "nvext unary": nvext_u})
        self._compare(case, "prompt ids: vllm == nvext", vllm_u, nvext_u, completion=False)
        self._compare(case, "completion ids: vllm == nvext", vllm_u, nvext_u, prompt=False)
        self._compare(case, "vllm: stream == unary", vllm_s, vllm_u)
        self._compare(case, "nvext: stream == unary", nvext_s, nvext_u)
        if self.load_hidden_states is not None:
            self._hidden_states(case, vllm_u, nvext_u, report)

    def _token_data_unsupported(self, case: Case, outcome: Outcome) -> str | None:
        if outcome.ids is None:
            if outcome.status is not None and 400 <= outcome.status < 500:
                return (
                    f"the server refused nvext.token_data on chat ({outcome.error}); token ids checked via completions"
                )
            return None  # a real failure: reported as such
        if outcome.ids.prompt_token_ids != case.prompt.token_ids:
            return (
                "the server does not apply nvext.token_data to chat (prompt ids came from the placeholder "
                "message); token ids checked via completions"
            )
        return None

    def _request_row(self, case: Case, dialect: str, stream: bool, outcome: Outcome) -> None:
        check = f"{dialect} {'stream' if stream else 'unary'}"
        ids = outcome.ids
        if ids is None:
            self._row(case, check, FAIL, outcome.error or "no answer")
            return
        counts = f"{_count(ids.prompt_token_ids)} prompt + {_count(_first(ids))} completion ids"
        if dialect not in ids.placements:
            found = "+".join(ids.placements)
            self._row(case, check, FAIL, f"ids under {found} placement, expected {dialect} ({counts})")
        elif ids.prompt_token_ids is None or not ids.completion_token_ids:
            missing = "prompt" if ids.prompt_token_ids is None else "completion"
            self._row(case, check, FAIL, f"no {missing} ids in the {dialect} placement")
        else:
            extra = [p for p in ids.placements if p != dialect]
            note = f"; also under {'+'.join(extra)}" if extra else ""
            self._row(case, check, PASS, f"{counts} under {dialect}{note}")

    def _compare_to_sent(self, case: Case, sides: dict[str, TokenIds | None]) -> None:
        sent = case.prompt.token_ids
        problems = []
        for name, ids in sides.items():
            if ids is None:
                continue
            diff = first_difference(ids.prompt_token_ids, sent)
            if diff is not None:
                problems.append(f"{name}: {diff} (returned != sent)")
        if not any(ids is not None for ids in sides.values()):
            self._row(case, "prompt ids == sent ids", SKIP, "no answer to compare")
        elif problems:
            self._row(case, "prompt ids == sent ids", FAIL, "; ".join(problems))
        else:
            self._row(case, "prompt ids == sent ids", PASS, f"{len(sent or ())} ids")

    def _compare(
        self,
        case: Case,
        check: str,
        a: TokenIds | None,
        b: TokenIds | None,
        *,
        prompt: bool = True,
        completion: bool = True,
    ) -> None:
        if a is None or b is None:
            self._row(case, check, SKIP, "a request failed (see above)")
            return
        problems = []
        if prompt:
            diff = first_difference(a.prompt_token_ids, b.prompt_token_ids)
            if diff is not None:
                problems.append(f"prompt ids {diff}")
        if completion:
            diff = first_difference(_first(a), _first(b))
            if diff is not None:
                problems.append(f"completion ids {diff}")
        if problems:
            self._row(case, check, FAIL, "; ".join(problems))
            return
        parts = []
        if prompt:
            parts.append(f"{_count(a.prompt_token_ids)} prompt")
        if completion:
            parts.append(f"{_count(_first(a))} completion")
        self._row(case, check, PASS, " + ".join(parts) + " ids identical")

    def _hidden_states(
        self, case: Case, vllm_ids: TokenIds | None, nvext_ids: TokenIds | None, report: dict[str, Any]
    ) -> None:
        assert self.load_hidden_states is not None
        loaded: dict[str, Any] = {}
        problems = []
        for name, ids in ((VLLM_DIALECT, vllm_ids), (NVEXT_DIALECT, nvext_ids)):
            if ids is None:
                continue
            path = (ids.kv_transfer_params or {}).get("hidden_states_path")
            if not path:
                problems.append(
                    f"{name}: no kv_transfer_params.hidden_states_path (is a hidden-states connector configured?)"
                )
                continue
            try:
                loaded[name] = self.load_hidden_states(path, expect_token_ids=ids.prompt_token_ids)
            except Exception as exc:  # HiddenStatesError, or anything torch raises
                problems.append(f"{name}: {exc}")
        if vllm_ids is None or nvext_ids is None:
            self._row(case, "hidden states load", SKIP, "a request failed (see above)")
            return
        if problems:
            self._row(case, "hidden states load", FAIL, "; ".join(problems))
            return
        shapes = {name: list(hs.hidden_states.shape) for name, hs in loaded.items()}
        report["hidden_states"] = {name: {"path": hs.path, "shape": shapes[name]} for name, hs in loaded.items()}
        self._row(case, "hidden states load", PASS, f"shape {shapes[VLLM_DIALECT]}, ids == prompt ids")
        a, b = loaded[VLLM_DIALECT].hidden_states, loaded[NVEXT_DIALECT].hidden_states
        if shapes[VLLM_DIALECT] != shapes[NVEXT_DIALECT]:
            self._row(case, "hidden states equal", FAIL, f"shapes {shapes[VLLM_DIALECT]} != {shapes[NVEXT_DIALECT]}")
            return
        max_diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        report["hidden_states"]["max_abs_diff"] = max_diff
        status = PASS if max_diff <= self.atol else FAIL
        self._row(case, "hidden states equal", status, f"max abs diff {max_diff:.3g} (atol {self.atol:g})")


def _first(ids: TokenIds) -> list[int] | None:
    return ids.completion_token_ids[0] if ids.completion_token_ids else None


def _count(values: Sequence[Any] | None) -> str:
    return "no" if values is None else str(len(values))


def _outcome_report(outcome: Outcome) -> dict[str, Any]:
    if outcome.ids is None:
        return {"error": outcome.error, "status": outcome.status}
    ids = outcome.ids
    return {
        "placement": ids.placement,
        "placements": list(ids.placements),
        "prompt_token_ids": ids.prompt_token_ids,
        "completion_token_ids": ids.completion_token_ids,
        "kv_transfer_params": ids.kv_transfer_params,
        "finish_reasons": ids.finish_reasons,
    }


def _hidden_states_loader() -> Callable[..., Any]:
    try:
        from . import hidden_states
    except ImportError as exc:  # pragma: no cover - the module itself imports only the stdlib
        raise UsageError(f"--hidden-states needs vllm_nvext.hidden_states: {exc}") from exc
    try:
        import safetensors  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        raise UsageError(f"--hidden-states needs torch and safetensors installed: {exc}") from exc
    return hidden_states.load


def format_table(rows: Sequence[Row]) -> str:
    """Rows as an aligned text table: CASE, CHECK, RESULT, DETAIL."""
    header = Row("CASE", "CHECK", "RESULT", "DETAIL")
    widths = [max(len(getattr(r, f)) for r in (header, *rows)) for f in ("case", "check", "status")]
    lines = []
    for r in (header, *rows):
        lines.append(f"{r.case:<{widths[0]}}  {r.check:<{widths[1]}}  {r.status:<{widths[2]}}  {r.detail}".rstrip())
    return "\n".join(lines)

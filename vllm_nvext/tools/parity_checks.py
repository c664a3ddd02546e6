"""The pure part of `vllm-nvext parity`: prompts, the request matrix, and the verdicts.

Nothing here does I/O: `parity.py` sends the requests this module describes, reads each answer
into an `Outcome` with `vllm_nvext.client`, and prints the `Row`s the verdicts return. Streams
are judged by their per-choice concatenations (`client.extract_stream`), never by where the
server cut its chunks, which depends on timing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..client import TokenIds, TokenIdsError, extract, extract_stream, parse_sse
from ..outbound.shapes import first_difference
from ..protocol import COMPLETION_TOKEN_IDS, PATHS, Dialect, Endpoint

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
VLLM_DIALECT, NVEXT_DIALECT = Dialect.VLLM.value, Dialect.NVEXT.value
# The four requests of a case, in the order they are sent: the nvext unary answer comes first
# because it decides whether a `token_data` case is supported at all.
REQUESTS: tuple[tuple[str, bool], ...] = (
    (NVEXT_DIALECT, False),
    (NVEXT_DIALECT, True),
    (VLLM_DIALECT, False),
    (VLLM_DIALECT, True),
)
# Dynamo's chat clients send a placeholder message next to `nvext.token_data` (docs/protocol.md §3.1).
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


# --- prompts -----------------------------------------------------------------------------------


def builtin_prompts() -> list[Prompt]:
    return [parse_prompt(obj, i + 1, "built-in prompt") for i, obj in enumerate(BUILTIN_PROMPTS)]


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
        prompts.append(parse_prompt(obj, len(prompts) + 1, f"{path}:{lineno}"))
    if not prompts:
        raise UsageError(f"{path}: no prompts")
    return prompts


def parse_prompt(obj: Any, number: int, where: str) -> Prompt:
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


# --- the request matrix ------------------------------------------------------------------------


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


def request_body(case: Case, dialect: str, stream: bool, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one of the case's four requests: greedy, in `dialect`'s opt-in."""
    prompt = case.prompt
    body: dict[str, Any] = {"model": model, "max_tokens": prompt.max_tokens or max_tokens, "temperature": 0}
    if case.kind == "token_data" and dialect == VLLM_DIALECT:
        endpoint = Endpoint.COMPLETIONS
        body["prompt"] = prompt.token_ids
    elif case.endpoint == "chat":
        endpoint = Endpoint.CHAT
        if case.kind == "token_data":
            body["messages"] = TOKEN_DATA_PLACEHOLDER
        elif prompt.messages is not None:
            body["messages"] = prompt.messages
        else:
            body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        endpoint = Endpoint.COMPLETIONS
        body["prompt"] = prompt.token_ids if prompt.token_ids is not None else prompt.text
    if dialect == VLLM_DIALECT:
        body["return_token_ids"] = True
    else:
        nvext: dict[str, Any] = {"extra_fields": [COMPLETION_TOKEN_IDS]}
        if case.kind == "token_data":
            nvext["token_data"] = prompt.token_ids
        body["nvext"] = nvext
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return PATHS[endpoint], body


def read_answer(status: int, content_type: str, body: bytes | Iterable[bytes], stream: bool) -> Outcome:
    """One answer as an Outcome: its ids, or the server's error message, or why it holds no ids.

    `body` is the whole body, or (streams) its chunks as they arrive, split anywhere.
    """
    if status != 200:
        return Outcome(error=f"HTTP {status}: {error_message(_joined(body))}", status=status)
    try:
        if not stream:
            return Outcome(ids=extract(json.loads(_joined(body))), status=200)
        if not content_type.startswith("text/event-stream"):
            return Outcome(error=f"expected text/event-stream, got {content_type!r}", status=200)
        return Outcome(ids=extract_stream(parse_sse(body)), status=200)
    except (TokenIdsError, ValueError) as exc:
        return Outcome(error=str(exc), status=200)


def error_message(body: bytes) -> str:
    """The message of an error body: vLLM's `error.message`, Dynamo's flat `message`, else the text."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace")
    if isinstance(obj, dict):
        error = obj.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if obj.get("message"):
            return str(obj["message"])
    return json.dumps(obj)[:300]


def _joined(body: bytes | Iterable[bytes]) -> bytes:
    return body if isinstance(body, bytes) else b"".join(body)


# --- verdicts over the outcomes ----------------------------------------------------------------


def token_data_unsupported(case: Case, nvext_unary: Outcome) -> str | None:
    """Why a `token_data` case is skipped after its first answer, or None to go on with it."""
    if case.kind != "token_data":
        return None
    if nvext_unary.ids is None:
        if nvext_unary.status is not None and 400 <= nvext_unary.status < 500:
            return (
                f"the server refused nvext.token_data on chat ({nvext_unary.error}); token ids checked via completions"
            )
        return None  # a real failure: reported as such
    if nvext_unary.ids.prompt_token_ids != case.prompt.token_ids:
        return (
            "the server does not apply nvext.token_data to chat (prompt ids came from the placeholder "
            "message); token ids checked via completions"
        )
    return None


def judge_case(case: Case, outcomes: Mapping[tuple[str, bool], Outcome]) -> list[Row]:
    """The rows for one case whose four requests were all answered (or failed)."""
    rows = [
        request_row(case, dialect, stream, outcomes[(dialect, stream)])
        for dialect, stream in sorted(outcomes, key=lambda k: (k[0] != VLLM_DIALECT, k[1]))
    ]
    vllm_u, vllm_s = outcomes[(VLLM_DIALECT, False)].ids, outcomes[(VLLM_DIALECT, True)].ids
    nvext_u, nvext_s = outcomes[(NVEXT_DIALECT, False)].ids, outcomes[(NVEXT_DIALECT, True)].ids
    if case.prompt.token_ids is not None:
        rows.append(compare_to_sent(case, {"vllm unary": vllm_u, "nvext unary": nvext_u}))
    rows.append(compare(case, "prompt ids: vllm == nvext", vllm_u, nvext_u, completion=False))
    rows.append(compare(case, "completion ids: vllm == nvext", vllm_u, nvext_u, prompt=False))
    rows.append(compare(case, "vllm: stream == unary", vllm_s, vllm_u))
    rows.append(compare(case, "nvext: stream == unary", nvext_s, nvext_u))
    return rows


def request_row(case: Case, dialect: str, stream: bool, outcome: Outcome) -> Row:
    """PASS when the request succeeded with prompt and completion ids in `dialect`'s placement."""
    check = f"{dialect} {'stream' if stream else 'unary'}"
    ids = outcome.ids
    if ids is None:
        return Row(case.label, check, FAIL, outcome.error or "no answer")
    counts = f"{_count(ids.prompt_token_ids)} prompt + {_count(first_choice(ids))} completion ids"
    if dialect not in ids.placements:
        found = "+".join(ids.placements)
        return Row(case.label, check, FAIL, f"ids under {found} placement, expected {dialect} ({counts})")
    if ids.prompt_token_ids is None or not ids.completion_token_ids:
        missing = "prompt" if ids.prompt_token_ids is None else "completion"
        return Row(case.label, check, FAIL, f"no {missing} ids in the {dialect} placement")
    extra = [p for p in ids.placements if p != dialect]
    note = f"; also under {'+'.join(extra)}" if extra else ""
    return Row(case.label, check, PASS, f"{counts} under {dialect}{note}")


def compare_to_sent(case: Case, sides: Mapping[str, TokenIds | None]) -> Row:
    """The prompt ids each answer reports equal the token-id prompt that was sent."""
    check = "prompt ids == sent ids"
    sent = case.prompt.token_ids
    problems = []
    for name, ids in sides.items():
        if ids is None:
            continue
        diff = first_difference(ids.prompt_token_ids, sent)
        if diff is not None:
            problems.append(f"{name}: {diff} (returned != sent)")
    if not any(ids is not None for ids in sides.values()):
        return Row(case.label, check, SKIP, "no answer to compare")
    if problems:
        return Row(case.label, check, FAIL, "; ".join(problems))
    return Row(case.label, check, PASS, f"{len(sent or ())} ids")


def compare(
    case: Case,
    check: str,
    a: TokenIds | None,
    b: TokenIds | None,
    *,
    prompt: bool = True,
    completion: bool = True,
) -> Row:
    """Two answers' prompt and/or first-choice completion ids are identical; SKIP if one is missing."""
    if a is None or b is None:
        return Row(case.label, check, SKIP, "a request failed (see above)")
    problems = []
    if prompt:
        diff = first_difference(a.prompt_token_ids, b.prompt_token_ids)
        if diff is not None:
            problems.append(f"prompt ids {diff}")
    if completion:
        diff = first_difference(first_choice(a), first_choice(b))
        if diff is not None:
            problems.append(f"completion ids {diff}")
    if problems:
        return Row(case.label, check, FAIL, "; ".join(problems))
    parts = []
    if prompt:
        parts.append(f"{_count(a.prompt_token_ids)} prompt")
    if completion:
        parts.append(f"{_count(first_choice(a))} completion")
    return Row(case.label, check, PASS, " + ".join(parts) + " ids identical")


# --- reporting ---------------------------------------------------------------------------------


def first_choice(ids: TokenIds) -> list[int] | None:
    return ids.completion_token_ids[0] if ids.completion_token_ids else None


def _count(values: Sequence[Any] | None) -> str:
    return "no" if values is None else str(len(values))


def outcome_report(outcome: Outcome) -> dict[str, Any]:
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


def counts(rows: Sequence[Row]) -> dict[str, int]:
    """How many rows passed, failed and were skipped."""
    return {s: sum(1 for r in rows if r.status == s) for s in (PASS, FAIL, SKIP)}


def format_table(rows: Sequence[Row]) -> str:
    """Rows as an aligned text table: CASE, CHECK, RESULT, DETAIL."""
    header = Row("CASE", "CHECK", "RESULT", "DETAIL")
    widths = [max(len(getattr(r, f)) for r in (header, *rows)) for f in ("case", "check", "status")]
    lines = []
    for r in (header, *rows):
        lines.append(f"{r.case:<{widths[0]}}  {r.check:<{widths[1]}}  {r.status:<{widths[2]}}  {r.detail}".rstrip())
    return "\n".join(lines)

"""`vllm-nvext parity --dynamo-url`: a Dynamo frontend as the baseline.

Each case of the conformance matrix (`dynamo_conformance.cases`) goes as the same bytes to Dynamo and to
`--url` (nvext mode); `judge_dynamo_case` (pure) passes a case when the two answers agree up to the
differences `dynamo_differences` allows, and `run_dynamo` sends the cases and reports them as `parity.py`
reports its own checks (the table, the verdict, the JSON report).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any, TextIO

from ..config import MODE_HEADER
from . import dynamo_conformance
from .parity_checks import FAIL, NVEXT_DIALECT, PASS, Row, UsageError
from .parity_run import Target, conclude, resolve_model

if TYPE_CHECKING:
    import httpx

DYNAMO_CHECK = "nvext == Dynamo"


def read_conformance_answer(status: int, content: bytes, stream: bool) -> dynamo_conformance.Answer | str:
    """One server's reply to a conformance case, or why it cannot be compared."""
    try:
        return dynamo_conformance.parse_answer(status, content, stream)
    except dynamo_conformance.AnswerError as exc:
        return f"HTTP {status}, {exc}"


def judge_dynamo_case(
    case: dynamo_conformance.Case,
    dynamo: dynamo_conformance.Answer | str,
    ours: dynamo_conformance.Answer | str,
) -> tuple[Row, list[str]]:
    """One conformance case: PASS when the answers agree up to the allowed differences
    (`vllm_nvext.tools.dynamo_differences`), else FAIL naming the first difference; also every difference.

    A side given as a string failed (the request, or reading its answer): that is the difference.
    """
    if isinstance(dynamo, str) or isinstance(ours, str):
        differences = [f"Dynamo: {dynamo}"] if isinstance(dynamo, str) else []
        differences += [f"vllm-nvext: {ours}"] if isinstance(ours, str) else []
    else:
        differences = dynamo_conformance.unexplained_differences(case, dynamo, ours)
    if not differences:
        assert not isinstance(dynamo, str) and not isinstance(ours, str)
        if dynamo.status == ours.status:
            detail = f"HTTP {ours.status} both"
        else:  # an allowed refusal
            detail = f"HTTP {dynamo.status} Dynamo, {ours.status} vllm-nvext (allowed)"
        return Row(case.name, DYNAMO_CHECK, PASS, detail), differences
    more = f" (+{len(differences) - 1} more)" if len(differences) > 1 else ""
    return Row(case.name, DYNAMO_CHECK, FAIL, differences[0] + more), differences


def run_dynamo(args: argparse.Namespace, out: TextIO, err: TextIO, transport: httpx.BaseTransport | None) -> int:
    import httpx

    for flag, given in (("--prompts", args.prompts is not None), ("--hidden-states", args.hidden_states)):
        if given:
            raise UsageError(f"{flag} does not apply with --dynamo-url (it runs the conformance cases)")
    auth = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    nvext_target = Target(args.url.rstrip("/"), {**auth, MODE_HEADER: NVEXT_DIALECT})
    dynamo_target = Target(args.dynamo_url.rstrip("/"), send_mode_header=False)  # Dynamo has no key
    rows: list[Row] = []
    case_reports: list[dict[str, Any]] = []
    with httpx.Client(timeout=args.timeout, transport=transport) as http:
        model = resolve_model(http, nvext_target, args.model)
        resolve_model(http, dynamo_target, model)
        cases = dynamo_conformance.cases(model)
        print(
            f"vllm-nvext parity: {len(cases)} conformance cases, model {model!r}, Dynamo {dynamo_target.url} "
            f"vs vllm-nvext {nvext_target.url} (nvext mode)",
            file=err,
            flush=True,
        )
        for number, case in enumerate(cases, 1):
            print(f"[{number}/{len(cases)}] {case.name}", file=err, flush=True)
            dynamo, dynamo_body = _exchange(http, dynamo_target, case)
            ours, our_body = _exchange(http, nvext_target, case)
            row, differences = judge_dynamo_case(case, dynamo, ours)
            rows.append(row)
            case_report: dict[str, Any] = {
                "case": case.name,
                "path": case.path,
                "request": case.body,
                "status": {"dynamo": _status_of(dynamo), "nvext": _status_of(ours)},
                "result": row.status,
                "differences": differences,
            }
            if differences:  # what each server said, to look into the difference afterwards
                case_report["bodies"] = {"dynamo": _body_text(dynamo_body), "nvext": _body_text(our_body)}
            case_reports.append(case_report)

    report = {"url": nvext_target.url, "dynamo_url": dynamo_target.url, "model": model}
    summary = "{checks} cases, {passed} agree, {failed} differ"
    return conclude(rows, case_reports, summary, report, args.json_report, out)


def _exchange(
    http: httpx.Client, target: Target, case: dynamo_conformance.Case
) -> tuple[dynamo_conformance.Answer | str, bytes | None]:
    """POST the case's exact bytes; the answer, or why there is none, and the body as it came (None: no reply)."""
    import httpx

    headers = {"content-type": "application/json", **target.headers}
    try:
        response = http.post(target.url + case.path, content=case.content(), headers=headers)
    except httpx.HTTPError as exc:
        return f"request failed: {type(exc).__name__}: {exc}", None
    return read_conformance_answer(response.status_code, response.content, case.stream), response.content


_BODY_TEXT_MAX = 65536


def _body_text(body: bytes | None) -> str | None:
    """A reply body for the JSON report: its text (undecodable bytes replaced), cut at 64 KiB."""
    if body is None:
        return None
    text = body[:_BODY_TEXT_MAX].decode("utf-8", "replace")
    return text + ("\n[... cut at 64 KiB]" if len(body) > _BODY_TEXT_MAX else "")


def _status_of(answer: dynamo_conformance.Answer | str) -> int | str:
    return answer if isinstance(answer, str) else answer.status

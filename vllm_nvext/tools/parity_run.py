"""What both parity runs share (`parity.py` against vLLM's own answers, `parity_dynamo.py` against a Dynamo
frontend): the server a run checks (`Target`, `resolve_model`) and the run's verdict (`conclude`: the table, the
verdict line, the JSON report).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from .parity_checks import FAIL, PASS, SKIP, Row, UsageError, counts, error_message, format_table

if TYPE_CHECKING:
    import httpx


@dataclass
class Target:
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    send_mode_header: bool = True


def conclude(
    rows: list[Row], cases: list[dict[str, Any]], summary: str, report: dict[str, Any], path: Any, out: TextIO
) -> int:
    """Print the table and the verdict, write the JSON report when asked; the exit status."""
    print(format_table(rows), file=out)
    tally = counts(rows)
    totals = {"checks": len(rows), "passed": tally[PASS], "failed": tally[FAIL], "skipped": tally[SKIP]}
    print(f"\n{'FAILED' if tally[FAIL] else 'OK'}: {summary.format(**totals)}", file=out)
    if path is not None:
        rows_out = [asdict(r) for r in rows]
        _write_report(path, {"passed": not tally[FAIL], **report, "summary": totals, "rows": rows_out, "cases": cases})
    return 1 if tally[FAIL] else 0


def _write_report(path: Path, report: dict[str, Any]) -> None:
    try:
        path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    except OSError as exc:
        raise UsageError(f"cannot write the JSON report: {exc}") from exc


def resolve_model(http: httpx.Client, target: Target, wanted: str | None) -> str:
    import httpx

    try:
        response = http.get(target.url + "/v1/models", headers=target.headers)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach {target.url}: {exc}") from exc
    if response.status_code == 401:
        raise UsageError(f"{target.url} refused the request (HTTP 401): pass its key with --api-key")
    if response.status_code != 200:
        raise UsageError(
            f"{target.url}/v1/models answered HTTP {response.status_code}: {error_message(response.content)}"
        )
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

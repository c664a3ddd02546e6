"""A Dynamo client cannot tell vllm-nvext from a real NVIDIA Dynamo 1.6.1 by its `nvext` answers.

The same request bytes go to a real Dynamo (its frontend + its `dynamo.vllm` worker on the same
vLLM and tiny model, tests/e2e/dynamo_reference.py) and to `vllm serve` + vllm-nvext (in `nvext`
mode and in `auto` mode). Per case the answers are reduced to what an nvext client can rely on:
status; per stream, which `nvext` keys (in order) ride on which kind of chunk -- judged by the
chunk's own content (a delta, a choice's finish chunk, the usage-only chunk), never by where
chunk boundaries fall; key order inside `nvext`, `engine_data` and `timing`; JSON types; and the
values that must agree (all ids, prompt ids, logprobs, stop_reason, finish reasons). Every
remaining difference must be on the allow-list in `vllm_nvext.tools.dynamo_differences`, which is also
the table of docs/dynamo-differences.md; a new difference fails. The case matrix and
the comparison live in `vllm_nvext.tools.dynamo_conformance` (`vllm-nvext parity --dynamo-url` runs them
against a user's servers).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from vllm_nvext.tools import dynamo_differences
from vllm_nvext.tools.dynamo_conformance import Answer, Case, cases, parse_answer, unexplained_differences

pytestmark = pytest.mark.e2e

CASES = cases("tiny")


def exchange(client: httpx.Client, case: Case, headers: dict[str, str] | None = None) -> Answer:
    """POST the case's exact bytes; a stream is read as its `data:` JSON events."""
    resp = client.post(
        case.path, content=case.content(), headers={"content-type": "application/json", **(headers or {})}
    )
    if resp.status_code == 200 and case.stream:
        assert resp.content.endswith(b"data: [DONE]\n\n"), "a stream ends with [DONE]"
    return parse_answer(resp.status_code, resp.content, case.stream)


# --- the test ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dynamo_pair(dynamo_server: Any, nvext_dynamo_server: Any) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    with (
        httpx.Client(base_url=dynamo_server.url, timeout=120.0) as dyn,
        httpx.Client(base_url=nvext_dynamo_server.url, timeout=120.0) as ours,
    ):
        yield dyn, ours


@pytest.mark.parametrize("mode", ["nvext", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nvext_answer_matches_dynamo(dynamo_pair: tuple[httpx.Client, httpx.Client], case: Case, mode: str) -> None:
    dyn, ours = dynamo_pair
    dynamo_answer = exchange(dyn, case)
    assert dynamo_answer.status in (200, 400), f"the reference Dynamo failed: {dynamo_answer.body}"
    ours_answer = exchange(ours, case, {"x-nvext-mode": mode})
    unexplained = unexplained_differences(case, dynamo_answer, ours_answer)
    assert not unexplained, (
        f"{case.name} ({mode} mode) differs from Dynamo {dynamo_differences.DYNAMO_VERSION} in ways "
        "vllm_nvext/tools/dynamo_differences.py does not list:\n" + "\n".join(unexplained)
    )

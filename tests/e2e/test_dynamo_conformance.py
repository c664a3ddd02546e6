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

import json
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


# --- the agent routes: what Dynamo answers there (difference `agent-routes`) ---------------------------
# Not compared body for body with vllm-nvext (tests/e2e/test_agent_routes.py proves its side): this
# holds Dynamo to what the difference records, so that a Dynamo that changes fails here.

AGENT_TEXT = "Tell me about token ids."
AGENT_BODIES = {
    "/v1/responses": {"model": "tiny", "input": AGENT_TEXT, "max_output_tokens": 8, "temperature": 0},
    "/v1/messages": {
        "model": "tiny",
        "messages": [{"role": "user", "content": AGENT_TEXT}],
        "max_tokens": 8,
        "temperature": 0,
    },
}
ID_KEYS = {"nvext", "token_ids", "prompt_token_ids", "completion_token_ids", "tokens", "input_messages"}


def _agent_answer(client: httpx.Client, path: str, extra: dict[str, Any], stream: bool) -> tuple[int, list[Any]]:
    """Status and the JSON objects answered: the body, or each `data:` event of a stream."""
    resp = client.post(path, json={**AGENT_BODIES[path], **extra, **({"stream": True} if stream else {})})
    if resp.status_code != 200 or not stream:
        return resp.status_code, [resp.json()]
    lines = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    return resp.status_code, [json.loads(line) for line in lines]


def _keys(obj: Any) -> set[str]:
    if isinstance(obj, list):
        return set().union(*map(_keys, obj)) if obj else set()
    if isinstance(obj, dict):
        return set(obj).union(*map(_keys, obj.values()))
    return set()


@pytest.fixture(scope="module")
def dynamo(dynamo_server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dynamo_server.url, timeout=120.0) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_dynamo_responses_refuses_completion_ids_and_ignores_return_token_ids(dynamo, stream):
    assert any(d.id == "agent-routes" for d in dynamo_differences.DIFFERENCES)
    status, (refusal, *_) = _agent_answer(
        dynamo, "/v1/responses", {"nvext": {"extra_fields": ["completion_token_ids"]}}, stream
    )
    assert status == 501 and refusal["type"] == "Not Implemented"
    assert "not supported by the Responses API" in refusal["message"]
    for extra in ({}, {"return_token_ids": True}):
        status, objects = _agent_answer(dynamo, "/v1/responses", extra, stream)
        assert status == 200 and objects and not _keys(objects) & ID_KEYS, extra


def test_dynamo_responses_answers_other_selectors_in_a_root_nvext(dynamo):
    status, (answer,) = _agent_answer(dynamo, "/v1/responses", {"nvext": {"extra_fields": ["prompt_token_ids"]}}, False)
    assert status == 200 and list(answer["nvext"]) == ["prompt_token_ids"]
    assert answer["nvext"]["prompt_token_ids"] and all(isinstance(i, int) for i in answer["nvext"]["prompt_token_ids"])
    for selector in ("timing", "worker_id"):
        status, (answer,) = _agent_answer(dynamo, "/v1/responses", {"nvext": {"extra_fields": [selector]}}, False)
        assert status == 200 and list(answer["nvext"]) == [selector]


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(
    "extra",
    [{}, {"nvext": {"extra_fields": ["completion_token_ids", "prompt_token_ids"]}}, {"return_token_ids": True}],
    ids=["opt-out", "nvext", "return_token_ids"],
)
def test_dynamo_messages_answers_no_ids_whatever_is_asked(dynamo, extra, stream):
    status, objects = _agent_answer(dynamo, "/v1/messages", extra, stream)
    assert status == 200
    kinds = [o.get("type") for o in objects]
    assert (kinds[0], kinds[-1]) == (("message_start", "message_stop") if stream else ("message", "message"))
    assert not _keys(objects) & ID_KEYS

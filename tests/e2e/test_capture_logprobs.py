"""VLLM_NVEXT_CAPTURE_LOGPROBS (docs/capture.md, Logprobs) on vLLM 0.32's real engine, both mounts.

With the setting on, every captured turn of a chat, completions, `/v1/responses` and `/v1/messages` session records
one logprob per completion id, and each client gets, byte for byte but for the ids and times vLLM makes anew per
request, what a stock server (capture_stock: the same arguments, no vllm-nvext) answers the same request. Marker
e2e_parser: the capture servers' group.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from typing import Any

import httpx
import pytest

from tests.e2e.capture_loops import claude_code_against_stock, codex_against_stock, session_turns
from tests.helpers import API_KEY, CHAT, COMPLETIONS, MODEL_NAME, sse_events, stream_digest, without_agent_volatile

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_parser]
RESPONSES = "/v1/responses"
# What vLLM makes anew per request: ids (`chatcmpl-...`, `resp_...`, `msg_...`) and times.
_IDS = re.compile(rb'"(id|item_id|response_id)":"[^"]*"')
_TIMES = re.compile(rb'"(created|created_at|completed_at)":[0-9.]+')


def _masked(body: bytes) -> list[bytes]:
    """The body's events (a unary body: one) with what vLLM makes anew per request masked."""
    return _TIMES.sub(rb'"\1":0', _IDS.sub(rb'"\1":""', body)).split(b"\n\n")


def _same_answer(path: str, stream: bool, got: bytes, stock: bytes) -> None:
    """`got` is the stock answer: a unary body byte for byte (but for ids and times); a stream, with its chunking
    forgotten (vLLM cuts a stream where its API server lags, and at each token with no text yet where ids or
    logprobs are on): chat and completions by `stream_digest`, a Responses stream by its events less the text
    deltas, which are compared concatenated, logprobs included."""
    if not stream:
        assert _masked(got) == _masked(stock), "the stock server's answer, byte for byte"
    elif path != RESPONSES:
        assert stream_digest(sse_events(got)) == stream_digest(sse_events(stock)), "the stock server's stream"
    else:
        events, stock_events = (without_agent_volatile(_responses_events(body)) for body in (got, stock))
        assert _text_deltas(events) == _text_deltas(stock_events), "the stock server's text and its logprobs"
        assert _other_events(events) == _other_events(stock_events), "the stock server's other events"


def _responses_events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: ")]


def _text_deltas(events: list[dict[str, Any]]) -> tuple[str, list[Any]]:
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    return "".join(e["delta"] for e in deltas), [lp for e in deltas for lp in e["logprobs"]]


def _other_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k not in ("sequence_number", "item_id")} for e in events
            if e["type"] != "response.output_text.delta"]  # fmt: skip


def _request(path: str, stream: bool, **extra: Any) -> dict[str, Any]:
    prompt: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Hello"}]}
        if path == CHAT
        else {"prompt": "Hello"}
        if path == COMPLETIONS
        else {"input": "Hello", "max_output_tokens": 8}
    )
    tokens = {} if path == RESPONSES else {"max_tokens": 8}
    return {"model": MODEL_NAME, **prompt, **tokens, "temperature": 0, "stream": stream, **extra}


def _both(captured: Any, stock: Any, path: str, body: dict[str, Any], session_id: str) -> tuple[bytes, bytes]:
    """The same request to the capturing server (in session `session_id`) and to the stock one: their bodies."""
    headers = {"Authorization": f"Bearer {API_KEY}", "x-nvext-session-id": session_id}
    answers = []
    for server in (captured, stock):
        with httpx.Client(base_url=server.url, headers=headers, timeout=120) as client:
            answer = client.post(path, json=body)
        assert answer.status_code == 200, answer.text
        answers.append(answer.content)
    return answers[0], answers[1]


def _one_logprob_per_id(turn: dict[str, Any], vllm_drops_some: bool = False) -> None:
    """One logprob per id; with `vllm_drops_some` (a /v1/responses stream: vLLM 0.32 leaves out the logprobs of
    the tokens that made no text yet, docs/capture.md) `null` where it did, never a list of another length."""
    ids, logprobs = turn["completion_token_ids"], turn["logprobs"]
    assert ids, f"{turn['route']}: the turn's ids"
    if vllm_drops_some and logprobs is None:
        return
    assert logprobs is not None and len(logprobs) == len(ids), f"{turn['route']}: one logprob per id, got {logprobs}"
    assert all(isinstance(v, float) and v <= 0.0 and math.isfinite(v) for v in logprobs)


CASES = [(path, stream) for path in (CHAT, COMPLETIONS, RESPONSES) for stream in (False, True)]


@pytest.mark.parametrize(("path", "stream"), CASES, ids=[f"{p.rsplit('/', 1)[-1]}-{s}" for p, s in CASES])
def test_a_client_that_asks_for_no_logprobs_gets_stock_bytes_and_the_turn_has_one_logprob_per_id(
    path, stream, capture_logprobs_server, capture_stock_server
):
    session_id = f"logprobs-{uuid.uuid4()}"
    got, stock = _both(capture_logprobs_server, capture_stock_server, path, _request(path, stream), session_id)
    _same_answer(path, stream, got, stock)
    assert b'"logprob":' not in got, "no logprob the client did not ask for"
    (turn,) = session_turns(capture_logprobs_server, session_id, 1)
    assert turn["route"] == path
    _one_logprob_per_id(turn, vllm_drops_some=path == RESPONSES and stream)


ASKED = {
    CHAT: {"logprobs": True, "top_logprobs": 2},
    COMPLETIONS: {"logprobs": 2},
    RESPONSES: {"include": ["message.output_text.logprobs"], "top_logprobs": 2},
}


@pytest.mark.parametrize(("path", "stream"), CASES, ids=[f"{p.rsplit('/', 1)[-1]}-{s}" for p, s in CASES])
def test_a_client_that_asks_for_logprobs_gets_them_as_stock_gives_them(
    path, stream, capture_logprobs_server, capture_stock_server
):
    session_id = f"logprobs-asked-{uuid.uuid4()}"
    body = _request(path, stream, **ASKED[path])
    got, stock = _both(capture_logprobs_server, capture_stock_server, path, body, session_id)
    _same_answer(path, stream, got, stock)
    assert b'"top_logprobs":[{' in got or b'"top_logprobs":{' in got, "the top logprobs it asked for"
    (turn,) = session_turns(capture_logprobs_server, session_id, 1)
    _one_logprob_per_id(turn, vllm_drops_some=path == RESPONSES and stream)


def test_every_turn_of_a_codex_loop_has_one_logprob_per_id_or_null_and_the_client_gets_stock_answers(
    capture_logprobs_server, capture_stock_server
):
    turns, expected = codex_against_stock(capture_logprobs_server, capture_stock_server, f"codex-lp-{uuid.uuid4()}")
    assert [(t["completion_token_ids"], t["prompt_token_ids"]) for t in turns] == expected
    for turn in turns:
        _one_logprob_per_id(turn, vllm_drops_some=True)  # Codex streams


def test_every_turn_of_a_claude_code_loop_has_one_logprob_per_id_and_the_client_gets_stock_answers(
    capture_logprobs_server, capture_stock_server
):
    session_id = f"claude-lp-{uuid.uuid4()}"
    turns, expected = claude_code_against_stock(capture_logprobs_server, capture_stock_server, session_id)
    assert [(t["completion_token_ids"], t["prompt_token_ids"]) for t in turns] == expected
    for turn in turns:
        _one_logprob_per_id(turn)

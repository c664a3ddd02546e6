"""Operator capture (docs/capture.md) on vLLM 0.32's real engine, both mounts.

A Codex-shaped loop (`/v1/responses`, streamed, tools, a tool call and its result fed back) and a
Claude-Code-shaped one (`/v1/messages`, streamed, tools, a tool_use and its tool_result), three turns
each, sent by the real OpenAI and Anthropic SDKs with no field of vllm-nvext's, to servers with capture
on: every client gets what a stock server (same arguments, no vllm-nvext) answers, and the session read
back through the read API holds, turn by turn, the ids `/v1/chat/completions` with `return_token_ids`
gives for the same conversation (the loops: tests/e2e/capture_loops.py). Marker e2e_parser: the parser
group's run (three tiny servers).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.capture_loops import (
    assert_continue_ids_against_plain,
    claude_code_against_stock,
    claude_code_loop,
    codex_against_stock,
    codex_loop,
    session_turns,
)
from tests.helpers import CHAT, MODEL_NAME, http_client

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_parser]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "conversations"


@pytest.fixture(params=["capture_mw", "capture_plugin"])
def captured(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_server")


def test_a_codex_loop_is_captured_with_chats_ids_and_the_client_gets_stock_answers(captured, capture_stock_server):
    turns, expected = codex_against_stock(captured, capture_stock_server, f"codex-{uuid.uuid4()}")
    assert [t["index"] for t in turns] == [0, 1, 2]
    assert {(t["route"], t["session_source"]) for t in turns} == {("/v1/responses", "session_id")}
    assert [(t["completion_token_ids"], t["prompt_token_ids"]) for t in turns] == expected


def test_a_claude_code_loop_is_captured_with_chats_ids_and_the_client_gets_stock_answers(
    capture_plugin_server, capture_stock_server
):
    turns, expected = claude_code_against_stock(capture_plugin_server, capture_stock_server, f"claude-{uuid.uuid4()}")
    assert [t["index"] for t in turns] == [0, 1, 2]
    assert {(t["route"], t["session_source"]) for t in turns} == {("/v1/messages", "x-claude-code-session-id")}
    assert [(t["completion_token_ids"], t["prompt_token_ids"]) for t in turns] == expected
    assert all(t["spans"] for t in turns), "a stream's spans, by the deltas that carried the ids"


# --- VLLM_NVEXT_CONTINUE_IDS: a prefix that never drifts -----------------------------------------------
# The same loops on a server with the setting (capture_continue: both mounts) and on one without
# (capture_plugin). Without it, turn 2 and 3's prompts part from the previous turn's ids: the tiny
# model samples bytes that are no UTF-8, which the client gets back as U+FFFD (or not at all, cut at the
# end) and sends back, re-rendered to other ids. With it, they extend them. The continued server's
# answers then come from other prompts than the plain loop's, so they are compared with what stock vLLM
# samples, greedy, from the very prompt ids each turn was served (`/v1/completions` on ids).


@pytest.mark.parametrize("loop", [codex_loop, claude_code_loop], ids=["codex", "claude-code"])
def test_with_continue_ids_every_turn_extends_the_previous_turns_ids(
    loop, capture_continue_server, capture_plugin_server, capture_stock_server
):
    session_id = f"continue-{uuid.uuid4()}"
    assert_continue_ids_against_plain(
        loop, capture_continue_server, capture_plugin_server, capture_stock_server, session_id
    )


def _chat_turn(server: Any, messages: list[dict[str, Any]], session_id: str | None) -> dict[str, Any]:
    """One greedy chat turn among ASCII ids (texts that round-trip: tests/fixtures/conversations), its answer."""
    ascii_ids = json.loads((FIXTURES / "chat_unary_ascii.json").read_text())["turns"][0]["request"]["allowed_token_ids"]
    body = {"model": MODEL_NAME, "messages": messages, "max_tokens": 8, "temperature": 0,
            "allowed_token_ids": ascii_ids, "return_token_ids": session_id is None}  # fmt: skip
    headers = {} if session_id is None else {"x-nvext-session-id": session_id}
    with http_client(server.url) as client:
        answer = client.post(CHAT, json=body, headers=headers)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


@pytest.mark.parametrize(
    "edit",
    # Each edit at the answer's head: an edit at its end may still extend the served ids (an answer cut at
    # max_tokens, sent back with more after it, is the served ids and more), which continue ids rightly splices.
    [lambda text: " " + text, lambda text: "<|im_start|>" + text, lambda text: text],
    ids=["a-leading-space", "a-special-token", "unchanged"],
)
def test_with_continue_ids_an_answer_sent_back_edited_is_what_the_model_reads(
    edit, capture_continue_server, capture_stock_server
):
    """An answer sent back with whitespace alone changed, or a special token added, renders otherwise than the one
    served: the turn's prompt is vLLM's rendering of what the client sent (stock's ids for that conversation),
    `extends_previous` false and its `break` says where, with the texts; unchanged, the turn extends the last."""
    session_id = f"edit-{uuid.uuid4()}"
    question = [{"role": "user", "content": "Tell me about token ids."}]
    text = _chat_turn(capture_continue_server, question, session_id)["choices"][0]["message"]["content"]
    sent_back = [*question, {"role": "assistant", "content": edit(text)}, {"role": "user", "content": "Go on."}]
    _chat_turn(capture_continue_server, sent_back, session_id)
    first, second = session_turns(capture_continue_server, session_id, 2)
    if edit(text) == text:
        assert second["extends_previous"] is True and second["break"] is None
        return
    assert second["prompt_token_ids"] == _chat_turn(capture_stock_server, sent_back, None)["prompt_token_ids"]
    assert second["extends_previous"] is False
    brk = second["break"]
    assert brk is not None and brk["index"] >= len(first["prompt_token_ids"]), "where the answer was sent back"
    assert brk["previous_text"] is not None and brk["prompt_text"] is not None, "the server has a tokenizer"


def test_atif_steps_carry_the_served_text_and_a_turn_with_logprobs_is_a_valid_gym_record(captured):
    """docs/capture.md "Trainer formats": on a real server (its tokenizer at hand) an ATIF step's `message` is the
    text the client got (the ids of its text spans, decoded), and a turn of a request that asked for logprobs is a
    NeMo Gym `TokenEntry` (the vendored schema) with one logprob per generated id, the client's."""
    import jsonschema

    formats = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
    session_id = f"formats-{uuid.uuid4()}"
    ascii_ids = json.loads((FIXTURES / "chat_unary_ascii.json").read_text())["turns"][0]["request"]["allowed_token_ids"]
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me about token ids."}],
            "max_tokens": 8, "temperature": 0, "allowed_token_ids": ascii_ids, "logprobs": True}  # fmt: skip
    with http_client(captured.url) as client:
        answer = client.post(CHAT, json=body, headers={"x-nvext-session-id": session_id}).json()
    session_turns(captured, session_id, 1)
    with http_client(captured.url) as client:
        atif = client.get(f"/v1/nvext/sessions/{session_id}?format=atif").json()
        gym = client.get(f"/v1/nvext/sessions/{session_id}?format=nemo-gym")
    jsonschema.validate(atif, json.loads((formats / "atif-v1.7.schema.json").read_text()))
    assert atif["steps"][0]["message"] == answer["choices"][0]["message"]["content"]
    assert gym.status_code == 200 and gym.headers["x-nvext-skipped-turns"] == "0"
    (record,) = [json.loads(line) for line in gym.text.splitlines()]
    jsonschema.validate(record, json.loads((formats / "nemo-gym-token-entry-v3.schema.json").read_text()))
    served = [item["logprob"] for item in answer["choices"][0]["logprobs"]["content"]]
    assert record["generation_log_probs"] == served and record["parent_resolution"] == "root"

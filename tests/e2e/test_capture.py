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

import uuid
from typing import Any

import pytest

from tests.e2e.capture_loops import (
    assert_continue_ids_against_plain,
    claude_code_against_stock,
    claude_code_loop,
    codex_against_stock,
    codex_loop,
)

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_parser]


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

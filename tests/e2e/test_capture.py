"""Operator capture (docs/capture.md) on vLLM 0.32's real engine, both mounts.

A Codex-shaped loop (`/v1/responses`, streamed, tools, a tool call and its result fed back) and a
Claude-Code-shaped one (`/v1/messages`, streamed, tools, a tool_use and its tool_result), three turns
each, sent by the real OpenAI and Anthropic SDKs with no field of vllm-nvext's, to servers with capture
on: every client gets what a stock server (same arguments, no vllm-nvext) answers, and the session read
back through the read API holds, turn by turn, the ids `/v1/chat/completions` with `return_token_ids`
gives for the same conversation. Marker e2e_parser: the parser group's run (three tiny servers).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.helpers import API_KEY, CHAT, MODEL_NAME, post, without_agent_volatile

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_parser]

MAX = 8
QUESTION = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
ARGUMENTS = {"city": "Paris"}
# The events the Anthropic SDK's `messages.stream()` adds to the server's, one per delta.
SDK_EVENTS = frozenset({"text", "input_json", "thinking", "citation", "signature"})


@pytest.fixture(params=["capture_mw", "capture_plugin"])
def captured(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_server")


def _session(server: Any, session_id: str, turns: int) -> list[dict[str, Any]]:
    """The session's turns from the read API, once the store's writer has written `turns` of them."""
    deadline = time.monotonic() + 60
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        while True:
            answer = client.get(f"/v1/nvext/sessions/{session_id}")
            found = answer.json()["turns"] if answer.status_code == 200 else []
            if len(found) >= turns or time.monotonic() > deadline:
                return list(found)
            time.sleep(0.2)


def _chat_ids(server: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """(completion ids, prompt ids) of the same conversation on chat with return_token_ids, greedy."""
    body = {"model": MODEL_NAME, "messages": messages, "tools": CHAT_TOOLS, "max_tokens": MAX, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        answer = post(client, CHAT, body)
    return answer["choices"][0]["token_ids"], answer["prompt_token_ids"]


def _tool_call(n: int) -> dict[str, Any]:
    return {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
    }


# --- Codex: /v1/responses ------------------------------------------------------------------------------


def _responses_turn(url: str, items: list[dict[str, Any]], session_id: str) -> tuple[list[str], Any]:
    """One Codex-shaped turn through the OpenAI SDK: its runs of event types and the final response."""
    import openai

    sdk: Any = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    body = {"model": MODEL_NAME, "input": items, "tools": tools, "max_output_tokens": MAX, "temperature": 0}
    # Codex's conversation id, as it sends it: the body's prompt_cache_key and the session_id header.
    with sdk.responses.stream(**body, prompt_cache_key=session_id, extra_headers={"session_id": session_id}) as events:
        types = [e.type for e in events]
        final = events.get_final_response().to_dict()
    # by content, never by chunk boundaries: the run of event types and the response they built
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t], final


def test_a_codex_loop_is_captured_with_chats_ids_and_the_client_gets_stock_answers(captured, capture_stock_server):
    session_id = f"codex-{uuid.uuid4()}"
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": QUESTION}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    expected = []
    for turn in range(3):
        seen, final = _responses_turn(captured.url, items, session_id)
        stock_seen, stock_final = _responses_turn(capture_stock_server.url, items, session_id)
        assert seen == stock_seen, "the events a stock server sends"
        assert without_agent_volatile(final) == without_agent_volatile(stock_final)
        assert final["input_messages"] is None and final["output_messages"] is None
        expected.append(_chat_ids(capture_stock_server, messages))
        text = "".join(c["text"] for o in final["output"] if o["type"] == "message" for c in o["content"])
        call = _tool_call(turn)
        items += [
            *final["output"],
            {"type": "function_call", "call_id": call["id"], "name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
            {"type": "function_call_output", "call_id": call["id"], "output": f"sunny, {20 + turn} C"},
        ]
        messages += [  # vLLM folds a function_call into the assistant message before it
            {"role": "assistant", "content": text, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {20 + turn} C"},
        ]
    turns = _session(captured, session_id, 3)
    assert [t["index"] for t in turns] == [0, 1, 2]
    assert {(t["route"], t["session_source"]) for t in turns} == {("/v1/responses", "session_id")}
    assert [(t["completion_token_ids"], t["prompt_token_ids"]) for t in turns] == expected


# --- Claude Code: /v1/messages -------------------------------------------------------------------------


def _messages_turn(url: str, messages: list[dict[str, Any]], session_id: str) -> tuple[list[Any], Any]:
    """One Claude-Code-shaped turn through the Anthropic SDK: its events and the final message."""
    import anthropic

    client: Any = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    # The SDK's methods take no `temperature` here: it travels in extra_body (a field of the Messages API).
    with client.messages.stream(model=MODEL_NAME, messages=messages, tools=tools, max_tokens=MAX,
                                extra_body={"temperature": 0},
                                extra_headers={"x-claude-code-session-id": session_id}) as events:  # fmt: skip
        # The SDK's own events (`text`, `input_json`, ...) come one beside each delta, so that deltas and
        # they alternate: left out, the run of the server's event types holds no chunk boundary.
        types = [e.type for e in events if e.type not in SDK_EVENTS]
        final = events.get_final_message().to_dict()
    # by content, never by chunk boundaries: the run of event types and the message they built
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t], final


def test_a_claude_code_loop_is_captured_with_chats_ids_and_the_client_gets_stock_answers(
    capture_plugin_server, capture_stock_server
):
    session_id = f"claude-{uuid.uuid4()}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    chat: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    expected = []
    for turn in range(3):
        seen, final = _messages_turn(capture_plugin_server.url, messages, session_id)
        stock_seen, stock_final = _messages_turn(capture_stock_server.url, messages, session_id)
        assert seen == stock_seen
        assert without_agent_volatile(final) == without_agent_volatile(stock_final)
        assert "token_ids" not in final and "nvext" not in final
        expected.append(_chat_ids(capture_stock_server, chat))
        text = "".join(c["text"] for c in final["content"] if c["type"] == "text")
        call = _tool_call(turn)
        use = {"type": "tool_use", "id": call["id"], "name": "get_weather", "input": ARGUMENTS}
        messages += [
            {"role": "assistant", "content": [*final["content"], use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": f"sunny, {20 + turn} C"}],
            },  # fmt: skip
        ]
        chat += [
            {"role": "assistant", "content": text, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {20 + turn} C"},
        ]
    turns = _session(capture_plugin_server, session_id, 3)
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


def _codex_loop(url: str, session_id: str) -> None:
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": QUESTION}]
    for turn in range(3):
        _, final = _responses_turn(url, items, session_id)
        call = _tool_call(turn)
        items += [
            *final["output"],
            {"type": "function_call", "call_id": call["id"], "name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
            {"type": "function_call_output", "call_id": call["id"], "output": f"sunny, {20 + turn} C"},
        ]


def _claude_code_loop(url: str, session_id: str) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for turn in range(3):
        _, final = _messages_turn(url, messages, session_id)
        use = {"type": "tool_use", "id": f"call_{turn}", "name": "get_weather", "input": ARGUMENTS}
        result = {"type": "tool_result", "tool_use_id": f"call_{turn}", "content": f"sunny, {20 + turn} C"}
        messages += [{"role": "assistant", "content": [*final["content"], use]}, {"role": "user", "content": [result]}]


def _greedy_on_ids(server: Any, prompt: list[int]) -> list[int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX, "temperature": 0, "return_token_ids": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        answer = post(client, "/v1/completions", body)
    return answer["choices"][0]["token_ids"]


@pytest.mark.parametrize("loop", [_codex_loop, _claude_code_loop], ids=["codex", "claude-code"])
def test_with_continue_ids_every_turn_extends_the_previous_turns_ids(
    loop, capture_continue_server, capture_plugin_server, capture_stock_server
):
    session_id = f"continue-{uuid.uuid4()}"
    loop(capture_continue_server.url, session_id)
    loop(capture_plugin_server.url, session_id)
    continued = _session(capture_continue_server, session_id, 3)
    plain = _session(capture_plugin_server, session_id, 3)
    assert [t["extends_previous"] for t in plain] == [None, False, False], "without it: the drift"
    assert [t["extends_previous"] for t in continued] == [None, True, True]
    assert all(t["break"] is None for t in continued)
    for before, turn in zip(continued, continued[1:], strict=False):
        served = before["prompt_token_ids"] + before["completion_token_ids"]
        assert turn["prompt_token_ids"][: len(served)] == served
    # Each answer is what vLLM samples, greedy, from the ids it was served, and where a turn's prompt is
    # the plain loop's (turn 1 always), the answer is the plain loop's too.
    for turn, other in zip(continued, plain, strict=True):
        assert turn["completion_token_ids"] == _greedy_on_ids(capture_stock_server, turn["prompt_token_ids"])
        if turn["prompt_token_ids"] == other["prompt_token_ids"]:
            assert turn["completion_token_ids"] == other["completion_token_ids"]

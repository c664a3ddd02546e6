"""The agent loops of tests/e2e/test_capture.py, shared with tests/e2e/test_capture_versions.py.

A Codex-shaped loop (`/v1/responses`, streamed, tools, a tool call and its result fed back) and a
Claude-Code-shaped one (`/v1/messages`, streamed, tools, a tool_use and its tool_result), three turns
each, sent by the real OpenAI and Anthropic SDKs with no field of vllm-nvext's. `codex_against_stock`
and `claude_code_against_stock` send each turn to a capture server and to a stock one (same arguments,
no vllm-nvext), assert the client got the stock answer, and return the session read back through the
read API with the ids `/v1/chat/completions` with `return_token_ids` gives for the same conversation.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from tests.helpers import API_KEY, CHAT, MODEL_NAME, http_client, post, without_agent_volatile

MAX = 8
QUESTION = "What is the weather in Paris?"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
ARGUMENTS = {"city": "Paris"}
# The events the Anthropic SDK's `messages.stream()` adds to the server's, one per delta.
SDK_EVENTS = frozenset({"text", "input_json", "thinking", "citation", "signature"})
Ids = tuple[list[int], list[int]]


def read_session(url: str, session_id: str, turns: int, wait_s: float = 60.0) -> dict[str, Any]:
    """The session as the read API at `url` answers it, once the store's writer has written `turns` of its turns
    (or after `wait_s`)."""
    deadline = time.monotonic() + wait_s
    with http_client(url) as client:
        while True:
            answer = client.get(f"/v1/nvext/sessions/{session_id}")
            if answer.status_code == 200 and len(answer.json()["turns"]) >= turns or time.monotonic() > deadline:
                assert answer.status_code == 200, answer.text
                return dict(answer.json())
            time.sleep(0.2)


def session_turns(server: Any, session_id: str, turns: int) -> list[dict[str, Any]]:
    """The session's turns from the read API, once the store's writer has written `turns` of them."""
    return list(read_session(server.url, session_id, turns)["turns"])


def chat_ids(server: Any, messages: list[dict[str, Any]]) -> Ids:
    """(completion ids, prompt ids) of the same conversation on chat with return_token_ids, greedy."""
    body = {"model": MODEL_NAME, "messages": messages, "tools": CHAT_TOOLS, "max_tokens": MAX, "temperature": 0,
            "return_token_ids": True}  # fmt: skip
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        answer = post(client, CHAT, body)
    return answer["choices"][0]["token_ids"], answer["prompt_token_ids"]


def tool_call(n: int) -> dict[str, Any]:
    return {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
    }


def greedy_on_ids(server: Any, prompt: list[int]) -> list[int]:
    """What the server samples, greedy, from these very prompt ids (`/v1/completions` on ids)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX, "temperature": 0, "return_token_ids": True}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        answer = post(client, "/v1/completions", body)
    return answer["choices"][0]["token_ids"]


# --- Codex: /v1/responses ------------------------------------------------------------------------------


def responses_turn(url: str, items: list[dict[str, Any]], session_id: str) -> tuple[list[str], Any]:
    """One Codex-shaped turn through the OpenAI SDK: its runs of event types and the final response."""
    import openai

    tools = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
    body = {"model": MODEL_NAME, "input": items, "tools": tools, "max_output_tokens": MAX, "temperature": 0}
    # Closed on the way out: a client left to the garbage collector leaves its socket to a later test's warning.
    sdk: Any
    with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as sdk:
        # Codex's conversation id, as it sends it: the body's prompt_cache_key and the session_id header.
        headers = {"session_id": session_id}
        with sdk.responses.stream(**body, prompt_cache_key=session_id, extra_headers=headers) as stream:
            events = list(stream)
            types = [e.type for e in events]
            # vLLM 0.34 ends an answer cut by max_output_tokens with `response.incomplete` (0.30-0.33 with
            # `response.completed`), which the SDK's get_final_response() refuses: the response it carries.
            incomplete = [e.response for e in events if e.type == "response.incomplete"]
            final = (incomplete[-1] if incomplete else stream.get_final_response()).to_dict()
    # by content, never by chunk boundaries: the run of event types and the response they built
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t], final


def codex_against_stock(captured: Any, stock: Any, session_id: str) -> tuple[list[dict[str, Any]], list[Ids]]:
    """The Codex loop on `captured`, each turn compared with `stock`'s answer: (the session's turns as
    captured, the (completion, prompt) ids chat on `stock` gives for each turn's conversation)."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": QUESTION}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    expected = []
    for turn in range(3):
        seen, final = responses_turn(captured.url, items, session_id)
        stock_seen, stock_final = responses_turn(stock.url, items, session_id)
        assert seen == stock_seen, "the events a stock server sends"
        assert without_agent_volatile(final) == without_agent_volatile(stock_final)
        assert final["input_messages"] is None and final["output_messages"] is None
        expected.append(chat_ids(stock, messages))
        text = "".join(c["text"] for o in final["output"] if o["type"] == "message" for c in o["content"])
        call = tool_call(turn)
        items += [
            *final["output"],
            {"type": "function_call", "call_id": call["id"], "name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
            {"type": "function_call_output", "call_id": call["id"], "output": f"sunny, {20 + turn} C"},
        ]
        messages += [  # vLLM folds a function_call into the assistant message before it
            {"role": "assistant", "content": text, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": f"sunny, {20 + turn} C"},
        ]
    return session_turns(captured, session_id, 3), expected


def codex_loop(url: str, session_id: str) -> None:
    """The Codex loop alone, on one server."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": QUESTION}]
    for turn in range(3):
        _, final = responses_turn(url, items, session_id)
        call = tool_call(turn)
        items += [
            *final["output"],
            {"type": "function_call", "call_id": call["id"], "name": "get_weather", "arguments": json.dumps(ARGUMENTS)},
            {"type": "function_call_output", "call_id": call["id"], "output": f"sunny, {20 + turn} C"},
        ]


# --- Claude Code: /v1/messages -------------------------------------------------------------------------


def messages_turn(url: str, messages: list[dict[str, Any]], session_id: str) -> tuple[list[Any], Any]:
    """One Claude-Code-shaped turn through the Anthropic SDK: its events and the final message."""
    import anthropic

    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    client: Any
    # The SDK's methods take no `temperature` here: it travels in extra_body (a field of the Messages API). The
    # client is closed on the way out, as in responses_turn.
    with (
        anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0) as client,
        client.messages.stream(
            model=MODEL_NAME,
            messages=messages,
            tools=tools,
            max_tokens=MAX,
            extra_body={"temperature": 0},
            extra_headers={"x-claude-code-session-id": session_id},
        ) as events,
    ):
        # The SDK's own events (`text`, `input_json`, ...) come one beside each delta, so that deltas and
        # they alternate: left out, the run of the server's event types holds no chunk boundary.
        types = [e.type for e in events if e.type not in SDK_EVENTS]
        final = events.get_final_message().to_dict()
    # by content, never by chunk boundaries: the run of event types and the message they built
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t], final


def claude_code_against_stock(captured: Any, stock: Any, session_id: str) -> tuple[list[dict[str, Any]], list[Ids]]:
    """The Claude Code loop on `captured`, each turn compared with `stock`'s answer (as `codex_against_stock`)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    chat: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    expected = []
    for turn in range(3):
        seen, final = messages_turn(captured.url, messages, session_id)
        stock_seen, stock_final = messages_turn(stock.url, messages, session_id)
        assert seen == stock_seen
        assert without_agent_volatile(final) == without_agent_volatile(stock_final)
        assert "token_ids" not in final and "nvext" not in final
        expected.append(chat_ids(stock, chat))
        text = "".join(c["text"] for c in final["content"] if c["type"] == "text")
        call = tool_call(turn)
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
    return session_turns(captured, session_id, 3), expected


def claude_code_loop(url: str, session_id: str) -> None:
    """The Claude Code loop alone, on one server."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    for turn in range(3):
        _, final = messages_turn(url, messages, session_id)
        use = {"type": "tool_use", "id": f"call_{turn}", "name": "get_weather", "input": ARGUMENTS}
        result = {"type": "tool_result", "tool_use_id": f"call_{turn}", "content": f"sunny, {20 + turn} C"}
        messages += [{"role": "assistant", "content": [*final["content"], use]}, {"role": "user", "content": [result]}]


def assert_each_turn_extends_the_last(turns: list[dict[str, Any]]) -> None:
    """`extends_previous` on every turn after the first, no break, and each prompt begins with the ids served before."""
    assert [t["extends_previous"] for t in turns] == [None, True, True]
    assert all(t["break"] is None for t in turns)
    for before, turn in zip(turns, turns[1:], strict=False):
        served = before["prompt_token_ids"] + before["completion_token_ids"]
        assert turn["prompt_token_ids"][: len(served)] == served


def assert_continue_ids_against_plain(loop: Any, continued: Any, plain: Any, stock: Any, session_id: str) -> None:
    """`loop` on a server with VLLM_NVEXT_CONTINUE_IDS (`continued`) and on one with capture alone (`plain`): the
    plain loop drifts, every continued turn extends the last, and each continued answer is what `stock` samples,
    greedy, from the ids it was served (and the plain loop's answer where a turn's prompt is the plain loop's)."""
    loop(continued.url, session_id)
    loop(plain.url, session_id)
    continued_turns = session_turns(continued, session_id, 3)
    plain_turns = session_turns(plain, session_id, 3)
    assert [t["extends_previous"] for t in plain_turns] == [None, False, False], "without it: the drift"
    assert_each_turn_extends_the_last(continued_turns)
    for turn, other in zip(continued_turns, plain_turns, strict=True):
        assert turn["completion_token_ids"] == greedy_on_ids(stock, turn["prompt_token_ids"])
        if turn["prompt_token_ids"] == other["prompt_token_ids"]:
            assert turn["completion_token_ids"] == other["completion_token_ids"]

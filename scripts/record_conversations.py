#!/usr/bin/env python
"""Record real multi-turn conversations for the unit tests of `VLLM_NVEXT_CONTINUE_IDS` (never typed by hand).

Starts a stock vLLM server (no middleware) on the tiny model, with tools (the hermes parser), and runs
each conversation in CONVERSATIONS as an agent harness does: each turn sends the whole history, the
previous answer as the client got it (its text, its output items) followed by what is new (a user
message, a tool call and its result). For every turn it keeps the request, the prompt ids vLLM
rendered (`return_token_ids` on chat, `enable_response_messages` on /v1/responses) and the completion
ids, in tests/fixtures/conversations/<name>.json (+ index.json). Run from the repository root:
`python -m scripts.record_conversations`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from vllm_nvext import __version__
from vllm_nvext.tools import tiny_model
from vllm_nvext.tools.server import TINY_ARGS, VllmServer

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "conversations"
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "parameters": SCHEMA}]
GREEDY = {"model": "tiny", "temperature": 0}
TURNS = 4


def _call(n: int) -> dict[str, Any]:
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    return {"id": f"call_{n}", "type": "function", "function": function}


def _chat(client: httpx.Client, body: dict[str, Any]) -> tuple[list[int], list[int], str]:
    """(prompt ids, completion ids, text as the client assembles it), unary or streamed."""
    if not body.get("stream"):
        resp = client.post("/v1/chat/completions", json=body)
        resp.raise_for_status()
        answer = resp.json()
        return answer["prompt_token_ids"], answer["choices"][0]["token_ids"], answer["choices"][0]["message"]["content"]
    prompt: list[int] = []
    ids: list[int] = []
    text = ""
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            prompt = chunk.get("prompt_token_ids") or prompt
            for choice in chunk.get("choices") or ():
                ids += choice.get("token_ids") or []
                text += (choice.get("delta") or {}).get("content") or ""
    return prompt, ids, text


def chat_conversation(base: dict[str, Any], first: list[dict[str, Any]], tools: bool) -> Callable[..., list[Any]]:
    def run(client: httpx.Client) -> list[dict[str, Any]]:
        messages = list(first)
        turns = []
        for n in range(TURNS):
            body = {**GREEDY, **base, "messages": list(messages), "return_token_ids": True}
            prompt, ids, text = _chat(client, body)
            turns.append({"request": body, "prompt_token_ids": prompt, "completion_token_ids": ids, "text": text})
            if tools:
                messages += [
                    {"role": "assistant", "content": text, "tool_calls": [_call(n)]},
                    {"role": "tool", "tool_call_id": f"call_{n}", "content": f"sunny, {20 + n} C"},
                ]
            else:
                messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
        return turns

    return run


def responses_conversation(client: httpx.Client) -> list[dict[str, Any]]:
    """Codex's shape: the previous output items, then a function_call and its output."""
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": "What is the weather in Paris?"}]
    turns = []
    for n in range(TURNS):
        body = {**GREEDY, "input": list(items), "tools": RESPONSES_TOOLS, "max_output_tokens": 8,
                "enable_response_messages": True}  # fmt: skip
        resp = client.post("/v1/responses", json=body)
        resp.raise_for_status()
        answer = resp.json()
        ids = [i for m in answer["output_messages"][::2] for i in m["tokens"]]
        turns.append({"request": body, "prompt_token_ids": answer["input_messages"][0]["tokens"],
                      "completion_token_ids": ids, "output": answer["output"]})  # fmt: skip
        items += [
            *answer["output"],
            {"type": "function_call", "call_id": f"call_{n}", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": f"call_{n}", "output": f"sunny, {20 + n} C"},
        ]
    return turns


def _ascii_ids() -> list[int]:
    """The ids of lower-case letters, the space and EOS: answers whose text encodes back to their ids (the
    tiny model otherwise samples bytes that are not valid UTF-8 at almost every turn)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model.ensure())
    return sorted({*tokenizer.encode("abcdefghijklmnopqrstuvwxyz ", add_special_tokens=False), tokenizer.eos_token_id})


QUESTION = [{"role": "user", "content": "Tell me about token ids."}]
SYSTEM = [{"role": "system", "content": "You answer briefly."}, *QUESTION]
CONVERSATIONS: dict[str, Callable[[httpx.Client], list[dict[str, Any]]]] = {
    "chat_unary": chat_conversation({"max_tokens": 8}, QUESTION, tools=False),
    "chat_stream_system": chat_conversation({"max_tokens": 12, "stream": True}, SYSTEM, tools=False),
    "chat_unary_tools": chat_conversation({"max_tokens": 8, "tools": CHAT_TOOLS}, QUESTION, tools=True),
    "chat_stream_tools": chat_conversation({"max_tokens": 16, "tools": CHAT_TOOLS, "stream": True}, SYSTEM, tools=True),
    "responses_codex": responses_conversation,
}
# The same shapes, sampled among ASCII ids alone (vLLM's `allowed_token_ids`): texts that round-trip.
ASCII_CONVERSATIONS: dict[str, Callable[[list[int]], Callable[[httpx.Client], list[dict[str, Any]]]]] = {
    "chat_unary_ascii": lambda ids: chat_conversation(
        {"max_tokens": 8, "allowed_token_ids": ids}, QUESTION, tools=False
    ),
    "chat_stream_tools_ascii": lambda ids: chat_conversation(
        {"max_tokens": 16, "tools": CHAT_TOOLS, "stream": True, "allowed_token_ids": ids}, SYSTEM, tools=True
    ),
}


def _compact(name: str, turns: list[dict[str, Any]]) -> str:
    """One turn a line."""
    lines = ",\n".join(json.dumps(turn) for turn in turns)
    return f'{{"name": {json.dumps(name)}, "turns": [\n{lines}\n]}}\n'


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    args = (*TINY_ARGS, "--served-model-name", "tiny", *TOOL_ARGS)
    index: dict[str, Any] = {"recorder": "scripts/record_conversations.py", "vllm_nvext": __version__}
    ascii_ids = _ascii_ids()
    conversations = {**CONVERSATIONS, **{name: make(ascii_ids) for name, make in ASCII_CONVERSATIONS.items()}}
    with VllmServer(model=str(tiny_model.ensure()), args=args, name="conversations") as server:
        server.wait_ready()
        import vllm

        index["vllm_version"] = vllm.__version__
        index["conversations"] = {}
        with httpx.Client(base_url=server.url, timeout=300) as client:
            for name, run in conversations.items():
                turns = run(client)
                (OUT / f"{name}.json").write_text(_compact(name, turns))
                index["conversations"][name] = f"{name}.json"
                print(f"{name}: {len(turns)} turns")
    (OUT / "index.json").write_text(json.dumps(index, indent=1) + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Measure whether an agent harness's multi-turn prompts extend the ids of the turns before them.

A harness (Codex, Claude Code) re-sends the whole history as text each turn. For a 3-turn
/v1/responses conversation with a tool result, this prints, for each turn k+1, whether its
prompt ids start with turn k's prompt ids + completion ids, and where they part. Run on a stock
vLLM with the tiny model (started here, or `--url`); docs/protocol.md §11.3 holds what it found.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx

from vllm_nvext.tools import tiny_model
from vllm_nvext.tools.server import TINY_ARGS, VllmServer

BASE = {"model": "tiny", "temperature": 0, "max_output_tokens": 12, "enable_response_messages": True}
CALL = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"q": "ids"}'}
RESULT = {"type": "function_call_output", "call_id": "call_1", "output": "42"}


def _turn(client: httpx.Client, items: list[Any]) -> tuple[list[int], list[int], list[Any]]:
    resp = client.post("/v1/responses", json={**BASE, "input": items})
    if resp.status_code != 200:
        raise SystemExit(f"HTTP {resp.status_code}: {resp.text}")
    answer = resp.json()
    return answer["input_messages"][0]["tokens"], answer["output_messages"][0]["tokens"], answer["output"]


def measure(client: httpx.Client, detokenize: Any) -> list[dict[str, Any]]:
    history: list[Any] = [{"role": "user", "content": "Tell me about token ids."}]
    turns = []
    next_inputs = [[{"role": "user", "content": "Go on."}], [CALL, RESULT], []]
    for extra in next_inputs:
        prompt, completion, output = _turn(client, history)
        turns.append({"prompt": prompt, "completion": completion})
        history = history + output + extra
        if not extra:
            break
    report = []
    for k in range(len(turns) - 1):
        before = turns[k]["prompt"] + turns[k]["completion"]
        after = turns[k + 1]["prompt"]
        common = next(
            (i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b), min(len(before), len(after))
        )
        report.append(
            {
                "turn": k + 2,
                "starts_with_previous_prompt": after[: len(turns[k]["prompt"])] == turns[k]["prompt"],
                "starts_with_previous_prompt_and_completion": after[: len(before)] == before,
                "first_difference_at": common,
                "previous_prompt_len": len(turns[k]["prompt"]),
                "previous_completion": turns[k]["completion"],
                "rendered_there": after[len(turns[k]["prompt"]) : len(before) + 4],
                "previous_completion_text": detokenize(turns[k]["completion"]),
                "rendered_text": detokenize(after[len(turns[k]["prompt"]) : len(before) + 4]),
            }
        )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", help="a running stock vLLM serving the tiny model as `tiny`")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        model = str(tiny_model.ensure())
        server = VllmServer(model=model, args=(*TINY_ARGS, "--served-model-name", "tiny"), name="multiturn")
        server.start().wait_ready()
        url = server.url
    try:
        with httpx.Client(base_url=url, timeout=300) as client:

            def detokenize(ids: list[int]) -> str:
                return str(client.post("/detokenize", json={"model": "tiny", "tokens": ids}).json()["prompt"])

            print(json.dumps(measure(client, detokenize), indent=1))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()

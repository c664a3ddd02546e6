"""An RL rollout loop that needs token ids and logprobs, in both dialects (docs/protocol.md §4).

- Dynamo dialect, as NeMo-RL / NeMo Gym renderers send it: chat with
  `nvext.extra_fields: ["engine_data"]` and `logprobs: true`, unary and streamed; the trainer
  reads `nvext.engine_data.{prompt_token_ids, completion_token_ids, completion_logprobs}`.
  A second turn is sent token-in/token-out: `/v1/completions` with `nvext.token_data` =
  the first turn's prompt + completion ids + the next user turn's ids.
- vLLM dialect, as prime-rl / verifiers send it: chat, `return_token_ids: true`,
  `logprobs: true`; the trainer reads root `prompt_token_ids`, `choices[0].token_ids` and
  `choices[0].logprobs.content[].logprob`.

Every rollout checks that each completion id has exactly one logprob, that the ids are the
same in both dialects and streamed or not (greedy, so that they can be compared), and that the
second turn's prompt ids are exactly the sent ids.

    vllm-nvext serve                       # the tiny model on http://127.0.0.1:8000
    python examples/rl_rollout.py [--url URL] [--model NAME] [--api-key KEY] [--rollouts N]

Exit status 0 when every check passes, 1 otherwise (2 when the server is unreachable).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

import httpx

from vllm_nvext.client import TokenIds, TokenIdsError, extract, extract_stream, first_difference, parse_sse

TASKS = ("What is 2 + 3?", "Spell 'cat' backwards.", "Name a prime number.", "Say yes or no.")
MAX_TOKENS = 16


class Rollouts:
    def __init__(self, http: httpx.Client, url: str, model: str) -> None:
        self.http, self.url, self.model = http, url, model
        self.failures = 0

    def post(self, path: str, body: dict[str, Any], stream: bool = False) -> TokenIds:
        body = {"model": self.model, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
        if not stream:
            response = self.http.post(self.url + path, json=body)
            if response.status_code != 200:
                raise TokenIdsError(f"HTTP {response.status_code}: {response.text[:300]}")
            return extract(response.json())
        with self.http.stream("POST", self.url + path, json={**body, "stream": True}) as response:
            if response.status_code != 200:
                raise TokenIdsError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
            return extract_stream(parse_sse(response.iter_bytes()))

    def check(self, label: str, ok: bool, problem: str) -> None:
        if not ok:
            self.failures += 1
            print(f"  FAIL {label}: {problem}")

    def check_sample(self, label: str, ids: TokenIds, placement: str) -> None:
        completion = ids.completion_token_ids[0] if ids.completion_token_ids else []
        logprobs = (ids.completion_logprobs or [[]])[0]
        total = sum(lp for lp in logprobs if lp is not None)
        print(f"  {label}: {len(ids.prompt_token_ids or ())} prompt ids, {len(completion)} completion ids, "
              f"sum logprob {total:.3f} (from {ids.placement})")  # fmt: skip
        self.check(label, ids.placement == placement, f"ids came from {ids.placement}, expected {placement}")
        self.check(label, bool(ids.prompt_token_ids), "no prompt ids")
        self.check(label, bool(completion), "no completion ids")
        self.check(
            label,
            len(logprobs) == len(completion) and all(lp is not None and math.isfinite(lp) for lp in logprobs),
            f"{len(completion)} completion ids but {len(logprobs)} logprobs (or non-finite ones)",
        )

    def same_ids(self, label: str, a: TokenIds, b: TokenIds) -> None:
        for what, x, y in (
            ("prompt ids", a.prompt_token_ids, b.prompt_token_ids),
            ("completion ids", a.completion_token_ids[0], b.completion_token_ids[0]),
        ):
            diff = first_difference(x, y)
            self.check(label, diff is None, f"{what} differ: {diff}")

    def rollout(self, number: int, task: str) -> None:
        print(f"rollout {number}: {task!r}")
        chat = {"messages": [{"role": "user", "content": task}], "logprobs": True}
        nvext = {**chat, "nvext": {"extra_fields": ["engine_data"]}}
        nv_unary = self.post("/v1/chat/completions", nvext)
        self.check_sample("nvext engine_data unary", nv_unary, "engine_data")
        nv_stream = self.post("/v1/chat/completions", nvext, stream=True)
        self.check_sample("nvext engine_data stream", nv_stream, "engine_data")
        vllm = self.post("/v1/chat/completions", {**chat, "return_token_ids": True})
        self.check_sample("vllm return_token_ids", vllm, "vllm")
        self.same_ids("nvext unary vs stream", nv_unary, nv_stream)
        self.same_ids("nvext vs vllm dialect", nv_unary, vllm)

        # Turn 2, token in / token out: the trainer never re-tokenizes what the model generated.
        tokenized = self.http.post(
            self.url + "/tokenize", json={"model": self.model, "prompt": "\nuser: go on\n", "add_special_tokens": False}
        )
        tokenized.raise_for_status()
        history = (nv_unary.prompt_token_ids or []) + nv_unary.completion_token_ids[0] + tokenized.json()["tokens"]
        nvext_turn2 = {"token_data": history, "extra_fields": ["engine_data"]}
        turn2 = self.post("/v1/completions", {"prompt": "", "logprobs": 1, "nvext": nvext_turn2})
        self.check_sample("turn 2 via nvext.token_data", turn2, "engine_data")
        diff = first_difference(turn2.prompt_token_ids, history)
        self.check("turn 2 prompt ids == sent token_data", diff is None, str(diff))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"))
    parser.add_argument("--rollouts", type=int, default=len(TASKS))
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(headers=headers, timeout=120.0) as http:
        loop = Rollouts(http, args.url.rstrip("/"), args.model)
        for number in range(args.rollouts):
            try:
                loop.rollout(number, TASKS[number % len(TASKS)])
            except httpx.TransportError as exc:
                print(f"cannot reach {args.url}: {exc}", file=sys.stderr)
                return 2
            except (httpx.HTTPStatusError, TokenIdsError) as exc:
                loop.check(f"rollout {number}", False, str(exc))
    print("all rollouts check out" if not loop.failures else f"{loop.failures} check(s) failed")
    return 1 if loop.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Ask one vllm-nvext server for token ids in both dialects with the OpenAI SDK, and compare.

The SDK forwards unknown request fields through `extra_body`, and keeps unknown response
fields (`token_ids`, `prompt_token_ids`, `nvext`) as extra attributes; `vllm_nvext.client`
reads the ids from whichever placement the server used.

Run a server, then this script::

    vllm-nvext serve                       # the tiny model on http://127.0.0.1:8000
    python examples/openai_sdk_both_dialects.py [--url URL] [--model NAME] [--api-key KEY]

Exit status 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import APIError, OpenAI

from vllm_nvext.client import TokenIds, TokenIdsError, extract, extract_stream, first_difference

VLLM_DIALECT = {"return_token_ids": True}
NVEXT_DIALECT = {"nvext": {"extra_fields": ["completion_token_ids"]}}


def ask(client: OpenAI, model: str, endpoint: str, stream: bool, extra_body: dict) -> TokenIds:
    common = {"model": model, "max_tokens": 12, "temperature": 0, "stream": stream, "extra_body": extra_body}
    if endpoint == "chat":
        response = client.chat.completions.create(messages=[{"role": "user", "content": "Say hello."}], **common)
    else:
        response = client.completions.create(prompt="Once upon a time", **common)
    return extract_stream(response) if stream else extract(response)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY", "EMPTY"))
    args = parser.parse_args()
    client = OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key, max_retries=0)

    failures = 0
    for endpoint in ("chat", "completions"):
        for stream in (False, True):
            shape = f"{endpoint} {'stream' if stream else 'unary'}"
            try:
                vllm = ask(client, args.model, endpoint, stream, VLLM_DIALECT)
                nvext = ask(client, args.model, endpoint, stream, NVEXT_DIALECT)
            except (APIError, TokenIdsError) as exc:  # refused, unreachable, or no ids in the answer
                failures += 1
                print(f"{shape}: FAIL {type(exc).__name__}: {exc}")
                continue
            print(f"{shape}: vLLM dialect answered under {vllm.placement!r}, nvext dialect under {nvext.placement!r}")
            print(f"  prompt ids     {vllm.prompt_token_ids}")
            print(f"  completion ids {vllm.completion_token_ids[0] if vllm.completion_token_ids else None}")
            problems = []
            for name, ids in (("vLLM", vllm), ("nvext", nvext)):
                if not ids.prompt_token_ids or not ids.completion_token_ids or not ids.completion_token_ids[0]:
                    problems.append(f"the {name} dialect returned no prompt or no completion ids")
            if not problems:
                for name, a, b in (
                    ("prompt ids", vllm.prompt_token_ids, nvext.prompt_token_ids),
                    ("completion ids", vllm.completion_token_ids[0], nvext.completion_token_ids[0]),
                ):
                    diff = first_difference(a, b)
                    if diff is not None:
                        problems.append(f"{name} differ between dialects: {diff}")
            for problem in problems:
                print(f"  FAIL {problem}")
            failures += len(problems)
    print("all ids identical across dialects" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

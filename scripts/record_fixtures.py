#!/usr/bin/env python
"""Record real vLLM responses for the unit tests and benchmarks (never typed by hand).

Starts a stock vLLM server (no middleware) on the tiny model, sends each request in CASES and
writes exactly the bytes vLLM answered to tests/fixtures/<name>.json|.sse, plus index.json
(request, endpoint, status, content type, vLLM version). Run: `make fixtures`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_nvext import tiny_model  # noqa: E402
from vllm_nvext.server import TINY_ARGS, VllmServer  # noqa: E402

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me about token ids."}]
GREEDY = {"model": "tiny", "temperature": 0}

# name -> (path, body). Names say what the recording holds.
CASES: dict[str, tuple[str, dict]] = {
    "chat_unary_ids": (CHAT, {**GREEDY, "messages": MESSAGES, "max_tokens": 8, "return_token_ids": True}),
    "chat_unary_plain": (CHAT, {**GREEDY, "messages": MESSAGES, "max_tokens": 8}),
    "chat_unary_ids_logprobs": (
        CHAT,
        {
            **GREEDY,
            "messages": MESSAGES,
            "max_tokens": 8,
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    ),
    "chat_unary_ids_prompt_logprobs": (
        CHAT,
        {**GREEDY, "messages": MESSAGES, "max_tokens": 4, "return_token_ids": True, "prompt_logprobs": 1},
    ),
    "chat_stream_ids": (
        CHAT,
        {
            **GREEDY,
            "messages": MESSAGES,
            "max_tokens": 8,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "chat_stream_plain": (CHAT, {**GREEDY, "messages": MESSAGES, "max_tokens": 8, "stream": True}),
    "chat_stream_ids_logprobs": (
        CHAT,
        {**GREEDY, "messages": MESSAGES, "max_tokens": 8, "return_token_ids": True, "logprobs": True, "stream": True},
    ),
    "chat_stream_ids_long": (
        CHAT,
        {**GREEDY, "messages": MESSAGES, "max_tokens": 400, "return_token_ids": True, "stream": True},
    ),
    "chat_stream_plain_long": (CHAT, {**GREEDY, "messages": MESSAGES, "max_tokens": 400, "stream": True}),
    "completions_unary_ids": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 8, "return_token_ids": True},
    ),
    "completions_unary_plain": (COMPLETIONS, {**GREEDY, "prompt": "Token ids are", "max_tokens": 8}),
    "completions_unary_ids_logprobs": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 8, "return_token_ids": True, "logprobs": 2},
    ),
    "completions_unary_ids_prompt_logprobs": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 4, "return_token_ids": True, "prompt_logprobs": 1},
    ),
    "completions_unary_ids_token_prompt": (
        COMPLETIONS,
        {**GREEDY, "prompt": [84, 111, 107, 101, 110], "max_tokens": 1, "return_token_ids": True},
    ),
    "completions_unary_ids_n2": (
        COMPLETIONS,
        {
            "model": "tiny",
            "prompt": "Token ids are",
            "max_tokens": 6,
            "n": 2,
            "temperature": 0.8,
            "seed": 7,
            "return_token_ids": True,
        },
    ),  # fmt: skip
    "completions_stream_ids": (
        COMPLETIONS,
        {
            **GREEDY,
            "prompt": "Token ids are",
            "max_tokens": 8,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "completions_stream_plain": (COMPLETIONS, {**GREEDY, "prompt": "Token ids are", "max_tokens": 8, "stream": True}),
    "completions_stream_ids_logprobs": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 8, "return_token_ids": True, "logprobs": 1, "stream": True},
    ),  # fmt: skip
    "completions_stream_ids_n2": (
        COMPLETIONS,
        {
            "model": "tiny",
            "prompt": "Token ids are",
            "max_tokens": 4,
            "n": 2,
            "temperature": 0.8,
            "seed": 7,
            "return_token_ids": True,
            "stream": True,
        },
    ),  # fmt: skip
    "completions_stream_ids_long": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 400, "return_token_ids": True, "stream": True},
    ),
    "completions_stream_echo": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 4, "echo": True, "stream": True},
    ),
    "error_max_tokens": (COMPLETIONS, {**GREEDY, "prompt": "x", "max_tokens": 5000, "return_token_ids": True}),
}


def record(out_dir: Path, url: str | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    server = None
    if url is None:
        server = VllmServer(
            model=str(tiny_model.ensure()), args=(*TINY_ARGS, "--served-model-name", "tiny"), name="fixtures"
        )
        server.start().wait_ready()
        url = server.url
    try:
        index: dict[str, dict] = {}
        with httpx.Client(base_url=url, timeout=300) as client:
            version = client.get("/version").json().get("version")
            for name, (path, body) in CASES.items():
                with client.stream("POST", path, json=body) as resp:
                    raw = resp.read()
                content_type = resp.headers.get("content-type", "")
                suffix = ".sse" if content_type.startswith("text/event-stream") else ".json"
                (out_dir / f"{name}{suffix}").write_bytes(raw)
                index[name] = {
                    "path": path,
                    "request": body,
                    "status": resp.status_code,
                    "content_type": content_type,
                    "file": f"{name}{suffix}",
                }
                print(f"recorded {name}: HTTP {resp.status_code}, {len(raw)} bytes", flush=True)
        meta = {"vllm_version": version, "model": "vllm_nvext.tiny_model", "cases": index}
        (out_dir / "index.json").write_text(json.dumps(meta, indent=1) + "\n")
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures")
    parser.add_argument("--url", help="record from this running stock vLLM instead of starting one")
    args = parser.parse_args()
    record(args.out, args.url)


if __name__ == "__main__":
    main()

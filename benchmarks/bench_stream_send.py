"""Warm cost per mid-stream delta of the `send` handed to vLLM, each implementation side by side.

One recorded long stream (vLLM 0.32's and 0.33's layouts, chat and completions), nvext placement
(`completion_token_ids`), metrics on: each variant is handed the stream's mid-stream deltas, one
ASGI body message each, down to a server `send` that does nothing. Variants, interleaved pass by
pass in one process so machine noise hits them alike:

  server send       the server's `send` called directly: what the app pays without any middleware
  floor             a Python `send` that only awaits the server's: what any ASGI middleware costs
  general path      `ReshapingSend` itself (its coroutine, `StreamReshaper.feed`, the splice's
                    Python tier): what a delta costs that the armed send hands back
  python send       `kernels.python_stream_send`, armed: the pure-Python path
  compiled send     `_speedups.StreamSend`, armed (left out when the extension is not built)

Each figure is the median over passes of (variant - server send) per delta, in µs, warm: the code
stays in the caches between deltas, so inside a serving vLLM each costs about twice as much.

Run: python -m benchmarks.bench_stream_send [--quick]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from vllm_nvext.config import Mode
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.kernels import KERNELS
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.send import ReshapingSend

from ._common import SSE_HEADERS, Target, fmt, load_case, median, print_table, run_sync

FIXTURES = (("chat_stream_ids_long", "0.32"), ("chat_stream_ids_long", "0.33"),
            ("completions_stream_ids_long", "0.32"), ("completions_stream_ids_long", "0.33"))  # fmt: skip


async def _server_send(message: MutableMapping[str, Any]) -> None:
    return None


async def _floor_send(message: MutableMapping[str, Any]) -> None:
    await _server_send(message)


def _armed(plan: Any, events: list[bytes], impl: str | None) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """The send under test, after the stream's first events (the splice armed on its first delta)."""
    reshaping = ReshapingSend(plan, Clock(), _server_send, None if impl is None else KERNELS[impl])
    send = reshaping.app_send
    run_sync(send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)}))
    for event in events:
        run_sync(send({"type": "http.response.body", "body": event, "more_body": True}))
    return reshaping.__call__ if impl is None else send


def measure(name: str, vllm: str, passes: int) -> dict[str, float]:
    case = load_case(name, vllm)
    events = case.events()
    plan = plan_request(case.body, case.endpoint, Mode.NVEXT)
    assert plan is not None and plan.reshapes_response
    deltas = [e for e in events[2:] if b'"finish_reason":null' in e]
    variants: dict[str, Callable[[], Callable[[dict[str, Any]], Awaitable[None]]]] = {
        "server send": lambda: _server_send,
        "floor": lambda: _floor_send,
        "general path": lambda: _armed(plan, events[:2], None),
        "python send": lambda: _armed(plan, events[:2], "python"),
    }
    if "c" in KERNELS:
        variants["compiled send"] = lambda: _armed(plan, events[:2], "c")
    per_pass: dict[str, list[float]] = {k: [] for k in variants}
    clock = time.perf_counter_ns
    order = list(variants)
    gc.collect()
    for i in range(passes):
        k = i % len(order)
        for key in order[k:] + order[:k]:
            send = variants[key]()
            messages = [{"type": "http.response.body", "body": e, "more_body": True} for e in deltas]
            t0 = clock()
            for message in messages:
                run_sync(send(message))
            per_pass[key].append((clock() - t0) / len(messages))
    base = per_pass["server send"]
    return {k: median([v - b for v, b in zip(values, base, strict=True)]) / 1e3 for k, values in per_pass.items()}


def run(quick: bool = False) -> list[Target]:
    passes = 60 if quick else 300
    rows = []
    for name, vllm in FIXTURES:
        got = measure(name, vllm, passes)
        general, python = got["general path"], got["python send"]
        compiled = got.get("compiled send")
        rows.append([
            f"{name} ({vllm})", fmt(got["floor"], 3), fmt(general, 3), fmt(python, 3),
            "-" if compiled is None else fmt(compiled, 3), f"{python / general:.2f}x",
            "-" if compiled is None else f"{compiled / general:.2f}x",
        ])  # fmt: skip
    print_table(
        "Warm µs per mid-stream delta added over the server's own send (nvext placement, metrics on)",
        ["fixture", "floor", "general path", "python send", "compiled send", "python / general",
         "compiled / general"],
        rows,
        notes=[
            f"{passes} interleaved passes over the stream's mid-stream deltas; median of the per-pass means",
            "floor: a Python send that only awaits the server's; general path: ReshapingSend (what the armed "
            "send hands back); python / compiled send: the armed send handed to vLLM",
        ],
    )  # fmt: skip
    return []  # a side-by-side reading; the targets are bench_serving's


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    run(parser.parse_args().quick)


if __name__ == "__main__":
    main()

"""Memory: peak RSS and Python allocations of the middleware over long streams and a 10 MB unary body,
and the per-stream SSE buffer (`StreamReshaper.buffered`, max over the stream).

Each scenario runs in a fresh child process: it builds its inputs, warms up, resets its RSS
high-water mark (`/proc/self/clear_refs`), runs the scenario once plainly (peak RSS, `VmHWM`,
over the RSS just before) and once under `tracemalloc` (peak of Python allocations).
(`ru_maxrss` is not used: Linux carries it over from the parent across fork + exec.) The upstream
generates stream events lazily from the recorded long fixture and the client side keeps nothing,
so whatever grows is the middleware's.

Streams are driven through `reshaping.ReshapingSend`, the very send wrapper the middleware hands vLLM, so its
`StreamReshaper` can be read after every message. `split` feeds the bytes in random-size pieces
(1 B .. 8 KB, crossing event boundaries) to make the framer hold partial events.

Run: python -m benchmarks.bench_memory [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import resource
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

from ._common import (
    ROOT,
    SSE_HEADERS,
    Target,
    current_rss_bytes,
    fmt_size,
    http_scope,
    json_app,
    load_case,
    print_table,
    print_targets,
    receive_body,
    request_body,
)
from .bench_asgi import UNARY_TEMPLATE, unary_body

STREAM_FIXTURE = "chat_stream_ids_long"
UNARY_MODES = ("direct", "vllm", "nvext", "both")
TARGET_MEMORY = "streaming memory bounded by the largest event"
TARGET_UNARY = "unary reshaping (nvext, both): peak added memory <= 3x the body, 0.32 and 0.33"
UNARY_LIMIT = 3.0
VLLM_VERSIONS = ("0.32", "0.33")


# --------------------------------------------------------------------------- child side


def _event_source(n_events: int) -> tuple[Callable[[], Iterator[bytes]], int]:
    """A factory of lazy event iterators (first, token chunks cycled, finish, [DONE]) and the largest event."""
    events = load_case(STREAM_FIXTURE).json_events()
    first, last = events[0], events[-1]
    middle = [e for e in events[1:-1] if b'"finish_reason":null' in e]

    def iterate() -> Iterator[bytes]:
        yield first
        for i in range(max(0, n_events - 2)):
            yield middle[i % len(middle)]
        yield last
        yield b"data: [DONE]\n\n"

    return iterate, max(len(e) for e in events)


def _pieces(chunks: Iterator[bytes], seed: int) -> Iterator[bytes]:
    """Re-cut a byte stream into random-size pieces (1 B .. 8 KB) that ignore event boundaries."""
    rng = random.Random(seed)
    pending = bytearray()
    want = rng.randint(1, 8192)
    for chunk in chunks:
        pending += chunk
        while len(pending) >= want:
            yield bytes(pending[:want])
            del pending[:want]
            want = rng.randint(1, 8192)
    if pending:
        yield bytes(pending)


class _CountingSink:
    __slots__ = ("body_bytes",)

    def __init__(self) -> None:
        self.body_bytes = 0

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.body_bytes += len(message.get("body", b""))


def _stream_scenario(mode: str, n_events: int, split: bool) -> Callable[[], dict[str, Any]]:
    from vllm_nvext.config import Mode
    from vllm_nvext.inbound.request import plan_request
    from vllm_nvext.outbound.nvext_values import Clock
    from vllm_nvext.send import ReshapingSend

    case = load_case(STREAM_FIXTURE)
    iterate, largest = _event_source(n_events)
    plan = plan_request(case.body, case.endpoint, Mode(mode)) if mode != "direct" else None

    async def drive() -> dict[str, Any]:
        sink = _CountingSink()
        reshaping = None if plan is None else ReshapingSend(plan, Clock(), sink)
        send: Any = sink if reshaping is None else reshaping.app_send
        await send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)})
        source = _pieces(iterate(), seed=n_events) if split else iterate()
        max_buffered = messages = 0
        for piece in source:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            messages += 1
            if reshaping is not None and reshaping._stream is not None:
                max_buffered = max(max_buffered, reshaping._stream.buffered)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return {"max_buffered": max_buffered, "largest_event": largest, "messages": messages,
                "client_bytes": sink.body_bytes}  # fmt: skip

    return lambda: asyncio.run(drive())


def _unary_scenario(mode: str, body_file: str, vllm: str) -> Callable[[], dict[str, Any]]:
    from vllm_nvext import NvextMiddleware

    case = load_case(UNARY_TEMPLATE, vllm)
    body = Path(body_file).read_bytes()  # built by the parent: no build-time objects in this process
    app = json_app(body)
    target = app if mode == "direct" else NvextMiddleware(app, mode=mode)
    request = request_body(case, opt_in=True)

    async def drive() -> dict[str, Any]:
        sink = _CountingSink()
        await target(http_scope(case.path, request), receive_body(request), sink)
        return {"body_bytes": len(body), "client_bytes": sink.body_bytes}

    return lambda: asyncio.run(drive())


def child(spec: dict[str, Any]) -> dict[str, Any]:
    if spec["kind"] == "stream":
        scenario = _stream_scenario(spec["mode"], spec["events"], spec["split"])
    else:
        scenario = _unary_scenario(spec["mode"], spec["body_file"], spec["vllm"])
    if spec["kind"] == "stream":
        _stream_scenario(spec["mode"], 50, spec["split"])()  # warm-up: imports, lazy allocations
    gc.collect()
    rss0 = current_rss_bytes()
    reset = _reset_peak_rss()
    result = scenario()
    peak = _peak_rss_bytes()
    gc.collect()
    tracemalloc.start()
    scenario()
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    result.update(rss_baseline=rss0, rss_peak=peak, traced_peak=traced_peak, peak_reset=reset)
    return result


def _reset_peak_rss() -> bool:
    """Reset this process's RSS high-water mark (Linux: `5` to clear_refs), so the peak is the scenario's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    """VmHWM: unlike `ru_maxrss`, it is not inherited from the parent across fork + exec."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# --------------------------------------------------------------------------- parent side


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_memory", "--child", json.dumps(spec)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"memory scenario {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> list[Target]:
    big = 10_000
    small = 1_000
    unary_size = 2_000_000 if quick else 10_000_000
    stream_specs: list[tuple[str, dict[str, Any]]] = [
        ("direct (no middleware)", {"kind": "stream", "mode": "direct", "events": big, "split": False}),
        ("nvext, 1 event/message", {"kind": "stream", "mode": "nvext", "events": small, "split": False}),
        ("nvext, 1 event/message", {"kind": "stream", "mode": "nvext", "events": big, "split": False}),
        ("nvext, random split", {"kind": "stream", "mode": "nvext", "events": small, "split": True}),
        ("nvext, random split", {"kind": "stream", "mode": "nvext", "events": big, "split": True}),
        ("both, random split", {"kind": "stream", "mode": "both", "events": big, "split": True}),
    ]
    if quick:
        stream_specs = [s for s in stream_specs if s[1]["mode"] != "both"]
    rows = []
    resets: list[bool] = []
    bounded = True
    peaks: dict[tuple[str, bool], dict[int, int]] = {}
    for label, spec in stream_specs:
        r = _run_child(spec)
        resets.append(r["peak_reset"])
        ok = r["max_buffered"] <= r["largest_event"]
        bounded &= ok
        if spec["mode"] != "direct":
            peaks.setdefault((spec["mode"], spec["split"]), {})[spec["events"]] = r["traced_peak"]
        growth = max(0, r["rss_peak"] - r["rss_baseline"])
        rows.append([label, f"{spec['events']:,}", f"{r['messages']:,}", fmt_size(r["client_bytes"]),
                     "-" if spec["mode"] == "direct" else f"{r['max_buffered']:,} B",
                     f"{r['largest_event']:,} B", "-" if spec["mode"] == "direct" else ("yes" if ok else "NO"),
                     fmt_size(r["traced_peak"]), fmt_size(r["rss_peak"]), fmt_size(growth)])  # fmt: skip
    growth_notes = []
    for (mode, split), by_n in peaks.items():
        if small in by_n and big in by_n:
            ratio = by_n[big] / max(by_n[small], 1)
            flat = by_n[big] <= by_n[small] * 1.5 + 64 * 1024
            bounded &= flat
            growth_notes.append(f"{mode}{' split' if split else ''}: tracemalloc peak at {big:,} events / at "
                                f"{small:,} = {ratio:.2f}x ({'flat' if flat else 'GROWS'})")  # fmt: skip
    print_table(
        "Memory, streams: per-stream buffer and peaks (each row a fresh child process)",
        ["scenario", "events", "messages", "client got", "max buffered", "largest event", "<= largest",
         "tracemalloc peak", "peak RSS", "RSS growth"],
        rows,
        notes=[
            "max buffered = StreamReshaper.buffered after each message: the partial event held back",
            "peak RSS = VmHWM over the run (high-water mark reset just before it); RSS growth = peak - RSS before",
            *growth_notes,
        ],
    )  # fmt: skip

    unary_rows = []
    worst = (0.0, "")
    for vllm in VLLM_VERSIONS:
        with tempfile.NamedTemporaryFile(prefix="vllm-nvext-bench-", suffix=".json") as f:
            f.write(unary_body(json.loads(load_case(UNARY_TEMPLATE, vllm).raw), unary_size))
            f.flush()
            results = {
                m: _run_child({"kind": "unary", "mode": m, "body_file": f.name, "vllm": vllm}) for m in UNARY_MODES
            }
        resets += [r["peak_reset"] for r in results.values()]
        for mode, r in results.items():
            body = r["body_bytes"]
            growth = max(0, r["rss_peak"] - r["rss_baseline"])
            if mode in ("nvext", "both"):
                worst = max(worst, (r["traced_peak"] / body, f"{vllm} {mode}"))
            unary_rows.append([vllm, mode, fmt_size(body), fmt_size(r["client_bytes"]), fmt_size(r["traced_peak"]),
                               f"{r['traced_peak'] / body:.1f}x", fmt_size(r["rss_peak"]), fmt_size(growth),
                               f"{growth / body:.1f}x"])  # fmt: skip
    print_table(
        "Memory, unary chat.completion (return_token_ids + logprobs) through the middleware",
        ["vLLM", "mode", "body", "client got", "tracemalloc peak", "/ body", "peak RSS", "RSS growth", "/ body"],
        unary_rows,
        notes=[
            "the body is read from a file before the baseline: neither peak counts the upstream's copy",
            "vllm: the request needs no reshaping and the server's send is used: nothing is buffered",
            "nvext/both: the logprobs the plan never reads are cut out of the bytes before decoding and put "
            "back after (vllm_nvext/outbound/unary.py): the joined body, a small decoded rest and the new body",
            *([] if all(resets) else ["could not reset VmHWM here: peak RSS includes start-up"]),
        ],
    )
    return [
        Target(TARGET_MEMORY, bounded, "max buffered <= largest event in every stream; peak flat 1k -> 10k events"
               if bounded else "see the memory table"),
        Target(TARGET_UNARY, worst[0] <= UNARY_LIMIT, f"worst {worst[1]}: tracemalloc peak {worst[0]:.1f}x the body"),
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a 2 MB unary body, fewer stream scenarios")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    print_targets(run(args.quick))


if __name__ == "__main__":
    main()

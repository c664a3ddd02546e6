"""Real server: the tiny model on vLLM (CPU), stock vs with `--middleware vllm_nvext.NvextMiddleware`.

Both servers run at once (when memory allows) and runs alternate raw, middleware, raw, middleware...
so that the machine's drift hits both sides alike. Each run is `c` concurrent chat streams with a
fixed length (`max_tokens`, `ignore_eos`), read with httpx.AsyncClient: output tokens/s over the
run, TTFT (request sent -> first token event) and inter-token latency (gap between token events),
pooled over streams and rounds; ratios against the matching raw request:

  raw ids      stock vLLM, `return_token_ids: true`        baseline of vllm / nvext / both
  raw plain    stock vLLM, no opt-in                        baseline of mw plain
  mw plain     middleware, no opt-in (bytes pass through)
  mw vllm|nvext|both   middleware, `return_token_ids: true`, mode from the `x-nvext-mode` header

With under 9 GiB of memory available (each server takes ~3.5 GB) the benchmark waits, then falls
back to the middleware server alone and compares each mode with its own opt-into-nothing request
(it says so in the output): running the two servers one after the other would not be A/B.

Run: python -m benchmarks.bench_server [--quick] [--single-server] [--concurrency 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from vllm_nvext.protocol import PATHS, Endpoint
from vllm_nvext.tools import tiny_model
from vllm_nvext.tools.server import MIDDLEWARE, TINY_ARGS, VllmServer

from ._common import (
    Target,
    fmt,
    fmt_ratio,
    median,
    mem_available_bytes,
    percentile,
    print_table,
    print_targets,
    run_loop,
)

MODEL = "tiny"
_SEQUENCE = itertools.count()
NEEDED_FOR_TWO = 9 * 2**30
MESSAGES = [{"role": "user", "content": "Tell me about token ids."}]
TARGET_SERVER = "64 streams: mw tokens/s >= 0.98x raw and p99 ITL within 2%"
SERVER_ARGS = (*TINY_ARGS, "--served-model-name", MODEL, "--disable-uvicorn-access-log")


@dataclass(frozen=True)
class Variant:
    label: str
    server: str  # "raw" | "mw"
    opt_in: bool  # return_token_ids: true
    mode: str | None  # x-nvext-mode header
    baseline: str | None  # label of the variant it is compared with


TWO_SERVERS = (
    Variant("raw ids", "raw", True, None, None),
    Variant("mw nvext", "mw", True, "nvext", "raw ids"),
    Variant("raw plain", "raw", False, None, None),
    Variant("mw plain", "mw", False, None, "raw plain"),
    Variant("raw ids", "raw", True, None, None),
    Variant("mw both", "mw", True, "both", "raw ids"),
    Variant("raw ids", "raw", True, None, None),
    Variant("mw vllm", "mw", True, "vllm", "raw ids"),
)
ONE_SERVER = (
    Variant("mw plain", "mw", False, None, None),
    Variant("mw nvext", "mw", True, "nvext", "mw plain"),
    Variant("mw plain", "mw", False, None, None),
    Variant("mw both", "mw", True, "both", "mw plain"),
    Variant("mw plain", "mw", False, None, None),
    Variant("mw vllm", "mw", True, "vllm", "mw plain"),
)


@dataclass
class Runs:
    """Everything measured for one variant at one concurrency."""

    tokens_per_s: list[float] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # when each run happened, to pair it with its neighbour
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    tokens: int = 0
    server_cpu_s: float = 0.0  # CPU time of the API-server process (where the middleware runs) over the runs


def request_json(opt_in: bool, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opt_in:
        body["return_token_ids"] = True
    return body


async def one_stream(
    client: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]
) -> tuple[int, float, list[float], float]:
    """One streamed chat completion: (completion tokens, TTFT s, inter-token gaps s, time per output token s)."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    async with client.stream("POST", PATHS[Endpoint.CHAT], json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:500]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if '"choices":[]' in line:  # the usage-only chunk
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            elif '"role":"assistant"' not in line:  # the role chunk carries no token
                stamps.append(now)
    if not stamps:
        raise RuntimeError("a stream carried no token events")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    tokens = tokens or len(stamps)
    tpot = (stamps[-1] - stamps[0]) / max(tokens - 1, 1)
    return tokens, stamps[0] - t0, gaps, tpot


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_run(server: tuple[str, int], variant: Variant, concurrency: int, per_worker: int, max_tokens: int,
                  runs: Runs) -> None:  # fmt: skip
    url, pid = server
    body = request_json(variant.opt_in, max_tokens)
    headers = {"x-nvext-mode": variant.mode} if variant.mode else {}
    # A client per run: a connection left idle while the other server runs would hit uvicorn's 5 s
    # keep-alive timeout, and reusing one the server is closing fails with a ReadError.
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:

        async def worker() -> list[tuple[int, float, list[float], float]]:
            return [await one_stream(client, body, headers) for _ in range(per_worker)]

        cpu0 = process_cpu_s(pid)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        runs.server_cpu_s += process_cpu_s(pid) - cpu0
    total = 0
    for worker_results in results:
        for tokens, ttft, gaps, tpot in worker_results:
            total += tokens
            runs.ttft.append(ttft)
            runs.itl.extend(gaps)
            runs.tpot.append(tpot)
    runs.tokens += total
    runs.tokens_per_s.append(total / wall)
    runs.positions.append(next(_SEQUENCE))


async def measure(servers: dict[str, tuple[str, int]], variants: tuple[Variant, ...], levels: list[int],
                  rounds: int, max_tokens: int) -> dict[int, dict[str, Runs]]:  # fmt: skip
    # Warm-up: every request shape once on its server, a few at a time.
    for v in {(v.server, v.opt_in, v.mode): v for v in variants}.values():
        await one_run(servers[v.server], v, 4, 1, max_tokens, Runs())
    results: dict[int, dict[str, Runs]] = {}
    for c in levels:
        per_worker = max(1, 4 // c)  # a few sequential streams at low concurrency: more ITL samples
        by_label: dict[str, Runs] = {}
        t0 = time.perf_counter()
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]  # ABAB then BABA: no side always goes first
            for v in order:
                await one_run(servers[v.server], v, c, per_worker, max_tokens, by_label.setdefault(v.label, Runs()))
        results[c] = by_label
        print(f"  concurrency {c}: {rounds} rounds in {time.perf_counter() - t0:.0f} s", flush=True)
    return results


def _nearest(base: Runs, position: int) -> float:
    """The baseline run closest in time to a middleware run (its A/B partner)."""
    i = min(range(len(base.positions)), key=lambda k: abs(base.positions[k] - position))
    return base.tokens_per_s[i]


def _table(results: dict[int, dict[str, Runs]], variants: tuple[Variant, ...], max_tokens: int,
           notes: list[str]) -> dict[str, tuple[float, float]]:  # fmt: skip
    """Print the table; return {variant: (tokens/s ratio, ITL p99 ratio)} at the highest concurrency."""
    base_of = {v.label: v.baseline for v in variants}
    rows = []
    top: dict[str, tuple[float, float]] = {}
    top_c = max(results)
    for c, by_label in results.items():
        for label, runs in by_label.items():
            base = by_label.get(base_of[label] or "")
            tps = median(runs.tokens_per_s)
            itl50, itl99 = percentile(runs.itl, 50) * 1e3, percentile(runs.itl, 99) * 1e3
            ratio = itl_ratio = tpot_ratio = float("nan")
            spread = added_cpu = "-"
            cpu_us = runs.server_cpu_s / max(runs.tokens, 1) * 1e6
            if base is not None:
                ratio = tps / median(base.tokens_per_s)
                itl_ratio = itl99 / (percentile(base.itl, 99) * 1e3)
                tpot_ratio = percentile(runs.tpot, 50) / percentile(base.tpot, 50)
                added_cpu = fmt(cpu_us - base.server_cpu_s / max(base.tokens, 1) * 1e6, 1)
                paired = [tps_i / _nearest(base, pos) for tps_i, pos in zip(runs.tokens_per_s, runs.positions,
                                                                             strict=True)]  # fmt: skip
                spread = f"{min(paired):.2f}..{max(paired):.2f}"
                if c == top_c:
                    top[label] = (ratio, itl_ratio)
            rows.append([str(c), label, str(len(runs.tokens_per_s)), fmt(tps, 0), fmt_ratio(ratio), spread,
                         fmt(percentile(runs.ttft, 50) * 1e3, 1), fmt(percentile(runs.ttft, 99) * 1e3, 1),
                         fmt(percentile(runs.tpot, 50) * 1e3, 2), fmt_ratio(tpot_ratio), fmt(itl50, 2),
                         fmt(itl99, 2), fmt_ratio(itl_ratio), fmt(cpu_us, 1), added_cpu])  # fmt: skip
    print_table(
        f"Real server: tiny model on vLLM (CPU), {max_tokens} tokens per stream (ignore_eos)",
        ["streams", "variant", "runs", "tokens/s", "vs base", "per-round", "TTFT p50 ms", "TTFT p99 ms",
         "TPOT p50 ms", "TPOT vs base", "ITL p50 ms", "ITL p99 ms", "ITL p99 vs base", "API CPU us/token",
         "added us/token"],
        rows,
        notes=notes,
    )  # fmt: skip
    return top


class ServerGone(RuntimeError):
    """A server process exited during the benchmark (another job stopped it: the machine is shared)."""


def _serve_and_measure(
    two: bool, variants: tuple[Variant, ...], levels: list[int], rounds: int, max_tokens: int
) -> dict[int, dict[str, Runs]]:
    model = str(tiny_model.ensure())
    servers = {"mw": VllmServer(model=model, args=(*SERVER_ARGS, "--middleware", MIDDLEWARE), name="bench-mw")}
    if two:
        servers["raw"] = VllmServer(model=model, args=SERVER_ARGS, name="bench-raw")
    ok = False
    try:
        t0 = time.perf_counter()
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(timeout=float(os.environ.get("VLLM_NVEXT_STARTUP_TIMEOUT", "600")))
        print(f"  servers ready in {time.perf_counter() - t0:.0f} s", flush=True)
        try:
            targets = {name: (server.url, server.proc.pid) for name, server in servers.items() if server.proc}
            results = run_loop(measure(targets, variants, levels, rounds, max_tokens))
        except (httpx.HTTPError, RuntimeError) as exc:
            gone = [
                f"{s.name} (exit {s.proc.returncode})" for s in servers.values() if s.proc and s.proc.poll() is not None
            ]
            if gone:
                raise ServerGone(f"vLLM server {', '.join(gone)} exited mid-run ({type(exc).__name__})") from exc
            raise
        ok = True
        return results
    finally:
        for server in servers.values():
            server.stop()
            if ok and server.log_path is not None:
                server.log_path.unlink(missing_ok=True)
            elif server.log_path is not None:
                print(f"  server log kept: {server.log_path}", flush=True)


def run(
    quick: bool = False, single: bool = False, levels: list[int] | None = None, wait_s: float = 60.0
) -> list[Target]:
    levels = levels or [1, 16, 64]
    rounds = 2 if quick else 4
    max_tokens = 32 if quick else 64

    available = mem_available_bytes()
    deadline = time.monotonic() + (0 if single else wait_s)
    while not single and available < NEEDED_FOR_TWO and time.monotonic() < deadline:
        print(f"  {available / 2**30:.1f} GiB available, two servers need {NEEDED_FOR_TWO / 2**30:.0f}: waiting",
              flush=True)  # fmt: skip
        time.sleep(10)
        available = mem_available_bytes()
    two = not single and available >= NEEDED_FOR_TWO
    layout = "two servers at once (raw and middleware), A/B alternating"
    if not two:
        why = "--single-server" if single else f"only {available / 2**30:.1f} GiB available (< 9 GiB)"
        layout = (f"ONE server ({why}): the middleware server alone; each mode is compared with the request that "
                  "opts into nothing on the same server (bytes pass through), not with stock vLLM")  # fmt: skip
    print(f"  layout: {layout}", flush=True)

    variants = TWO_SERVERS if two else ONE_SERVER
    for attempt in (1, 2):
        try:
            results = _serve_and_measure(two, variants, levels, rounds, max_tokens)
            break
        except ServerGone as exc:
            if attempt == 2:
                raise
            print(f"  {exc}; starting the server(s) again, once", flush=True)

    notes = [
        layout,
        f"{rounds} rounds per concurrency, variant order reversed every other round; concurrency 1 runs 4 streams "
        "back to back per run",
        "tokens/s: usage.completion_tokens of all streams / run wall time, median over runs; per-round = range of "
        "run-by-run ratios (the noise floor on this shared 2-core machine)",
        "client (httpx on uvloop, this process), both servers and other engineers' jobs share the same 2 cores",
        "TTFT: request sent -> first token event (a fresh client per run: includes a loopback connect); "
        "TPOT: per stream (last - first token event) / (tokens - 1); "
        "ITL: gaps between token events as the client reads them (events read together give ~0 gaps)",
        "API CPU us/token: CPU time of the API-server process (where the middleware runs; not the engine core) "
        "over all runs / tokens; added = minus the baseline's: the middleware's in-server cost, immune to other "
        "jobs' load (10 ms tick resolution, summed over runs)",
    ]
    top = _table(results, variants, max_tokens, notes)
    c = max(levels)
    if not top:
        return [Target(TARGET_SERVER, None, "no middleware variant measured")]
    worst_tps = min(top, key=lambda k: top[k][0])
    worst_itl = max(top, key=lambda k: top[k][1])
    passed = top[worst_tps][0] >= 0.98 and top[worst_itl][1] <= 1.02
    detail = (f"at {c}: worst tokens/s {worst_tps} {top[worst_tps][0]:.3f}x, worst ITL p99 {worst_itl} "
              f"{top[worst_itl][1]:.3f}x" + ("" if two else " (one server: vs opt-into-nothing)"))  # fmt: skip
    return [Target(TARGET_SERVER, passed, detail)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 32 tokens per stream")
    parser.add_argument("--single-server", action="store_true", help="middleware server only (see above)")
    parser.add_argument("--concurrency", default="1,16,64", help="comma-separated stream counts")
    parser.add_argument("--wait", type=float, default=60.0, help="seconds to wait for memory before one server")
    args = parser.parse_args()
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    print_targets(run(args.quick, args.single_server, levels, args.wait))


if __name__ == "__main__":
    main()

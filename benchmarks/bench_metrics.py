"""What the Prometheus counters cost: per reshaped event, per stream and per request.

(a) Per reshaped event: whole recorded streams through the `reshaping.ReshapingSend` send vLLM calls, with
    counting on (a countdown of body messages, the first two and then one in 32 timed, the
    counters added once at the end) and off (`_tally` None, what runs without
    prometheus_client); (on - off) / events per pass, median over interleaved passes. The
    events themselves are not counted per event: a stream's count is its messages (from the
    countdown) plus what the rare framed path tallies.
(b) Fixed costs, median of many calls: adding one stream's counts at its end; counting one
    request (what a request that opts into nothing pays), in this process and in
    prometheus_client's multiprocess mode (`--api-server-count > 1`).

Run: python -m benchmarks.bench_metrics [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Any

from vllm_nvext import metrics
from vllm_nvext.config import Mode
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.protocol import Dialect, Endpoint
from vllm_nvext.send import ReshapingSend

from ._common import SSE_HEADERS, Target, fmt, load_case, median, percentile, print_table, run_sync

FIXTURE_NAMES = ("chat_stream_ids", "completions_stream_ids_long", "chat_stream_ids_long")
LONG_FIXTURE = "chat_stream_ids_long"
TARGET_COUNTING = "reshaped events: counting adds a few tens of ns per event (median <= 50 ns)"
_START = {"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)}
_END = {"type": "http.response.body", "body": b"", "more_body": False}


async def _noop_send(message: Any) -> None:
    return None


def _stream_pass(plan: Any, messages: list[dict[str, Any]], counting: bool) -> int:
    """One whole stream through the send wrapper; the CPU time of this thread in ns (immune to preemption)."""
    clock = time.thread_time_ns
    t0 = clock()
    reshaping = ReshapingSend(plan, Clock(), _noop_send)
    run_sync(reshaping.app_send(dict(_START)))
    if not counting:
        reshaping._tally = None
    for message in messages:
        run_sync(reshaping.app_send(message))
    run_sync(reshaping.app_send(_END))
    reshaping.count_stream()
    return clock() - t0


def bench_per_event(name: str, passes: int, repeat: int = 1) -> tuple[list[str], float]:
    """One row of table (a); `repeat` > 1 repeats the stream's mid-stream deltas (a longer stream)."""
    case = load_case(name)
    events = case.events()
    if repeat > 1:
        events = events[:2] + events[2:-3] * repeat + events[-3:]
        name = f"{name}, deltas x{repeat}"
    body = case.body.replace(b'"return_token_ids":true', b'"nvext":{"extra_fields":["completion_token_ids"]}')
    plan = plan_request(body, case.endpoint, Mode.AUTO)
    assert plan is not None and plan.reshapes_response, "a benchmark of nothing"
    messages = [{"type": "http.response.body", "body": e, "more_body": True} for e in events]
    on: list[int] = []
    off: list[int] = []
    gc.collect()
    for i in range(passes):
        if i % 2:
            off.append(_stream_pass(plan, messages, False))
            on.append(_stream_pass(plan, messages, True))
        else:
            on.append(_stream_pass(plan, messages, True))
            off.append(_stream_pass(plan, messages, False))
    n = len(events)
    added = [(a - b) / n for a, b in zip(on, off, strict=True)]
    per_event_off = median(off) / n
    row = [name, str(n), fmt(per_event_off / 1e3), fmt(median(on) / n / 1e3), fmt(median(added), 1),
           fmt(percentile(added, 90), 1), f"{median(added) / per_event_off * 100:.1f}%"]  # fmt: skip
    return row, median(added)


def _per_call_ns(fn: Any, calls: int) -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(max(5, calls // 1000)):
        t0 = clock()
        for _ in range(1000):
            fn()
        samples.append((clock() - t0) / 1000)
    return median(samples)


def _multiprocess_request_ns(calls: int) -> float | None:
    """count_request in a fresh process with PROMETHEUS_MULTIPROC_DIR set, as vLLM's API servers run."""
    script = textwrap.dedent(
        f"""
        import time
        from vllm_nvext import metrics
        from vllm_nvext.config import Mode
        from vllm_nvext.protocol import Dialect, Endpoint
        metrics.count_request(Endpoint.CHAT, Dialect.NONE, Mode.AUTO, "unknown")
        samples = []
        for _ in range({max(5, calls // 1000)}):
            t0 = time.perf_counter_ns()
            for _ in range(1000):
                metrics.count_request(Endpoint.CHAT, Dialect.NONE, Mode.AUTO, "unknown")
            samples.append((time.perf_counter_ns() - t0) / 1000)
        samples.sort()
        print(samples[len(samples) // 2])
        """
    )
    with tempfile.TemporaryDirectory() as directory:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": directory}
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    return float(proc.stdout.strip()) if proc.returncode == 0 else None


def run(quick: bool = False) -> list[Target]:
    if not metrics.enabled():
        return [Target(TARGET_COUNTING, None, "prometheus_client is not installed: counting is off")]
    passes = 100 if quick else 600
    calls = 50_000 if quick else 300_000
    rows = []
    for name in FIXTURE_NAMES:
        row, _ = bench_per_event(name, passes)
        rows.append(row)
    # A long stream: the fixed per-stream costs vanish and the marginal per-event cost remains.
    row, marginal = bench_per_event(LONG_FIXTURE, max(20, passes // 10), repeat=10)
    rows.append(row)
    print_table(
        "(a) Per reshaped event: the ReshapingSend path with counting on vs off (nvext placement)",
        ["fixture", "events", "off us/event", "on us/event", "added ns/event (median)", "p90 ns", "added"],
        rows,
        notes=[
            f"{passes} interleaved passes per fixture, each a whole stream (start, every event, end, count_stream), "
            "timed in thread CPU time (time.thread_time_ns), so that other jobs preempting this one do not count",
            "added = (on - off) / events per pass: the message countdown, the timed messages (the first two, "
            "then one in 32) and the end-of-stream counter update spread over the stream's events",
            "deltas x10: the recorded mid-stream deltas repeated ten times (fixed per-stream costs "
            "spread over ~3,000 events: the marginal cost per event)",
        ],
    )

    endpoint, mode = Endpoint.CHAT, Mode.AUTO
    request_ns = _per_call_ns(lambda: metrics.count_request(endpoint, Dialect.NONE, mode, metrics.UNKNOWN), calls)
    tally = metrics.StreamTally()
    for ns in (20_000, 1_000, 1_000, 1_000, 1_000, 1_000, 1_000, 1_000, 1_000, 1_000, 1_000):  # ~300 messages
        tally.add(ns)
    stream_end_ns = _per_call_ns(lambda: tally.count(endpoint, 7, 1, 0), calls)
    multi_ns = _multiprocess_request_ns(calls)
    print_table(
        "(b) Fixed costs (median ns per call)",
        ["what", "where", "ns"],
        [
            [
                "StreamTally.count: a stream's events and seconds added",
                "once per reshaped response",
                fmt(stream_end_ns, 0),
            ],
            ["count_request", "once per request (opt into nothing too)", fmt(request_ns, 0)],
            [
                "count_request, multiprocess mode (mmap files)",
                "once per request, --api-server-count > 1",
                fmt(multi_ns, 0) if multi_ns is not None else "failed",
            ],
        ],  # fmt: skip
        notes=["a request that opts into nothing pays count_request once and nothing per event"],
    )
    return [
        Target(
            TARGET_COUNTING,
            marginal <= 50.0,
            f"{marginal:.1f} ns/event on a long stream; {stream_end_ns / 1e3:.2f} us once per stream",
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer passes")
    args = parser.parse_args()
    from ._common import print_targets

    print_targets(run(args.quick))


if __name__ == "__main__":
    main()

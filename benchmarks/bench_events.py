"""Per-event cost of the middleware's streaming path on chunks recorded from the real server.

(a) A request that opts into nothing: the middleware hands vLLM the server's own `send`, so the
    per-event cost should be ~0. Measured through the ASGI layer: a dummy app emitting the
    fixture's events, called directly and behind `NvextMiddleware`, once with the events and once
    with none; (with - without) / events is the marginal per-event cost, the empty call the fixed
    per-request cost. A `vllm` plan (`reshapes_response` False) takes the same path.
(b) Each reshaping plan (`plan_request` on the fixture's request with that mode): per event, the
    `StreamReshaper.feed` core (framing + reshaping), and the whole `reshaping.ReshapingSend` send wrapper vLLM calls
    (less what a plain `send` costs), against
(c) the floor: one `orjson.loads` + `orjson.dumps` of the same event's payload.

Every event is timed on its own with `perf_counter_ns` (less the timer's own cost); variants are
interleaved pass by pass so machine noise hits them alike. `CPU mean` is process CPU time over
whole passes divided by events (includes the loop and timer: a cross-check, not the headline).

Run: python -m benchmarks.bench_events [--quick]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable, Coroutine, MutableMapping
from functools import partial
from typing import Any

import orjson

from vllm_nvext import NvextMiddleware
from vllm_nvext.config import Mode
from vllm_nvext.inbound.request import Plan, plan_request
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.outbound.sse import data_payload
from vllm_nvext.outbound.stream import StreamReshaper
from vllm_nvext.send import ReshapingSend

from ._common import (
    SSE_HEADERS,
    Case,
    Sink,
    Target,
    fmt,
    fmt_ratio,
    http_scope,
    load_case,
    median,
    percentile,
    print_table,
    receive_body,
    request_body,
    run_sync,
    sse_app,
    timer_overhead_ns,
)

FIXTURE_NAMES = ("chat_stream_ids", "chat_stream_ids_long", "completions_stream_ids", "completions_stream_ids_long")
MODES = (Mode.VLLM, Mode.NVEXT, Mode.BOTH)
TARGET_PASS_THROUGH = "opt-into-nothing added cost per event < 1 us (median)"
TARGET_RESHAPE = "reshaped event median added cost <= 1.5x orjson round-trip floor"


class _Samples:
    """Per-event samples (ns) and whole-pass process CPU time of one variant."""

    __slots__ = ("ns", "cpu_ns", "events")

    def __init__(self) -> None:
        self.ns: list[int] = []
        self.cpu_ns = 0
        self.events = 0


async def _noop_send(message: MutableMapping[str, Any]) -> None:
    return None


def _floor_pass(payloads: list[bytes], out: _Samples) -> None:
    clock = time.perf_counter_ns
    loads, dumps = orjson.loads, orjson.dumps
    ns = out.ns
    for payload in payloads:
        t0 = clock()
        dumps(loads(payload))
        ns.append(clock() - t0)


def _reshape_pass(plan: Plan, events: list[bytes], sampled: list[bool], out: _Samples) -> None:
    """What `_on_stream_body` does with each message's bytes, minus the ASGI message handling."""
    clock = time.perf_counter_ns
    feed = StreamReshaper(plan, Clock()).feed
    ns = out.ns
    for event, keep in zip(events, sampled, strict=True):
        t0 = clock()
        feed(event)
        t1 = clock()
        if keep:
            ns.append(t1 - t0)


def _send_path_pass(plan: Plan, messages: list[dict[str, Any]], sampled: list[bool], out: _Samples) -> None:
    """The `reshaping.ReshapingSend` send vLLM calls for every body message, down to a send that does nothing."""
    clock = time.perf_counter_ns
    reshaping = ReshapingSend(plan, Clock(), _noop_send)
    run_sync(reshaping.app_send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)}))
    ns = out.ns
    for message, keep in zip(messages, sampled, strict=True):
        t0 = clock()
        run_sync(reshaping.app_send(message))
        t1 = clock()
        if keep:
            ns.append(t1 - t0)
    run_sync(reshaping.app_send({"type": "http.response.body", "body": b"", "more_body": False}))


def _plain_send_pass(messages: list[dict[str, Any]], sampled: list[bool], out: _Samples) -> None:
    """What the app pays for `await send(message)` without the middleware: subtracted from the send path."""
    clock = time.perf_counter_ns
    ns = out.ns
    for message, keep in zip(messages, sampled, strict=True):
        t0 = clock()
        run_sync(_noop_send(message))
        t1 = clock()
        if keep:
            ns.append(t1 - t0)


def _timed(out: _Samples, events: int, fn: Callable[[], None]) -> None:
    c0 = time.process_time_ns()
    fn()
    out.cpu_ns += time.process_time_ns() - c0
    out.events += events


def _check_reshaped(plan: Plan, events: list[bytes], mode: Mode) -> None:
    """Fail loudly if the plan would not actually reshape these events (a benchmark of nothing)."""
    stream = StreamReshaper(plan, Clock())
    out = b"".join(stream.feed(e) for e in events)
    if mode is not Mode.VLLM and b'"nvext"' not in out:
        raise AssertionError(f"mode {mode.value}: the reshaped stream carries no nvext object")


def bench_reshaping(case: Case, samples: int, overhead: float) -> tuple[list[list[str]], dict[str, float]]:
    """Table (b) rows for one fixture, and the ratio to the floor per reshaping mode."""
    events = case.events()
    sampled = [data_payload(e) is not None and e.strip() != b"data: [DONE]" for e in events]
    payloads = []
    for event, keep in zip(events, sampled, strict=True):
        if keep:
            span = data_payload(event)
            assert span is not None
            payloads.append(event[span[0] : span[1]])
    n_json = len(payloads)
    messages = [{"type": "http.response.body", "body": e, "more_body": True} for e in events]

    plans: dict[Mode, Plan | None] = {m: plan_request(case.body, case.endpoint, m) for m in MODES}
    reshaping = {m: p for m, p in plans.items() if p is not None and p.reshapes_response}
    for mode, plan in reshaping.items():
        _check_reshaped(plan, events, mode)

    floor, plain = _Samples(), _Samples()
    core = {m: _Samples() for m in reshaping}
    path = {m: _Samples() for m in reshaping}
    jobs: list[tuple[_Samples, Callable[[], None]]] = [
        (floor, lambda: _floor_pass(payloads, floor)),
        (plain, lambda: _plain_send_pass(messages, sampled, plain)),
    ]
    for mode, plan in reshaping.items():
        jobs.append((core[mode], partial(_reshape_pass, plan, events, sampled, core[mode])))
        jobs.append((path[mode], partial(_send_path_pass, plan, messages, sampled, path[mode])))

    passes = max(20, samples // max(n_json, 1))
    gc.collect()
    for i in range(passes):
        k = i % len(jobs)  # rotate the order: no variant always runs first after a pause
        for out, job in jobs[k:] + jobs[:k]:
            _timed(out, n_json, job)

    def stats(s: _Samples, minus: float = 0.0) -> tuple[float, float, float]:
        values = [max(0.0, v - overhead - minus) for v in s.ns]
        return median(values) / 1e3, percentile(values, 99) / 1e3, s.cpu_ns / max(s.events, 1) / 1e3

    f_med, f_p99, f_cpu = stats(floor)
    rows = [[case.name, str(n_json), "(c) floor: orjson loads+dumps", fmt(f_med), fmt(f_p99), fmt(f_cpu), "1.00x"]]
    ratios: dict[str, float] = {}
    plain_med = median([max(0.0, v - overhead) for v in plain.ns])
    for mode in MODES:
        if mode not in reshaping:
            why = "plan None" if plans[mode] is None else "reshapes_response False"
            rows.append(["", "", f"(b) {mode.value}: {why} -> server's send, see (a)", "-", "-", "-", "-"])
            continue
        c_med, c_p99, c_cpu = stats(core[mode])
        s_med, s_p99, s_cpu = stats(path[mode], plain_med)
        ratios[mode.value] = c_med / f_med
        rows.append(["", "", f"(b) {mode.value}: StreamReshaper.feed", fmt(c_med), fmt(c_p99), fmt(c_cpu),
                     fmt_ratio(c_med / f_med)])  # fmt: skip
        rows.append(["", "", f"(b) {mode.value}: ReshapingSend - plain send", fmt(s_med), fmt(s_p99), fmt(s_cpu),
                     fmt_ratio(s_med / f_med)])  # fmt: skip
    return rows, ratios


def bench_pass_through(case: Case, passes: int) -> tuple[list[list[str]], float]:
    """Table (a) rows for one fixture, and the worst marginal per-event median (ns)."""
    events = case.events()
    n = len(events)
    app_n, app_0 = sse_app(events), sse_app([])
    variants = [
        ("opt into nothing (plan None)", request_body(case, opt_in=False), Mode.AUTO),
        ("vllm plan (reshapes_response False)", request_body(case, opt_in=True), Mode.VLLM),
    ]
    rows = []
    worst = 0.0
    clock = time.perf_counter_ns
    for label, body, mode in variants:
        calls: dict[str, Callable[..., Coroutine[Any, Any, None]]] = {
            "direct_n": app_n,
            "mw_n": NvextMiddleware(app_n, mode=mode),
            "direct_0": app_0,
            "mw_0": NvextMiddleware(app_0, mode=mode),
        }
        order = list(calls)
        times: dict[str, list[int]] = {k: [] for k in calls}
        cpu: dict[str, int] = dict.fromkeys(calls, 0)
        gc.collect()
        for i in range(passes):
            k = i % len(order)
            for key in order[k:] + order[:k]:
                scope, receive, sink = http_scope(case.path, body), receive_body(body), Sink()
                app = calls[key]
                c0 = time.process_time_ns()
                t0 = clock()
                run_sync(app(scope, receive, sink))
                t1 = clock()
                cpu[key] += time.process_time_ns() - c0
                times[key].append(t1 - t0)
        per_request = [m - d for m, d in zip(times["mw_0"], times["direct_0"], strict=True)]
        marginal = [((mn - dn) - (m0 - d0)) / n for mn, dn, m0, d0 in
                    zip(times["mw_n"], times["direct_n"], times["mw_0"], times["direct_0"], strict=True)]  # fmt: skip
        amortized = [(mn - dn) / n for mn, dn in zip(times["mw_n"], times["direct_n"], strict=True)]
        cpu_amortized = (cpu["mw_n"] - cpu["direct_n"]) / passes / n
        med = median(marginal)
        worst = max(worst, med)
        rows.append([case.name, str(n), label, fmt(median(per_request) / 1e3), fmt(med, 1),
                     fmt(percentile(marginal, 99), 1), fmt(median(amortized), 1), fmt(cpu_amortized, 1)])  # fmt: skip
    return rows, worst


def run(quick: bool = False) -> list[Target]:
    samples = 4_000 if quick else 25_000
    passes_a = 300 if quick else 1_500
    overhead = timer_overhead_ns()
    cases = [load_case(name) for name in FIXTURE_NAMES]

    rows_a: list[list[str]] = []
    worst_marginal = 0.0
    for case in cases:
        rows, worst = bench_pass_through(case, passes_a)
        rows_a += rows
        worst_marginal = max(worst_marginal, worst)
    print_table(
        "(a) Per event, request that opts into nothing: ASGI app behind NvextMiddleware vs called directly",
        ["fixture", "events", "variant", "per request us", "per event ns (median)", "p99 ns",
         "amortized ns/event", "CPU amortized ns/event"],
        rows_a,
        notes=[
            "per request = middleware call with 0 events minus direct call with 0 events (header scan, body read, "
            "might_opt_in, plan_request for the vllm plan)",
            "per event = ((mw - direct) with the events - (mw - direct) without) / events: the marginal cost",
            "amortized = (mw - direct) / events with the fixed per-request cost spread over this fixture",
            f"{passes_a} interleaved passes per fixture; coroutines driven without an event loop",
        ],
    )  # fmt: skip

    rows_b: list[list[str]] = []
    ratios: dict[str, float] = {}
    for case in cases:
        rows, case_ratios = bench_reshaping(case, samples, overhead)
        rows_b += rows
        for mode, ratio in case_ratios.items():
            ratios[f"{case.name}/{mode}"] = ratio
    print_table(
        "(b)/(c) Per event, reshaping plans vs the orjson round-trip floor",
        ["fixture", "events", "variant", "median us", "p99 us", "CPU mean us", "x floor (median)"],
        rows_b,
        notes=[
            f"~{samples:,} samples per variant and fixture, timer overhead {overhead:.0f} ns subtracted",
            "events = JSON data events (the usage chunk included); [DONE] goes through the framer but is not sampled",
            "StreamReshaper.feed = single-event check (else EventFramer.feed + payload location) "
            "+ StreamReshaper.reshape_event (byte-level for mid-stream deltas, else decode + reshape + encode)",
            "ReshapingSend = the wrapper vLLM's send goes through (adds message handling, bytes copy and join)",
        ],
    )

    worst_key = max(ratios, key=lambda k: ratios[k]) if ratios else ""
    return [
        Target(TARGET_PASS_THROUGH, worst_marginal < 1000.0, f"worst fixture {worst_marginal:.1f} ns/event marginal"),
        Target(
            TARGET_RESHAPE,
            bool(ratios) and ratios[worst_key] <= 1.5,
            f"worst {worst_key} {ratios[worst_key]:.2f}x (StreamReshaper.feed)" if ratios else "nothing measured",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    args = parser.parse_args()
    from ._common import print_targets

    print_targets(run(args.quick))


if __name__ == "__main__":
    main()

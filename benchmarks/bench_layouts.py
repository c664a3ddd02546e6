"""Whole recorded streams through `NvextMiddleware`, vLLM 0.32's layout next to vLLM 0.33's.

For each recorded stream (tests/fixtures for 0.32, tests/fixtures/vllm-0.33 for 0.33; long ones
of ~300-400 events and short ones under 10) and each reshaping mode:

- added = (the upstream app behind `NvextMiddleware` - the same app called directly) for the whole
  request: request-side work (header scan, body read, plan) and every event's reshaping, so the
  per-request costs are included and amortized over the stream's events;
- floor = `orjson.loads` + `orjson.dumps` of every JSON event of the same stream;
- ratio = added / floor (per event, both divided by the same number of events).

Medians over interleaved passes (direct, middleware and floor in rotating order). `decoded` counts
the events the middleware had to decode (`_json.loads`), out of the stream's JSON events: the
rest took the byte-level path (the request body's own parse is counted too).

Then every recorded layout (0.32, 0.33, 0.34, vLLM 0.33's and 0.34's vllm-rs), long chat and completions
streams, nvext mode: `python` counts the body messages handed to the general path (`ReshapingSend.__call__`;
the rest the armed stream send served), `per request` is what the stream costs without its mid-stream deltas
after the second (the first chunk, the delta that arms, the finish and [DONE] kept), `per delta` the cost of
each delta removed ((whole - trimmed) / deltas removed): the added cost per event once armed, which a stream
of few events hides under its per-request cost (0.32's completions stream has 43).

Run: python -m benchmarks.bench_layouts [--quick]
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

import orjson

from vllm_nvext import NvextMiddleware
from vllm_nvext.config import Mode
from vllm_nvext.outbound import stream as stream_module
from vllm_nvext.send import ReshapingSend

from ._common import (
    LAYOUT_DIRS,
    VLLM_VERSIONS,
    Case,
    Sink,
    Target,
    fmt,
    fmt_ratio,
    http_scope,
    load_case,
    median,
    print_table,
    receive_body,
    run_sync,
    sse_app,
)

LONG = ("chat_stream_ids_long", "completions_stream_ids_long")
SHORT = ("chat_stream_ids", "completions_stream_ids")
MODES = (Mode.NVEXT, Mode.BOTH)
TARGET_LAYOUTS = "long streams, added cost per event through NvextMiddleware <= 1.5x orjson round trip, 0.32 and 0.33"
LIMIT = 1.5


def _payloads(case: Case) -> list[bytes]:
    return [e[6:-2] for e in case.json_events()]


def _floor_ns(payloads: list[bytes]) -> int:
    loads, dumps = orjson.loads, orjson.dumps
    t0 = time.perf_counter_ns()
    for payload in payloads:
        dumps(loads(payload))
    return time.perf_counter_ns() - t0


def _request_ns(app: Any, path: str, body: bytes) -> int:
    scope, receive, sink = http_scope(path, body), receive_body(body), Sink()
    t0 = time.perf_counter_ns()
    run_sync(app(scope, receive, sink))
    return time.perf_counter_ns() - t0


def _decoded(app: Any, path: str, body: bytes) -> tuple[int, bytes]:
    """How many payloads the middleware decoded for one request, and what the client got."""
    count = 0
    real = stream_module._json.loads

    def counting(data: Any) -> Any:
        nonlocal count
        count += 1
        return real(data)

    out: list[bytes] = []

    async def keep(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            out.append(message.get("body", b""))

    stream_module._json.loads = counting  # type: ignore[attr-defined]
    try:
        run_sync(app(http_scope(path, body), receive_body(body), keep))
    finally:
        stream_module._json.loads = real  # type: ignore[attr-defined]
    return count, b"".join(out)


def measure(case: Case, mode: Mode, passes: int) -> dict[str, float]:
    events = case.events()
    payloads = _payloads(case)
    n = len(payloads)
    direct = sse_app(events)
    middleware = NvextMiddleware(direct, mode=mode)
    decoded, answer = _decoded(middleware, case.path, case.body)
    if b'"nvext"' not in answer:
        raise AssertionError(f"{case.vllm} {case.name} {mode.value}: no nvext in the answer (a benchmark of nothing)")
    t_direct: list[int] = []
    t_mw: list[int] = []
    t_floor: list[int] = []
    jobs: list[tuple[list[int], Callable[[], int]]] = [
        (t_direct, lambda: _request_ns(direct, case.path, case.body)),
        (t_mw, lambda: _request_ns(middleware, case.path, case.body)),
        (t_floor, lambda: _floor_ns(payloads)),
    ]
    gc.collect()
    for i in range(passes):
        k = i % len(jobs)
        for out, job in jobs[k:] + jobs[:k]:
            out.append(job())
    added = median([m - d for m, d in zip(t_mw, t_direct, strict=True)])
    floor = median(t_floor)
    return {"events": n, "decoded": decoded, "added_ns": added / n, "floor_ns": floor / n, "ratio": added / floor}


def _handed_back(app: Any, path: str, body: bytes) -> int:
    """How many body messages of one request the stream send handed to the general path."""
    count = 0
    real = ReshapingSend.__call__

    async def counting(self: ReshapingSend, message: Any) -> None:
        nonlocal count
        count += message["type"] == "http.response.body"
        await real(self, message)

    ReshapingSend.__call__ = counting  # type: ignore[method-assign]
    try:
        run_sync(app(http_scope(path, body), receive_body(body), Sink()))
    finally:
        ReshapingSend.__call__ = real  # type: ignore[method-assign]
    return count


def _trimmed(events: list[bytes]) -> list[bytes]:
    """The stream without its mid-stream deltas after the second event: from the finish chunk on, kept."""
    finish = next(i for i, e in enumerate(events) if e.startswith(b"data: {") and b'"finish_reason":"' in e and i >= 2)
    return events[:2] + events[finish:]


def measure_armed(case: Case, passes: int) -> dict[str, float]:
    """Per layout, nvext mode: messages handed to the general path, per-request and per-delta added cost."""
    events = case.events()
    trimmed = _trimmed(events)
    apps = [sse_app(events), sse_app(trimmed)]
    middlewares = [NvextMiddleware(app, mode=Mode.NVEXT) for app in apps]
    python = _handed_back(middlewares[0], case.path, case.body)
    times: list[list[int]] = [[], [], [], []]
    payloads = _payloads(case)
    floors: list[int] = []
    jobs: list[tuple[list[int], Callable[[], int]]] = [
        (times[0], lambda: _request_ns(apps[0], case.path, case.body)),
        (times[1], lambda: _request_ns(middlewares[0], case.path, case.body)),
        (times[2], lambda: _request_ns(apps[1], case.path, case.body)),
        (times[3], lambda: _request_ns(middlewares[1], case.path, case.body)),
        (floors, lambda: _floor_ns(payloads)),
    ]
    gc.collect()
    for i in range(passes):
        k = i % len(jobs)
        for out, job in jobs[k:] + jobs[:k]:
            out.append(job())
    whole = median([m - d for m, d in zip(times[1], times[0], strict=True)])
    request = median([m - d for m, d in zip(times[3], times[2], strict=True)])
    removed = len(events) - len(trimmed)
    floor = median(floors) / len(payloads)
    delta = (whole - request) / removed
    return {"events": len(payloads), "python": python, "messages": len(events) + 1, "whole_ns": whole / len(payloads),
            "request_ns": request, "delta_ns": delta, "ratio": delta / floor}  # fmt: skip


def run_armed(passes: int) -> None:
    rows: list[list[str]] = []
    for vllm in LAYOUT_DIRS:
        for name in LONG:
            r = measure_armed(load_case(name, vllm), passes)
            rows.append([vllm, name, str(int(r["events"])), f"{int(r['python'])}/{int(r['messages'])}",
                         fmt(r["whole_ns"] / 1e3), fmt(r["request_ns"] / 1e3, 1), fmt(r["delta_ns"] / 1e3),
                         fmt_ratio(r["ratio"])])  # fmt: skip
    print_table(
        "Every recorded layout, nvext: messages the general path served, and the added cost per delta once armed",
        ["layout", "fixture", "events", "python", "added us/ev", "per request us", "per delta us", "delta x floor"],
        rows,
        notes=[
            "python = body messages handed to the general path / body messages (the rest the armed send served)",
            "added us/ev = the whole request's added cost / JSON events (the first table's measure)",
            "per request = the stream without its mid-stream deltas after the second; per delta = (whole - that)"
            " / deltas removed; x floor: over one orjson loads+dumps of the stream's events",
            f"{passes} interleaved passes, medians",
        ],
    )


def run(quick: bool = False) -> list[Target]:
    passes = 60 if quick else 300
    rows: list[list[str]] = []
    worst: tuple[float, str] = (0.0, "")
    for name in LONG + SHORT:
        for mode in MODES:
            results = {v: measure(load_case(name, v), mode, passes) for v in VLLM_VERSIONS}
            row = [name, mode.value]
            for vllm in VLLM_VERSIONS:
                r = results[vllm]
                row += [f"{r['decoded']}/{r['events']}", fmt(r["added_ns"] / 1e3), fmt(r["floor_ns"] / 1e3),
                        fmt_ratio(r["ratio"])]  # fmt: skip
                if name in LONG and r["ratio"] > worst[0]:
                    worst = (r["ratio"], f"{vllm} {name} {mode.value}")
            row.append(fmt_ratio(results["0.33"]["added_ns"] / results["0.32"]["added_ns"]))
            rows.append(row)
    columns = ["fixture", "mode"]
    for vllm in VLLM_VERSIONS:
        columns += [f"{vllm} decoded", f"{vllm} added us/ev", f"{vllm} floor us/ev", f"{vllm} x floor"]
    columns.append("added 0.33/0.32")
    print_table(
        "Whole streams through NvextMiddleware: added cost per event vs the orjson round trip, by vLLM layout",
        columns,
        rows,
        notes=[
            "added = (app behind NvextMiddleware - app called directly) per request / JSON events: per-request "
            "costs (headers, body, plan) included, amortized over the stream",
            "floor = orjson.loads + orjson.dumps of the same JSON events; x floor = added / floor",
            "decoded = events the middleware decoded / JSON events (the rest took the byte-level path)",
            f"long streams ~300-400 events, short ones under 10; {passes} interleaved passes, medians",
        ],
    )
    run_armed(passes)
    return [Target(TARGET_LAYOUTS, worst[0] <= LIMIT, f"worst {worst[1]} {worst[0]:.2f}x")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer passes")
    args = parser.parse_args()
    from ._common import print_targets

    print_targets(run(args.quick))


if __name__ == "__main__":
    main()

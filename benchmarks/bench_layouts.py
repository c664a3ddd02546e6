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

from ._common import (
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
    return [Target(TARGET_LAYOUTS, worst[0] <= LIMIT, f"worst {worst[1]} {worst[0]:.2f}x")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer passes")
    args = parser.parse_args()
    from ._common import print_targets

    print_targets(run(args.quick))


if __name__ == "__main__":
    main()

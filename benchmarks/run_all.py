"""Run the benchmarks and print every table, then one PASS/FAIL line per target (benchmarks/README.md).

    python -m benchmarks.run_all                    # all of them (make bench), a few minutes on 2 cores
    python -m benchmarks.run_all --quick            # smaller sizes, fewer rounds
    python -m benchmarks.run_all --only events      # serving, events, send, layouts, metrics, asgi, memory, proxy,
                                                    # server
    python -m benchmarks.run_all --skip server      # everything but the real-server benchmark

A missed target is reported, never turned into a failing exit status: these are measurements.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable

from . import (
    bench_asgi,
    bench_events,
    bench_layouts,
    bench_memory,
    bench_metrics,
    bench_proxy,
    bench_server,
    bench_serving,
    bench_stream_send,
)
from ._common import Target, machine_description, print_targets

# The server benchmark last: it is the longest and the only one that needs free memory.
BENCHMARKS: dict[str, tuple[Callable[..., list[Target]], list[str]]] = {
    # What users pay: the middleware's share of vLLM 0.33's own serving CPU (runs in the 0.33 venv).
    "serving": (bench_serving.run, list(bench_serving.TARGETS)),
    "events": (bench_events.run, [bench_events.TARGET_PASS_THROUGH, bench_events.TARGET_RESHAPE]),
    # The send handed to vLLM per mid-stream delta: floor, general path, pure Python, compiled.
    "send": (bench_stream_send.run, []),
    # vLLM 0.32 and 0.33 layouts side by side: whole recorded streams through NvextMiddleware.
    "layouts": (bench_layouts.run, [bench_layouts.TARGET_LAYOUTS]),
    "metrics": (bench_metrics.run, [bench_metrics.TARGET_COUNTING]),
    "asgi": (bench_asgi.run, [bench_asgi.TARGET_LINEAR]),
    "memory": (bench_memory.run, [bench_memory.TARGET_MEMORY]),
    # The extra hop of `vllm-nvext proxy` vs direct, in front of vLLM 0.33 (scripted engine) and a stand-in.
    "proxy": (bench_proxy.run, list(bench_proxy.TARGETS)),
    "server": (bench_server.run, [bench_server.TARGET_SERVER]),
}
# The order benchmarks/README.md lists its targets in.
TARGET_ORDER = [
    *bench_serving.TARGETS,
    bench_events.TARGET_PASS_THROUGH,
    bench_events.TARGET_RESHAPE,
    bench_layouts.TARGET_LAYOUTS,
    bench_metrics.TARGET_COUNTING,
    bench_server.TARGET_SERVER,
    bench_asgi.TARGET_LINEAR,
    bench_memory.TARGET_MEMORY,
    *bench_proxy.TARGETS,
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds everywhere")
    parser.add_argument("--only", action="append", choices=list(BENCHMARKS), help="run just this benchmark")
    parser.add_argument("--skip", action="append", choices=list(BENCHMARKS), default=[], help="leave one out")
    parser.add_argument("--single-server", action="store_true", help="bench_server: the middleware server only")
    args = parser.parse_args()

    selected = [name for name in BENCHMARKS if (not args.only or name in args.only) and name not in args.skip]
    print("# vllm-nvext benchmarks" + (" (--quick)" if args.quick else ""))
    print(machine_description())
    results: dict[str, Target] = {}
    started = time.perf_counter()
    for name in selected:
        fn, names = BENCHMARKS[name]
        print(f"\n# bench_{name}", flush=True)
        t0 = time.perf_counter()
        try:
            kwargs = {"single": True} if name == "server" and args.single_server else {}
            for target in fn(args.quick, **kwargs):
                results[target.name] = target
        except Exception as exc:  # a broken benchmark is reported with the others, not hidden
            traceback.print_exc()
            for target_name in names:
                results[target_name] = Target(target_name, False, f"bench_{name} failed: {exc}")
        print(f"  (bench_{name}: {time.perf_counter() - t0:.0f} s)", flush=True)

    targets = [results.get(n, Target(n, None, "not run")) for n in TARGET_ORDER]
    print(f"\n# Summary ({time.perf_counter() - started:.0f} s)")
    print_targets(targets)


if __name__ == "__main__":
    main()

"""Where an nvext request's added CPU goes inside vLLM's app: the middleware's steps, one by one.

`bench_serving` gives the ratio (the middleware's CPU over stock vLLM's, in vLLM 0.33's own app over the
scripted engine core); this splits what the middleware adds into its steps, measured in the same app,
where vLLM's work between two of the middleware's steps evicts its code and data (so a step costs several
times what it costs warm, docs/performance.md). Each step is timed by a probe: the function is replaced by
a wrapper that reads `time.perf_counter_ns` before and after the call and adds the difference to the
step's total for the request (inclusive: a step's figure holds the steps it calls, listed under it,
indented). Per request, the median over rounds.

The probes cost something themselves, in the app. The stock/middleware pairs run twice, interleaved:
with the probes and without them, so the table prints the added CPU both ways and the probes' own share
(their difference, over the probe calls a request makes). The compiled stream send handed to vLLM is probed
where vLLM calls it (its own part of every message: a delta it serves whole, or the hand-over of one it
leaves to the general path, which is timed on its own line).

Run: python -m benchmarks.bench_sections [--rounds N] [--case "short stream"] [--opt ids] [--pure-python]
(re-runs itself in the vLLM 0.33 reference venv, as bench_serving does.)
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from benchmarks import bench_serving as serving
from benchmarks._common import fmt, median, print_table, run_loop


@dataclass(frozen=True)
class Probe:
    """A function of the package timed in the app: `module`'s `attr` (`Class.method` or a module function).
    `depth`: its place under the step that calls it (0: a step of its own)."""

    module: str
    attr: str
    label: str
    depth: int = 0
    asynchronous: bool = False


# The steps of a translated request, in the order they run. Module functions are probed where the caller
# looks them up (the module that imported them), so the probe sees every call.
PROBES = (
    Probe("vllm_nvext.middleware", "NvextMiddleware._route", "route: path, server facts, key check"),
    Probe("vllm_nvext.middleware", "opts_in_whole", "opt-in scan of the body"),
    Probe("vllm_nvext.middleware", "RequestHeaders.read", "request headers read"),
    Probe("vllm_nvext.middleware.exchange", "Exchange._plan", "plan: read and plan the request"),
    Probe("vllm_nvext.middleware.exchange", "read_request", "read_request (decode, decision fields, nvext)", 1),
    Probe("vllm_nvext.middleware.exchange", "plan_request_for", "plan_request_for (the plan, the body rewritten)", 1),
    Probe("vllm_nvext.middleware.exchange", "set_header", "content-length set"),
    Probe("vllm_nvext.middleware.exchange", "Exchange._reshaping", "request counted, reshaping send made"),
    Probe("vllm_nvext.send", "ReshapingSend.__init__", "ReshapingSend (a stream's with the stream send)", 1),
    Probe("vllm_nvext.middleware.exchange", "replay_body", "body replayed to vLLM"),
    Probe("kernels", "stream_send", "stream send handed to vLLM: its own part of every message"),
    Probe("vllm_nvext.send", "ReshapingSend.__call__", "general path: the messages the stream send hands on", 0, True),
    Probe("vllm_nvext.send", "ReshapingSend._on_start", "response start", 1, True),
    Probe("vllm_nvext.outbound.stream", "StreamReshaper.__init__", "StreamReshaper made", 2),
    Probe("vllm_nvext.outbound.stream", "StreamReshaper.feed", "chunks reshaped in Python", 1),
    Probe("vllm_nvext.outbound.stream", "StreamReshaper._plain_chunk", "first chunk (scanned)", 2),
    Probe("vllm_nvext.outbound.stream", "StreamReshaper._first_delta", "first delta (scanned)", 2),
    Probe("vllm_nvext.outbound.stream", "StreamReshaper._arm", "the splice it arms (learned, checked)", 3),
    Probe("vllm_nvext.outbound.stream", "StreamReshaper.arm_parts", "the arm's record", 1),
    Probe("vllm_nvext.send", "ReshapingSend._on_unary_body", "unary body reshaped", 1, True),
    Probe("vllm_nvext.send", "ReshapingSend.count_stream", "end-of-stream metrics"),
)

CASE_NAMES = tuple(case.name for case in serving.CASES)


def _timed(fn: Callable[..., Any], totals: dict[str, list[int]], label: str, asynchronous: bool) -> Any:
    clock = time.perf_counter_ns
    slot = totals.setdefault(label, [0, 0])  # ns, calls

    if asynchronous:

        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return await fn(*args, **kwargs)
            finally:
                slot[0] += clock() - t0
                slot[1] += 1

        return timed_async

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            slot[0] += clock() - t0
            slot[1] += 1

    return timed


def _timed_stream_send(factory: Callable[..., Any], totals: dict[str, list[int]], label: str) -> Any:
    """The kernels' stream send factory, its `send` probed (the C send too: probed where vLLM calls it)."""
    clock = time.perf_counter_ns
    slot = totals.setdefault(label, [0, 0])

    def make(general: Any, downstream: Any) -> Any:
        send, arm, disarm, countdown = factory(general, downstream)

        def timed_send(message: Any) -> Any:
            t0 = clock()
            try:
                return send(message)
            finally:
                slot[0] += clock() - t0
                slot[1] += 1

        return timed_send, arm, disarm, countdown

    return make


@contextmanager
def probes(middlewares: list[Any], totals: dict[str, list[int]]) -> Iterator[None]:
    """Every probe in place for the duration (the middleware instances' kernels included), then removed."""
    undo: list[Callable[[], None]] = []
    try:
        for probe in PROBES:
            if probe.module == "kernels":
                for mw in middlewares:
                    kernels = mw.kernels
                    mw.kernels = replace(kernels, stream_send=_timed_stream_send(kernels.stream_send, totals,
                                                                                 probe.label))  # fmt: skip
                    undo.append(partial(setattr, mw, "kernels", kernels))
                continue
            owner: Any = importlib.import_module(probe.module)
            *path, name = probe.attr.split(".")
            for part in path:
                owner = getattr(owner, part)
            original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            timed: Any
            if isinstance(original, classmethod):
                timed = classmethod(_timed(original.__func__, totals, probe.label, probe.asynchronous))
            else:
                timed = _timed(original, totals, probe.label, probe.asynchronous)
            setattr(owner, name, timed)
            undo.append(partial(setattr, owner, name, original))
        yield
    finally:
        for step in reversed(undo):
            step()


def _middleware_of(app: Any) -> Any:
    """The NvextMiddleware instance vLLM built around its app (`--middleware`), once the stack is built."""
    from vllm_nvext import NvextMiddleware

    stack = app.middleware_stack or app.build_middleware_stack()
    app.middleware_stack = stack
    node = stack
    for _ in range(64):
        if isinstance(node, NvextMiddleware):
            return node
        node = getattr(node, "app", None)
        if node is None:
            break
    raise RuntimeError("NvextMiddleware not found in vLLM's middleware stack")


async def measure(rounds: int, case_name: str, opt: str, middleware: str) -> None:
    h = serving._harness()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    h._install()
    build_client, build_app, init_state = serving._launchers()
    stock_args = serving._vllm_args([])
    case = next(c for c in serving.CASES if c.name == case_name)
    async with build_client(stock_args) as engine:
        stock = await serving._build_app(build_app, init_state, engine, stock_args)
        app = await serving._build_app(build_app, init_state, engine,
                                       serving._vllm_args(["--middleware", middleware]))  # fmt: skip
        mw = _middleware_of(app)
        s_body, m_body = serving.request_body(case, "ids"), serving.request_body(case, opt)
        for _ in range(20):
            await serving.exchange(stock, s_body)
            await serving.exchange(app, m_body)
        gc.collect()
        gc.freeze()
        totals: dict[str, list[int]] = {}
        per_request: dict[str, list[float]] = {}
        calls: dict[str, int] = {}
        added = {True: [], False: []}  # type: dict[bool, list[int]]
        for r in range(rounds):
            for probed in (r % 2 == 0, r % 2 == 1):
                if probed:
                    with probes([mw], totals):
                        for slot in totals.values():
                            slot[0] = slot[1] = 0
                        _, s_cpu = await serving.exchange(stock, s_body)
                        _, m_cpu = await serving.exchange(app, m_body)
                    for label, (ns, n) in totals.items():
                        per_request.setdefault(label, []).append(ns / 1e3)
                        calls[label] = calls.get(label, 0) + n
                else:
                    _, m_cpu = await serving.exchange(app, m_body)
                    _, s_cpu = await serving.exchange(stock, s_body)
                added[probed].append(m_cpu - s_cpu)
        _print(case, f"{opt} request, {mw.kernels.impl} path", rounds, per_request, calls, added)


def _print(case: Any, opt: str, rounds: int, per_request: dict[str, list[float]], calls: dict[str, int],
           added: dict[bool, list[int]]) -> None:  # fmt: skip
    probed_n = max(len(v) for v in per_request.values())
    plain, probed = median(added[False]) / 1e3, median(added[True]) / 1e3
    probe_calls = sum(calls.values()) / probed_n
    rows = []
    for probe in PROBES:
        values = per_request.get(probe.label)
        if not values or not calls.get(probe.label):
            continue
        rows.append([("  " * probe.depth) + probe.label, fmt(calls[probe.label] / probed_n, 1), fmt(median(values), 1)])
    print_table(
        f"Where the added CPU goes, in vLLM 0.33's app: {case.name} ({case.max_tokens} tokens), {opt}",
        ["step (indented: inside the step above)", "calls/req", "in app us/req"],
        rows,
        notes=[
            f"added CPU per request (middleware - stock, median of {rounds} pairs per side): {fmt(plain, 1)} us "
            f"without probes, {fmt(probed, 1)} us with them ({fmt(probe_calls, 1)} probe calls per request: "
            f"~{fmt((probed - plain) / max(probe_calls, 1), 2)} us each in the app)",
            "each step inclusive (wall time between its entry and its return, perf_counter_ns), median per request",
            "stream send: its own time per message vLLM sends (a mid-stream delta served whole; for a message it"
            " hands on, the hand-over: the general path's coroutine runs when vLLM awaits it, timed on its own line)",
            "general path: up to the client's send returning (here the benchmark's own send, a few us per call)",
        ],
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=400, help="pairs per side, probed and not (default 400)")
    parser.add_argument("--case", choices=CASE_NAMES, action="append", help="default: every case")
    parser.add_argument("--opt", choices=("nvext", "ids"), default="nvext", help="the middleware's request")
    parser.add_argument("--pure-python", action="store_true", help="NvextMiddleware on its pure-Python path")
    return parser


def main() -> None:
    args = _parser().parse_args()
    if not serving._in_reference_venv():
        argv = [str(serving._harness().venv_python()), "-m", "benchmarks.bench_sections", *sys.argv[1:]]
        os.chdir(serving.ROOT)
        os.execve(argv[0], argv, serving._child_env())
    for case in args.case or CASE_NAMES:
        rounds = args.rounds if case != "long stream" else max(args.rounds // 4, 20)
        middleware = serving.MIDDLEWARES["python" if args.pure_python else "default"]
        run_loop(measure(rounds, case, args.opt, middleware))


if __name__ == "__main__":
    main()

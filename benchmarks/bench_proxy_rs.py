"""The proxy against vLLM's Rust frontend: `vllm-nvext proxy` in front of `vllm-rs`, in one run.

vLLM 0.33's stock `vllm serve` with `VLLM_USE_RUST_FRONTEND=1` (`vllm-rs`, HTTP served from Rust, no Python
in the request path) over the release's engine core, whose executor samples scripted ids
(`scripts.vllm_harness.RsServer`, scripts/vllm_executor.py): the front door a `vllm-nvext proxy` is for,
since vllm-rs loads no middleware. Measured:

- CPU per streamed token: over the same batches of proxied `nvext` streams, each process's CPU time
  (psutil) over the token events the client received: the proxy's tree, vllm-rs's frontend (every process
  of its tree but the engine core) and the engine core. The ratio proxy / frontend is what a Python proxy
  costs next to the Rust frontend it fronts; the median of the batches, with their range.
- Time to first event of 2-token streams, direct (`return_token_ids`) and through the proxy (`nvext`),
  alternating: the p50 the proxy adds, with a 95% bootstrap interval.

Left out, saying so, when the 0.33 reference venv is missing (`make setup-vllm033`).
Run: python -m benchmarks.bench_proxy_rs [--quick] (`python -m benchmarks.bench_proxy` runs it too).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Sequence

from ._common import Target, fmt, fmt_ratio, percentile, print_table, run_loop

TARGET_RS_TTFB = "proxy in front of vllm-rs: added time to first event p50 < 1 ms"
TARGET_RS_CPU = "proxy in front of vllm-rs: CPU per token measured against vllm-rs's own"


def added_p50(direct: Sequence[float], proxied: Sequence[float], reps: int = 2000) -> tuple[float, float, float]:
    """p50(proxied) - p50(direct), and the 95% bootstrap interval of that difference (resampling each side)."""
    rng = random.Random(0)
    diffs = sorted(
        percentile(rng.choices(proxied, k=len(proxied)), 50) - percentile(rng.choices(direct, k=len(direct)), 50)
        for _ in range(reps)
    )
    return percentile(proxied, 50) - percentile(direct, 50), diffs[int(0.025 * reps)], diffs[int(0.975 * reps) - 1]


def spread(values: Sequence[float], digits: int = 1) -> str:
    """The median of `values` and their range, as `m [lo-hi]`."""
    return f"{fmt(percentile(values, 50), digits)} [{fmt(min(values), digits)}-{fmt(max(values), digits)}]"


def _cpu_by_process(pid: int) -> dict[int, tuple[str, float]]:
    """Each process of the tree under `pid` (itself included): its name and its CPU time (user + system)."""
    import psutil

    root = psutil.Process(pid)
    found = {}
    for proc in (root, *root.children(recursive=True)):
        try:
            name = " ".join(proc.cmdline()[:1]) if proc.name().startswith("python") else proc.name()
            found[proc.pid] = (proc.name() if "EngineCore" in proc.name() else name, sum(proc.cpu_times()[:2]))
        except psutil.Error:
            continue
    return found


def _split(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> tuple[float, float]:
    """CPU seconds between two readings of a vLLM tree: (the frontend: all but the engine core, the engine core)."""
    frontend = engine = 0.0
    for pid, (name, seconds) in after.items():
        used = seconds - before.get(pid, (name, 0.0))[1]
        if "EngineCore" in name:
            engine += used
        else:
            frontend += used
    return frontend, engine


def rust_upstream(quick: bool) -> list[Target]:
    from .bench_proxy import BODY, _cpu_seconds, _proxy, _stop, alternate, load
    from .bench_serving import _harness

    try:
        h = _harness()
        h.venv_python()
    except (ImportError, RuntimeError) as exc:
        print(f"\n(vllm-rs upstream left out: {exc})")
        return []
    from vllm_nvext.tools import tiny_model
    from vllm_nvext.tools.server import TINY_ARGS

    short_rounds = 30 if quick else 120
    # Unpaced (the scripted executor samples at once): enough tokens a batch that the CPU clock's 10 ms tick is
    # ~1 µs per token or less.
    batches, streams, concurrency, tokens = (3, 32, 8, 256) if quick else (5, 32, 8, 512)
    args = (*TINY_ARGS, "--served-model-name", "tiny", "--disable-uvicorn-access-log")
    server = h.RsServer(model=str(tiny_model.ensure()), args=args, env=dict(h.RUST_ENV), name="bench-proxy-rs")
    proxy = None
    try:
        t0 = time.perf_counter()
        server.start()
        server.wait_ready(timeout=float(os.environ.get("VLLM_NVEXT_STARTUP_TIMEOUT", "600")))
        proxy, proxy_url = _proxy(server.url)
        print(f"\n  vllm-rs 0.33 (scripted executor) and the proxy ready in {time.perf_counter() - t0:.0f} s")
        urls = {"direct": server.url, "proxy": proxy_url}
        body = {**BODY, "max_tokens": tokens, "ignore_eos": True}
        short = run_loop(alternate(urls, short_rounds, {**body, "max_tokens": 2}, {}))
        first = {route: [s.first * 1e3 for s in found] for route, found in short.items()}
        added, low, high = added_p50(first["direct"], first["proxy"])
        assert proxy is not None and server.proc is not None
        proxy_us, frontend_us, engine_us = [], [], []
        for _ in range(batches):
            before = (_cpu_seconds(proxy.pid), _cpu_by_process(server.proc.pid))
            events = run_loop(load(proxy_url, streams, concurrency, body, {}))
            frontend_s, engine_s = _split(before[1], _cpu_by_process(server.proc.pid))
            proxy_us.append((_cpu_seconds(proxy.pid) - before[0]) / events * 1e6)
            frontend_us.append(frontend_s / events * 1e6)
            engine_us.append(engine_s / events * 1e6)
        ratios = [p / f for p, f in zip(proxy_us, frontend_us, strict=True)]
        names = sorted({name for name, _ in _cpu_by_process(server.proc.pid).values()})
    finally:
        _stop(proxy)
        server.stop()
    print_table(
        f"vllm-rs (vLLM 0.33's Rust frontend, scripted executor): direct vs through vllm-nvext proxy, alternating "
        f"({short_rounds} 2-token streams each)",
        ["", "direct", "proxy", "added (95% interval)"],
        [[f"time to first event p{q} (ms)", fmt(percentile(first["direct"], q), 3),
          fmt(percentile(first["proxy"], q), 3),
          fmt(percentile(first["proxy"], q) - percentile(first["direct"], q), 3)
          + (f" ({fmt(low, 3)} to {fmt(high, 3)})" if q == 50 else "")] for q in (50, 90)],
        ["nvext through the proxy, return_token_ids direct: the proxy's figures include its translation"],
    )  # fmt: skip
    print_table(
        f"CPU per streamed token, {batches} batches of {streams} proxied streams of {tokens} tokens "
        f"({concurrency} at a time): median [range]",
        ["proxy", "vllm-rs frontend", "engine core", "proxy / frontend"],
        [[f"{spread(proxy_us)} µs", f"{spread(frontend_us)} µs", f"{spread(engine_us)} µs", spread(ratios, 2)]],
        [f"vllm-rs tree: {', '.join(names)}; each process's CPU time (psutil) over the token events received"],
    )
    ratio = percentile(ratios, 50)
    return [
        Target(TARGET_RS_TTFB, added < 1.0, f"{added:+.3f} ms (95% {low:+.3f} to {high:+.3f} ms)"),
        Target(
            TARGET_RS_CPU,
            True,
            f"proxy {spread(proxy_us)} µs vs vllm-rs frontend {spread(frontend_us)} µs per token = {fmt_ratio(ratio)}",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from ._common import print_targets

    print_targets(rust_upstream(args.quick))


if __name__ == "__main__":
    main()

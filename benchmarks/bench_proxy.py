"""The cost of the extra hop: `vllm-nvext proxy` vs talking to the upstream directly, in one run.

Two upstreams, each with its own `vllm-nvext proxy` subprocess (one worker) in front:

1. A real vLLM API server: vLLM 0.33's `vllm serve` over the scripted engine core of
   scripts/vllm_harness.py (vLLM's own app, tokenizer, detokenizer and output processing; the
   engine does no work and paces its steps `SCRIPTED_STEP_SECONDS` apart, like a decode step).
   Streams alternate direct (`return_token_ids`) and through the proxy (`nvext`):
   - time to first event (request sent -> first `data:` event) of 2-token streams, p50 and p90;
   - inter-token latency: the gaps between a stream's token events, mean and p90 on each side;
   - CPU per streamed token of the proxy process and of the API server process (psutil, every
     process of each tree) over the same batch of proxied streams: their ratio is how many
     API-server cores' worth of tokens one proxy core serves.
   Left out, saying so, when the 0.33 reference venv is missing (`make setup-vllm033`).
2. vLLM 0.33's Rust frontend (`vllm-rs`, benchmarks/bench_proxy_rs.py): the proxy's CPU per token against
   vllm-rs's own, and the time to first event it adds, with their intervals.
3. A stand-in: a uvicorn process (`upstream_app` below) that answers chat with the recorded long
   `return_token_ids` stream (tests/fixtures), one event every `--gap-us` microseconds, each
   event's text carrying its send time (`time.time_ns()`, one clock for every process of the
   machine), so each event's own latency is measured, direct and through the proxy: the delay the
   hop adds to every event, finer than the real server's gaps can show. Also the HTTP client
   libraries (httpx, aiohttp; vLLM installs both) reading the same stream as fast as it is sent,
   client CPU per event: why the proxy forwards with aiohttp.

The load comes from one aiohttp client in this process (the cheaper client: less of the two
cores taken from the servers measured).

Run: python -m benchmarks.bench_proxy [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import time
from typing import Any

import aiohttp
import httpx

from vllm_nvext.protocol import PATHS, Endpoint

from ._common import Target, fmt, fmt_ratio, load_case, percentile, print_table, run_loop
from .bench_proxy_rs import TARGET_RS_CPU, TARGET_RS_TTFB, added_p50, spread

CHAT = PATHS[Endpoint.CHAT]

CASE = "chat_stream_ids_long"
# The real upstream's engine step: a decode step's pace (the scripted engine core sleeps it).
STEP_S = 0.01
TARGET_TTFB = "proxy: added time to first event p50 < 1 ms"
TARGET_ITL = "proxy: added inter-token latency < 5%"
TARGET_CPU = "proxy: one proxy core serves >= 3 API-server cores' worth of tokens"
TARGET_ITL_STAND_IN = "proxy: added latency per event < 5% of a 2 ms inter-token latency (stand-in, stamped events)"
TARGETS = (TARGET_TTFB, TARGET_ITL, TARGET_CPU, TARGET_RS_TTFB, TARGET_RS_CPU, TARGET_ITL_STAND_IN)
# Each token event's text is its send time (`t` and hex nanoseconds): the id and the rest of the
# event stay as vLLM sent them, so the middleware's byte-level path takes the deltas as it would vLLM's.
_TEXT = re.compile(rb'"delta":\{"content":"[^"]*"')
_STAMP = re.compile(rb'"content":"t([0-9a-f]+)"')


# --------------------------------------------------------------------------- the stand-in upstream


def _frames() -> tuple[bytes, list[bytes], list[bytes]]:
    events = load_case(CASE).events()
    first, *rest = events
    tokens = [e for e in rest if b'"finish_reason":null' in e]
    tail = [e for e in rest if e not in tokens]
    return first, tokens, tail


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Chat answered with the recorded stream; `x-events` events, `x-gap-us` apart, each stamped in its text."""
    if scope["type"] != "http":
        return  # run with --lifespan off
    while (await receive()).get("more_body"):
        pass
    headers = dict(scope["headers"])
    count = int(headers.get(b"x-events", b"256"))
    gap = int(headers.get(b"x-gap-us", b"0")) / 1e6
    first, tokens, tail = _FRAMES
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    plan = [first, *(tokens[i % len(tokens)] for i in range(count)), *tail]
    start = time.perf_counter()
    for i, frame in enumerate(plan):
        if gap:
            delay = start + i * gap - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        stamped = _TEXT.sub(b'"delta":{"content":"t%x"' % time.time_ns(), frame, count=1)
        await send({"type": "http.response.body", "body": stamped, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


_FRAMES = _frames()


# --------------------------------------------------------------------------- processes


def _start(command: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{command[2]} did not start")


def _proxy(upstream: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    command = [sys.executable, "-m", "vllm_nvext.tools.cli", "proxy", "--upstream", upstream, "--port", str(port)]
    return _start(command, port), f"http://127.0.0.1:{port}"


def _stop(*procs: subprocess.Popen[bytes] | None) -> None:
    for proc in procs:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of a process and every process under it."""
    import psutil

    root = psutil.Process(pid)
    return sum(sum(p.cpu_times()[:2]) for p in (root, *root.children(recursive=True)))


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- streams

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 4096}
DIALECT: dict[str, dict[str, Any]] = {
    "direct": {"return_token_ids": True},
    "proxy": {"nvext": {"extra_fields": ["completion_token_ids"]}},
}


class Streamed:
    """What one stream's client saw: time to first event, and each token event's arrival."""

    def __init__(self) -> None:
        self.first: float = 0.0  # seconds from the request to the first `data:` event
        self.arrivals: list[int] = []  # time.perf_counter_ns() of each token event
        self.stamped: list[float] = []  # seconds from an event's stamped send time (stand-in) to its arrival

    def gaps(self) -> list[float]:
        return [(b - a) / 1e9 for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def stream(
    session: aiohttp.ClientSession, url: str, route: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Streamed:
    found = Streamed()
    sent = time.perf_counter_ns()
    async with session.post(url + CHAT, json={**body, **DIALECT[route]}, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{route}: HTTP {resp.status}: {(await resp.read())[:200]!r}")
        buffer = b""
        async for chunk in resp.content.iter_any():
            now, wall = time.perf_counter_ns(), time.time_ns()
            buffer += chunk
            *frames, buffer = buffer.split(b"\n\n")
            for frame in frames:
                if not frame.startswith(b"data: {"):
                    continue
                if not found.first:
                    found.first = (now - sent) / 1e9
                if b'"token_ids"' in frame or b'"completion_token_ids"' in frame:
                    found.arrivals.append(now)
                stamp = _STAMP.search(frame)
                if stamp is not None:
                    found.stamped.append((wall - int(stamp.group(1), 16)) / 1e9)
    return found


async def alternate(
    urls: dict[str, str], rounds: int, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, list[Streamed]]:
    """`rounds` streams on each side, direct and proxied alternating (drift hits both alike)."""
    found: dict[str, list[Streamed]] = {route: [] for route in urls}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for route, url in urls.items():  # warm-up: connections open, code paths hot
            for _ in range(2):
                await stream(session, url, route, {**body, "max_tokens": 8}, {**headers, "x-events": "8"})
        for i in range(rounds):
            order = list(urls.items()) if i % 2 == 0 else list(urls.items())[::-1]
            for route, url in order:
                found[route].append(await stream(session, url, route, body, headers))
    return found


async def load(url: str, streams: int, concurrency: int, body: dict[str, Any], headers: dict[str, str]) -> int:
    """`streams` proxied streams, `concurrency` at a time; the token events received."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one() -> int:
            async with sem:
                return len((await stream(session, url, "proxy", body, headers)).arrivals)

        return sum(await asyncio.gather(*(one() for _ in range(streams))))


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


# --------------------------------------------------------------------------- 1. a real vLLM API server


def real_upstream(quick: bool) -> list[Target]:
    try:
        from .bench_serving import _harness

        h = _harness()

        h.venv_python()
    except (ImportError, RuntimeError) as exc:
        print(f"\n(real upstream left out: {exc})")
        return []
    from vllm_nvext.tools import tiny_model
    from vllm_nvext.tools.server import TINY_ARGS

    rounds, tokens = (8, 64) if quick else (24, 128)
    short_rounds = 30 if quick else 120  # 2-token streams: the time to first event, many times over
    batches, cpu_streams, concurrency = (3, 16, 8) if quick else (5, 32, 8)
    args = (*TINY_ARGS, "--served-model-name", "tiny", "--disable-uvicorn-access-log")
    server = h.HarnessServer(
        model=str(tiny_model.ensure()), args=args, env={"SCRIPTED_STEP_SECONDS": str(STEP_S)}, name="bench-proxy"
    )
    proxy = None
    try:
        t0 = time.perf_counter()
        server.start()
        server.wait_ready(timeout=float(os.environ.get("VLLM_NVEXT_STARTUP_TIMEOUT", "600")))
        proxy, proxy_url = _proxy(server.url)
        print(f"\n  vLLM 0.33 (scripted engine core) and the proxy ready in {time.perf_counter() - t0:.0f} s")
        body = {**BODY, "max_tokens": tokens, "ignore_eos": True}
        urls = {"direct": server.url, "proxy": proxy_url}
        short = run_loop(alternate(urls, short_rounds, {**body, "max_tokens": 2}, {}))
        first = {r: [s.first for s in v] for r, v in short.items()}
        found = run_loop(alternate(urls, rounds, body, {}))
        gaps = {r: [g for s in v for g in s.gaps()] for r, v in found.items()}
        mean_gap = {r: sum(g) / len(g) for r, g in gaps.items()}
        added = {q: _ms(first["proxy"], q) - _ms(first["direct"], q) for q in (50, 90)}
        _, low, high = added_p50([x * 1e3 for x in first["direct"]], [x * 1e3 for x in first["proxy"]])
        itl_share = mean_gap["proxy"] / mean_gap["direct"] - 1
        rows = [
            [f"time to first event p{q} (ms)", fmt(_ms(first["direct"], q), 3), fmt(_ms(first["proxy"], q), 3),
             fmt(added[q], 3) + (f" (95% interval {fmt(low, 3)} to {fmt(high, 3)})" if q == 50 else "")]
            for q in (50, 90)
        ] + [
            ["inter-token latency, mean (ms)", fmt(mean_gap["direct"] * 1e3, 3), fmt(mean_gap["proxy"] * 1e3, 3),
             f"{fmt((mean_gap['proxy'] - mean_gap['direct']) * 1e3, 3)} ({itl_share:+.2%})"],
            ["inter-token latency p90 (ms)", fmt(_ms(gaps["direct"], 90), 3), fmt(_ms(gaps["proxy"], 90), 3),
             fmt(_ms(gaps["proxy"], 90) - _ms(gaps["direct"], 90), 3)],
        ]  # fmt: skip
        print_table(
            f"Real upstream (vLLM 0.33's API server, engine steps {STEP_S * 1e3:g} ms apart): "
            f"direct vs through vllm-nvext proxy, alternating ({short_rounds} 2-token streams each for the first "
            f"event, {rounds} streams of {tokens} tokens each for the inter-token latency)",
            ["", "direct", "proxy", "added"],
            rows,
            ["nvext through the proxy, return_token_ids direct: the proxy's figures include its translation"],
        )
        assert proxy is not None and server.proc is not None
        proxy_us, api_us = [], []
        for _ in range(batches):
            before = (_cpu_seconds(proxy.pid), _cpu_seconds(server.proc.pid))
            events = run_loop(load(proxy_url, cpu_streams, concurrency, body, {}))
            proxy_s, api_s = (_cpu_seconds(p) - b for p, b in zip((proxy.pid, server.proc.pid), before, strict=True))
            proxy_us.append(proxy_s / events * 1e6)
            api_us.append(api_s / events * 1e6)
        cores_each = [a / p for p, a in zip(proxy_us, api_us, strict=True)]
        cores = percentile(cores_each, 50)
        print_table(
            f"CPU per streamed token, {batches} batches of {cpu_streams} proxied streams ({concurrency} at a time): "
            "median [range]",
            ["proxy", "vLLM API server", "API-server cores per proxy core"],
            [[f"{spread(proxy_us)} µs", f"{spread(api_us)} µs", spread(cores_each, 2)]],
            ["each process tree's CPU time (psutil) over the batch, over the token events the client received"],
        )
    finally:
        _stop(proxy)
        server.stop()
    return [
        Target(
            TARGET_TTFB,
            added[50] < 1.0,
            f"{added[50]:+.3f} ms (95% {low:+.3f} to {high:+.3f}; p90 {added[90]:+.3f} ms), real upstream",
        ),
        Target(TARGET_ITL, itl_share < 0.05, f"{itl_share:+.2%} mean inter-token latency, real upstream"),
        Target(
            TARGET_CPU, cores >= 3, f"{spread(proxy_us)} vs {spread(api_us)} µs/token = {spread(cores_each, 2)} cores"
        ),
    ]


# --------------------------------------------------------------------------- 2. the stand-in


async def _read_httpx(url: str, streams: int, events: int) -> int:
    received = 0
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(streams):
            async with client.stream("POST", url, json=BODY, headers={"x-events": str(events)}) as resp:
                async for chunk in resp.aiter_raw():
                    received += len(chunk)
    return received


async def _read_aiohttp(url: str, streams: int, events: int) -> int:
    received = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(streams):
            async with session.post(url, json=BODY, headers={"x-events": str(events)}) as resp:
                async for chunk in resp.content.iter_any():
                    received += len(chunk)
    return received


def stand_in(quick: bool, gap_us: int = 2000) -> list[Target]:
    rounds, events = (6, 64) if quick else (20, 256)
    up_port = _free_port()
    upstream = _start(
        [sys.executable, "-m", "uvicorn", "benchmarks.bench_proxy:upstream_app", "--port", str(up_port),
         "--log-level", "warning", "--no-access-log", "--lifespan", "off"],
        up_port,
    )  # fmt: skip
    proxy = None
    try:
        proxy, proxy_url = _proxy(f"http://127.0.0.1:{up_port}")
        urls = {"direct": f"http://127.0.0.1:{up_port}", "proxy": proxy_url}
        found = run_loop(alternate(urls, rounds, BODY, {"x-events": str(events), "x-gap-us": str(gap_us)}))
        lat = {r: [x for s in v for x in s.stamped] for r, v in found.items()}
        added_event = _ms(lat["proxy"], 50) - _ms(lat["direct"], 50)
        share = added_event / (gap_us / 1e3)
        print_table(
            f"Stand-in upstream (a recorded stream replayed, each event stamped with its send time): each event's "
            f"latency, direct vs through the proxy ({rounds} streams each, alternating; "
            f"{events} events {gap_us} µs apart)",
            ["", "direct", "proxy", "added"],
            [[f"event latency p{q} (ms)", fmt(_ms(lat["direct"], q), 3), fmt(_ms(lat["proxy"], q), 3),
              fmt(_ms(lat["proxy"], q) - _ms(lat["direct"], q), 3)] for q in (50, 90, 99)],
            [f"added per-event latency p50 = {share:.1%} of a {gap_us / 1e3:g} ms inter-token latency, "
             f"{added_event / (STEP_S * 1e3):.1%} of {STEP_S * 1e3:g} ms"],
        )  # fmt: skip
        clients = {}
        url = urls["direct"] + CHAT
        streams, long_events = (4, 2000) if quick else (10, 5000)
        for name, reader in (("httpx", _read_httpx), ("aiohttp", _read_aiohttp)):
            run_loop(reader(url, 1, 100))  # warm-up
            t0 = time.process_time()
            run_loop(reader(url, streams, long_events))
            clients[name] = (time.process_time() - t0) / (streams * long_events) * 1e6
        print_table(
            f"Client library reading a stream as fast as it is sent ({streams} streams of {long_events} events)",
            ["library", "client CPU µs/event", "vs httpx"],
            [[name, fmt(us, 2), fmt_ratio(us / clients["httpx"])] for name, us in clients.items()],
            ["the proxy forwards with aiohttp (docs/performance.md, The proxy's hop)"],
        )
    finally:
        _stop(proxy, upstream)
    return [Target(TARGET_ITL_STAND_IN, share < 0.05, f"+{fmt(added_event, 3)} ms = {share:.1%}")]


def run(quick: bool = False) -> list[Target]:
    from .bench_proxy_rs import rust_upstream

    return real_upstream(quick) + rust_upstream(quick) + stand_in(quick)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from ._common import print_targets

    print_targets(run(args.quick))


if __name__ == "__main__":
    main()

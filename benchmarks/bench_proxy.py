"""The cost of the extra hop: `vllm-nvext proxy` vs talking to the upstream directly, in one run.

The upstream is a stand-in, not vLLM (a real server's engine noise would swamp sub-millisecond
differences on this 2-core machine): a uvicorn process (`upstream_app` below) that answers chat
with the recorded long `return_token_ids` stream (tests/fixtures), its token chunks repeated to
`--events` events, one every `--gap-us` microseconds, each event's `id` carrying its send time
(`time.time_ns()`, one clock for every process of the machine). The proxy is the real
`vllm-nvext proxy` subprocess (one worker) in front of it.

- TTFB: request sent -> response headers, direct and through the proxy, requests alternating.
- Per-event latency: an event's arrival minus its send time; through the proxy minus direct is
  what the hop adds, as a share of the gap between events (the inter-token latency).
- Proxy CPU per streamed token: the proxy process's CPU time (/proc) over a batch of streams,
  over the tokens streamed, next to vLLM's API-server CPU per token (docs/performance.md).
- Client library: httpx vs aiohttp (both installed with vLLM) reading the same long stream from
  the stand-in as fast as it is sent, client CPU per event.

Run: python -m benchmarks.bench_proxy [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from ._common import Target, fmt, fmt_ratio, load_case, median, percentile, print_table, run_loop

CASE = "chat_stream_ids_long"
# vLLM 0.33's API server CPU per streamed token (docs/performance.md, bench_serving's long stream).
API_SERVER_US_PER_TOKEN = 130.0
TARGET_TTFB = "proxy: added TTFB p50 < 1 ms"
TARGET_ITL = "proxy: added per-event latency < 5% of the inter-token latency"
TARGET_CPU = "proxy: one proxy core serves >= 3 API-server cores' worth of tokens"
TARGETS = (TARGET_TTFB, TARGET_ITL, TARGET_CPU)
_ID = re.compile(rb'"id":"[^"]*"')


# --------------------------------------------------------------------------- the stand-in upstream


def _frames() -> tuple[bytes, list[bytes], list[bytes]]:
    events = load_case(CASE).events()
    first, *rest = events
    tokens = [e for e in rest if b'"finish_reason":null' in e]
    tail = [e for e in rest if e not in tokens]
    return first, tokens, tail


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Chat answered with the recorded stream; `x-events` events, `x-gap-us` apart, stamped in `id`."""
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
        # Hex, as vLLM's ids are: 19 decimal digits would send every event down JSON's exact-integer path.
        stamped = _ID.sub(b'"id":"chatcmpl-%x"' % time.time_ns(), frame, count=1)
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


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --------------------------------------------------------------------------- measurements

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "stream": True, "max_tokens": 4096}
DIALECT: dict[str, dict[str, Any]] = {
    "direct": {"return_token_ids": True},
    "proxy": {"nvext": {"extra_fields": ["completion_token_ids"]}},
}


async def _one(client: httpx.AsyncClient, url: str, route: str, events: int, gap_us: int) -> tuple[float, list[float]]:
    """(TTFB seconds, per-event latencies in seconds) of one stream."""
    headers = {"x-events": str(events), "x-gap-us": str(gap_us)}
    body = {**BODY, **DIALECT[route]}
    latencies: list[float] = []
    sent = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
        ttfb = time.perf_counter() - sent
        buffer = b""
        async for chunk in resp.aiter_raw():
            now = time.time_ns()
            buffer += chunk
            *frames, buffer = buffer.split(b"\n\n")
            for frame in frames:
                if frame.startswith(b"data: {"):
                    stamp = json.loads(frame[6:])["id"]
                    latencies.append((now - int(stamp[8:], 16)) / 1e9)
    return ttfb, latencies


async def _latency(
    urls: dict[str, str], rounds: int, events: int, gap_us: int
) -> dict[str, tuple[list[float], list[float]]]:
    found: dict[str, tuple[list[float], list[float]]] = {route: ([], []) for route in urls}
    async with httpx.AsyncClient(timeout=120) as client:
        for route, url in urls.items():
            await _one(client, url, route, 8, 0)  # warm-up: connections open, code paths hot
        for _ in range(rounds):
            for route, url in urls.items():  # alternating: drift hits both alike
                ttfb, lat = await _one(client, url, route, events, gap_us)
                found[route][0].append(ttfb)
                found[route][1].extend(lat)
    return found


async def _cpu(url: str, streams: int, events: int, concurrency: int) -> None:
    async with httpx.AsyncClient(timeout=300) as client:
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                await _one(client, url, "proxy", events, 0)

        await asyncio.gather(*(one() for _ in range(streams)))


async def _read_httpx(url: str, streams: int, events: int) -> int:
    received = 0
    async with httpx.AsyncClient(timeout=300) as client:
        for _ in range(streams):
            async with client.stream("POST", url, json=BODY, headers={"x-events": str(events)}) as resp:
                async for chunk in resp.aiter_raw():
                    received += len(chunk)
    return received


async def _read_aiohttp(url: str, streams: int, events: int) -> int:
    import aiohttp

    received = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(streams):
            async with session.post(url, json=BODY, headers={"x-events": str(events)}) as resp:
                async for chunk in resp.content.iter_any():
                    received += len(chunk)
    return received


def run(quick: bool = False) -> list[Target]:
    rounds, events, gap_us = (6, 64, 2000) if quick else (20, 256, 2000)
    cpu_streams, cpu_events = (16, 256) if quick else (64, 512)
    up_port, proxy_port = _free_port(), _free_port()
    upstream = _start(
        [sys.executable, "-m", "uvicorn", "benchmarks.bench_proxy:upstream_app", "--port", str(up_port),
         "--log-level", "warning", "--no-access-log", "--lifespan", "off"],
        up_port,
    )  # fmt: skip
    proxy = None
    try:
        proxy = _start(
            [sys.executable, "-m", "vllm_nvext.tools.cli", "proxy", "--upstream", f"http://127.0.0.1:{up_port}",
             "--port", str(proxy_port)],
            proxy_port,
        )  # fmt: skip
        urls = {"direct": f"http://127.0.0.1:{up_port}", "proxy": f"http://127.0.0.1:{proxy_port}"}
        found = run_loop(_latency(urls, rounds, events, gap_us))
        ttfb = {r: median(v[0]) * 1e3 for r, v in found.items()}
        lat50 = {r: percentile(v[1], 50) * 1e3 for r, v in found.items()}
        lat99 = {r: percentile(v[1], 99) * 1e3 for r, v in found.items()}
        added_ttfb = ttfb["proxy"] - ttfb["direct"]
        added_event = lat50["proxy"] - lat50["direct"]
        share = added_event / (gap_us / 1e3)
        print_table(
            f"Through vllm-nvext proxy vs direct ({rounds} streams each, alternating; {events} events "
            f"{gap_us} µs apart; nvext through the proxy, return_token_ids direct)",
            ["", "direct", "proxy", "added"],
            [
                ["TTFB p50 (ms)", fmt(ttfb["direct"], 3), fmt(ttfb["proxy"], 3), fmt(added_ttfb, 3)],
                ["event latency p50 (ms)", fmt(lat50["direct"], 3), fmt(lat50["proxy"], 3), fmt(added_event, 3)],
                [
                    "event latency p99 (ms)",
                    fmt(lat99["direct"], 3),
                    fmt(lat99["proxy"], 3),
                    fmt(lat99["proxy"] - lat99["direct"], 3),
                ],
            ],  # fmt: skip
            [f"added per-event latency = {share:.1%} of the {gap_us / 1e3:g} ms inter-token latency"],
        )
        assert proxy is not None
        before = _cpu_seconds(proxy.pid)
        run_loop(_cpu(urls["proxy"], cpu_streams, cpu_events, 8))
        proxy_us = (_cpu_seconds(proxy.pid) - before) / (cpu_streams * (cpu_events + 1)) * 1e6
        cores = API_SERVER_US_PER_TOKEN / proxy_us
        print_table(
            f"Proxy CPU per streamed token ({cpu_streams} nvext streams of {cpu_events} tokens, 8 at a time)",
            ["proxy", "vLLM API server (docs/performance.md)", "API-server cores per proxy core"],
            [[f"{fmt(proxy_us, 1)} µs/token", f"{API_SERVER_US_PER_TOKEN:g} µs/token", fmt(cores, 2)]],
            ["the proxy's figure includes its translation (the middleware's reshaping) and both HTTP hops"],
        )
        clients = {}
        url = urls["direct"] + "/v1/chat/completions"
        streams, long_events = (4, 2000) if quick else (10, 5000)
        for name, reader in (("httpx", _read_httpx), ("aiohttp", _read_aiohttp)):
            run_loop(reader(url, 1, 100))  # warm-up
            t0 = time.process_time()
            received = run_loop(reader(url, streams, long_events))
            clients[name] = ((time.process_time() - t0) / (streams * long_events) * 1e6, received)
        print_table(
            f"Client library reading a stream as fast as it is sent ({streams} streams of {long_events} events)",
            ["library", "client CPU µs/event", "vs httpx"],
            [[name, fmt(us, 2), fmt_ratio(us / clients["httpx"][0])] for name, (us, _) in clients.items()],
            ["the proxy keeps httpx unless aiohttp is clearly cheaper (docs/scaling-out.md)"],
        )
    finally:
        for proc in (proxy, upstream):
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=15)
    return [
        Target(TARGET_TTFB, added_ttfb < 1.0, f"+{fmt(added_ttfb, 3)} ms"),
        Target(TARGET_ITL, share < 0.05, f"+{fmt(added_event, 3)} ms = {share:.1%}"),
        Target(TARGET_CPU, cores >= 3, f"{fmt(proxy_us, 1)} µs/token = {fmt(cores, 2)} API-server cores"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from ._common import print_targets

    print_targets(run(args.quick))


if __name__ == "__main__":
    main()

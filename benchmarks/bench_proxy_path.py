"""Where `vllm-nvext proxy`'s added time to first event goes: its CPU per layer, and the floor of any hop.

In front of vLLM 0.33's API server (the scripted engine core of scripts/vllm_harness.py, as in
benchmarks/bench_proxy.py), 2-token streams alternate three ways:
- direct (`return_token_ids`);
- through a raw TCP relay (`--relay`: uvloop, bytes passed on as they come, no HTTP): the floor of
  any extra hop on this machine, the two more processes to wake per request;
- through the proxy (`nvext`), run by `--serve`: the proxy's app on uvicorn with `vllm-nvext proxy`'s
  settings, with stamps of its thread's CPU time (`time.thread_time_ns`: preemption by other
  processes does not count) at each layer's boundary of every request: uvicorn's parser, the app
  (NvextProxy and the middleware), the Forwarder, aiohttp's request and response, uvicorn's writes.
The stamps wrap library functions by name (uvicorn's httptools protocol, aiohttp's writer and
protocol): a measuring tool for the versions installed, not part of the proxy.

Printed: the time to first event, p50 each way and what the relay and the proxy add; the proxy's CPU
per layer on the way to the first event (median over the streams).

Run: python -m benchmarks.bench_proxy_path [--rounds N]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import aiohttp

from ._common import fmt, percentile, print_table, run_loop
from .bench_proxy import BODY, _free_port, _start, _stop, stream

# (layer, from stamp, to stamp): one request's way to its first event, in order.
LAYERS = (
    ("uvicorn: the request parsed, the app's task started", "read", "app"),
    ("NvextProxy and the middleware's request side (body read, plan)", "app", "forward"),
    ("Forwarder: headers, URL, the exchange and watch tasks", "forward", "request"),
    ("aiohttp: the request built and written (the write syscall included)", "request", "written"),
    ("aiohttp: the upstream's response start parsed, request() returns", "head", "answered"),
    ("Forwarder: the response headers, the start message", "answered", "start"),
    ("middleware and uvicorn: the response start written", "start", "start_written"),
    ("aiohttp and Forwarder: the first chunk read", "start_written", "first"),
    ("middleware and uvicorn: the first chunk reshaped and written", "first", "first_written"),
)
STAMPS_PATH = "/_bench/stamps"


# --------------------------------------------------------------------------- the stamped proxy (--serve)


def _serve(port: int, upstream: str) -> None:
    import uvicorn
    from aiohttp import client, client_proto, http_writer
    from uvicorn.protocols.http import httptools_impl

    from vllm_nvext.config import Settings
    from vllm_nvext.proxy import Forwarder, NvextProxy, ProxyConfig

    stamps: dict[str, int] = {}
    done: list[dict[str, int]] = []

    def mark(name: str) -> None:
        stamps.setdefault(name, time.thread_time_ns())

    def after(owner: Any, name: str, stamp: str, before: str | None = None) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if before:
                mark(before)
            result = inner(*args, **kwargs)
            mark(stamp)
            return result

        setattr(owner, name, wrapped)

    begin = httptools_impl.HttpToolsProtocol.on_message_begin

    def on_message_begin(self: Any) -> None:
        if stamps:
            done.append(dict(stamps))
            stamps.clear()
        mark("read")
        begin(self)

    received = client_proto.ResponseHandler.data_received

    def data_received(self: Any, data: bytes) -> None:
        if "written" in stamps:
            mark("head")
        received(self, data)

    request = client.ClientSession._request

    async def stamped_request(*args: Any, **kwargs: Any) -> Any:
        mark("request")
        response = await request(*args, **kwargs)
        mark("answered")
        return response

    cycle_send = httptools_impl.RequestResponseCycle.send

    async def written(self: Any, message: Any) -> None:
        await cycle_send(self, message)
        mark("start_written" if message["type"] == "http.response.start" else "first_written")

    forward = Forwarder.forward

    async def stamped_forward(self: Any, scope: Any, receive: Any, send: Any) -> None:
        mark("forward")

        async def stamped_send(message: Any) -> None:
            mark("start" if message["type"] == "http.response.start" else "first")
            await send(message)

        await forward(self, scope, receive, stamped_send)

    httptools_impl.HttpToolsProtocol.on_message_begin = on_message_begin  # type: ignore[method-assign]
    client_proto.ResponseHandler.data_received = data_received  # type: ignore[method-assign]
    client.ClientSession._request = stamped_request  # type: ignore[method-assign]
    httptools_impl.RequestResponseCycle.send = written  # type: ignore[method-assign]
    Forwarder.forward = stamped_forward  # type: ignore[method-assign]
    after(http_writer.StreamWriter, "_write", "written")
    after(http_writer.StreamWriter, "_writelines", "written")
    proxy = NvextProxy(ProxyConfig(upstream=upstream), Settings.from_env())

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == STAMPS_PATH:  # the stamps so far, as JSON
            body = json.dumps(done).encode()
            done.clear()
            await send(
                {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
            )
            await send({"type": "http.response.body", "body": body})
            return
        if scope["type"] == "http":
            mark("app")
        await proxy(scope, receive, send)

    # `vllm_nvext.proxy.serve`'s settings, one worker.
    uvicorn.run(app, host="127.0.0.1", port=port, server_header=False, date_header=False, proxy_headers=False,
                lifespan="on", loop="auto", http="auto", access_log=False, log_level="warning")  # fmt: skip


# --------------------------------------------------------------------------- the raw relay (--relay)


def _relay(port: int, upstream_port: int) -> None:
    import uvloop

    class Up(asyncio.Protocol):
        def __init__(self, down: Down) -> None:
            self.down = down

        def connection_made(self, transport: Any) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            self.down.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self.down.transport.close()

    class Down(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.held: list[bytes] = []
            self.up: Up | None = None
            asyncio.get_running_loop().create_task(self.connect())

        async def connect(self) -> None:
            loop = asyncio.get_running_loop()
            _, up = await loop.create_connection(lambda: Up(self), "127.0.0.1", upstream_port)
            self.up = up
            for data in self.held:
                up.transport.write(data)

        def data_received(self, data: bytes) -> None:
            if self.up is None:
                self.held.append(data)
            else:
                self.up.transport.write(data)

        def connection_lost(self, exc: Exception | None) -> None:
            if self.up is not None:
                self.up.transport.close()

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(Down, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(serve())


# --------------------------------------------------------------------------- the run


async def _alternate(urls: dict[str, str], rounds: int, warm_up: int = 3) -> dict[str, list[float]]:
    """`rounds` 2-token streams each way, the order turned each round; the relay sends the direct dialect."""
    body = {**BODY, "max_tokens": 2, "ignore_eos": True}
    firsts: dict[str, list[float]] = {way: [] for way in urls}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(warm_up + rounds):
            if i == warm_up:  # the warm-up's stamps dropped
                async with session.get(urls["proxy"] + STAMPS_PATH) as resp:
                    await resp.read()
            for way, url in list(urls.items())[:: 1 if i % 2 else -1]:
                found = await stream(session, url, "proxy" if way == "proxy" else "direct", body)
                if i >= warm_up:
                    firsts[way].append(found.first * 1e3)
    return firsts


async def _stamps(url: str) -> list[dict[str, int]]:
    async with aiohttp.ClientSession() as session, session.get(url + STAMPS_PATH) as resp:
        return list(await resp.json())


def measure(rounds: int) -> tuple[dict[str, list[float]], list[dict[str, int]], tuple[float, float]]:
    from vllm_nvext.tools import tiny_model
    from vllm_nvext.tools.server import TINY_ARGS

    from .bench_serving import _harness

    h = _harness()
    args = (*TINY_ARGS, "--served-model-name", "tiny", "--disable-uvicorn-access-log")
    env = {"SCRIPTED_STEP_SECONDS": "0.01"}
    server = h.HarnessServer(model=str(tiny_model.ensure()), args=args, env=env, name="bench-proxy-path")
    proxy = relay = None
    try:
        server.start()
        server.wait_ready(timeout=float(os.environ.get("VLLM_NVEXT_STARTUP_TIMEOUT", "600")))
        port, relay_port = _free_port(), _free_port()
        me = [sys.executable, "-m", "benchmarks.bench_proxy_path"]
        proxy = _start([*me, "--serve", str(port), server.url], port)
        relay = _start([*me, "--relay", str(relay_port), str(server.port)], relay_port)
        urls = {"direct": server.url, "relay": f"http://127.0.0.1:{relay_port}", "proxy": f"http://127.0.0.1:{port}"}
        load = os.getloadavg()[0]
        firsts = run_loop(_alternate(urls, rounds))
        return firsts, run_loop(_stamps(urls["proxy"])), (load, os.getloadavg()[0])
    finally:
        _stop(proxy, relay)
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--serve", nargs=2, metavar=("PORT", "UPSTREAM"), help=argparse.SUPPRESS)
    parser.add_argument("--relay", nargs=2, type=int, metavar=("PORT", "UPSTREAM_PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return _serve(int(args.serve[0]), args.serve[1])
    if args.relay:
        return _relay(*args.relay)
    firsts, stamps, load = measure(args.rounds)
    direct = percentile(firsts["direct"], 50)
    print_table(
        f"Time to first event, {args.rounds} 2-token streams each way, alternating "
        f"(load average {load[0]:.1f} at the start, {load[1]:.1f} at the end)",
        ["", "p50 (ms)", "added p50 (ms)"],
        [[way, fmt(percentile(v, 50), 3), fmt(percentile(v, 50) - direct, 3)] for way, v in firsts.items()],
    )
    whole = [s for s in stamps if all(k in s for _, a, b in LAYERS for k in (a, b))]
    rows = [[name, fmt(statistics.median(s[b] - s[a] for s in whole) / 1e3, 1)] for name, a, b in LAYERS]
    total = statistics.median(s["first_written"] - s["read"] for s in whole) / 1e3
    print_table(
        f"The proxy's CPU (its thread's) per layer on the way to the first event, median of {len(whole)} streams",
        ["layer", "CPU µs"],
        [*rows, ["the request read -> the first chunk written, in all", fmt(total, 1)]],
        ["vLLM writes its response start and first chunk back to back: both are on the way to the first event"],
    )


if __name__ == "__main__":
    main()

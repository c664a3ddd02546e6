"""Middlewares `bench_serving` hands vLLM by class path (`--middleware`), beside NvextMiddleware itself.

- `PurePythonNvextMiddleware`: NvextMiddleware on its pure-Python stream path (what an install
  without the compiled extension, or VLLM_NVEXT_PURE_PYTHON=1, runs);
- `FloorMiddleware`: a pure-ASGI middleware that does nothing but call the app: the floor any
  ASGI middleware costs;
- `CalibrationMiddleware`: the floor plus a fixed Python loop per request (a few hundred µs):
  how much more a small piece of Python costs inside vLLM's app than warm, to read the
  middleware's own in-app/warm ratio against;
- `SpreadMiddleware`: the floor plus one call each of `SPREAD_FUNCTIONS` distinct small functions
  per request, each with its own code and its own data (a few µs warm in all): what entering many
  different pieces of Python costs inside vLLM's app, against the calibration's one tight loop;
- `CaptureNvextMiddleware`: NvextMiddleware with capture on (docs/capture.md), into a SQLite store in a
  temp directory of its own; `CAPTURE_SINKS` holds each instance's sink, so that the benchmark can wait
  for the writer thread inside the measured window (the write is part of what capture costs).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from typing import Any

from vllm_nvext import NvextMiddleware


class PurePythonNvextMiddleware(NvextMiddleware):
    def __init__(self, app: Any) -> None:
        super().__init__(app, pure_python=True)


class FloorMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


CALIBRATION_ITERATIONS = 10_000


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


class CalibrationMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        _loop(CALIBRATION_ITERATIONS)
        await self.app(scope, receive, send)


SPREAD_FUNCTIONS = 100


def _spread(count: int) -> tuple[Any, ...]:
    """`count` functions, each its own code object reading and writing its own dict."""
    body = "_d{i} = {{'n': 0}}\ndef _f{i}(x):\n    _d{i}['n'] = _d{i}['n'] + x\n    return x + {i}\n"
    source = "\n".join(body.format(i=i) for i in range(count))
    namespace: dict[str, Any] = {}
    exec(compile(source, "<spread>", "exec"), namespace)
    return tuple(namespace[f"_f{i}"] for i in range(count))


_SPREAD = _spread(SPREAD_FUNCTIONS)


class SpreadMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        for function in _SPREAD:
            function(1)
        await self.app(scope, receive, send)


CAPTURE_SINKS: list[Any] = []


class CaptureNvextMiddleware(NvextMiddleware):
    LOGPROBS = False

    def __init__(self, app: Any) -> None:
        folder = tempfile.mkdtemp(prefix="bench-capture-")
        atexit.register(shutil.rmtree, folder, True)
        super().__init__(app, capture=f"sqlite:///{folder}/capture.sqlite3", capture_logprobs=self.LOGPROBS)
        CAPTURE_SINKS.append(self.sink)


class CaptureLogprobsMiddleware(CaptureNvextMiddleware):
    """Capture with VLLM_NVEXT_CAPTURE_LOGPROBS: the sampled tokens' logprobs asked of vLLM, taken back out."""

    LOGPROBS = True

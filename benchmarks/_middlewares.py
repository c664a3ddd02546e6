"""Middlewares `bench_serving` hands vLLM by class path (`--middleware`), beside NvextMiddleware itself.

- `PurePythonNvextMiddleware`: NvextMiddleware on its pure-Python stream path (what an install
  without the compiled extension, or VLLM_NVEXT_PURE_PYTHON=1, runs);
- `FloorMiddleware`: a pure-ASGI middleware that does nothing but call the app: the floor any
  ASGI middleware costs.
"""

from __future__ import annotations

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

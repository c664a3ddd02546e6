"""A vLLM-shaped chat server in a process of its own, for the capture tests that send a real process SIGTERM.

`python -m tests.support.capture_app PORT [--capture URL] [--hang] [--vllm-signals]` serves, on 127.0.0.1:PORT,
`POST /v1/chat/completions` (one chat completion with vLLM's prompt and completion ids, whatever was asked) and
`GET /health`, with uvicorn:

- without `--capture`: a stock upstream (what `vllm-nvext proxy` is put in front of);
- with `--capture URL`: NvextMiddleware added to the app as vLLM adds `--middleware` and the plugin's
  (`app.add_middleware`), capturing into URL;
- `--hang`: the store's reads and writes never return (a frozen disk), and the store's waits are short
  (`store.CLOSE_WAIT_S` 2 s, `api.STORE_WAIT_S` 1 s) so the test does not wait long for the bounds;
- `--vllm-signals`: SIGTERM handled as vLLM's own server does (`NoSignalServer`: its handler on the loop,
  uvicorn's left out, so the process ends by returning, not by the signal re-raised).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import threading
from collections.abc import Iterator
from typing import Any

ANSWER = {
    "id": "chatcmpl-app",
    "object": "chat.completion",
    "created": 1,
    "model": "tiny",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "logprobs": None,
            "finish_reason": "stop",
            "token_ids": [4, 5],
        }
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
}


def app(capture: str | None) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    from vllm_nvext import NvextMiddleware

    async def chat(request: Request) -> Response:
        await request.body()
        return Response(json.dumps(ANSWER), media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b"")

    served = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/health", health)])
    if capture is not None:
        served.add_middleware(NvextMiddleware, capture=capture)
    return served


def hang_the_store() -> None:
    """Every SQLite store's read and write wait forever (a frozen disk); the store's bounds made short."""
    from vllm_nvext.capture import api, sqlite_store, store

    frozen = threading.Event()

    def wait(*args: Any) -> Any:
        frozen.wait()

    sqlite_store.SQLiteBackend.write = wait  # type: ignore[method-assign,assignment]
    sqlite_store.SQLiteBackend.read = wait  # type: ignore[method-assign,assignment]
    store.CLOSE_WAIT_S = 2.0
    api.STORE_WAIT_S = 1.0


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--capture", default=None)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--vllm-signals", action="store_true")
    args = parser.parse_args()
    if args.hang:
        hang_the_store()
    config = uvicorn.Config(app(args.capture), host="127.0.0.1", port=args.port, lifespan="on", access_log=False)
    if not args.vllm_signals:
        uvicorn.Server(config).run()
        return

    class NoSignalServer(uvicorn.Server):  # vLLM's (vllm/entrypoints/launchers/launcher.py)
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    server = NoSignalServer(config)

    async def serve() -> None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, lambda: setattr(server, "should_exit", True))
        await server.serve()

    asyncio.run(serve())


if __name__ == "__main__":
    main()

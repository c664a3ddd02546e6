"""The capture's read API on the server: `GET`/`DELETE /v1/nvext/sessions/{id}` (capture/api.py makes the answers),
served only where the operator's setting and the server's key allow it, and the start-up line that says who it is
served to (docs/capture.md, Threat model).
"""

from __future__ import annotations

import logging
import sys

from .. import _vllm_compat, metrics
from ..asgi_types import ASGIApp, Receive, Scope, Send
from ..capture import api as capture_api
from ..capture.store import Sink
from ..config import ENV_CAPTURE_API, CaptureApi

# Set on the lifespan scope once the read API's start-up line is said (two mounts, one line).
ANNOUNCED = "vllm_nvext.capture_announced"
_READ_API = "vllm-nvext capture: the read API (/v1/nvext/sessions/{id}) "
_OFF_HINT = f"; {ENV_CAPTURE_API}=off turns it off (read the store with `vllm-nvext sessions export`)"
NOT_SERVED_KEYLESS = (
    _READ_API + "is NOT served: this server checks no API key (--api-key or VLLM_API_KEY), so anyone who reaches "
    f"it could read and delete every captured session; give the server a key to serve it, or set {ENV_CAPTURE_API}"
    "=open to serve it to anyone (docs/capture.md, Threat model)"
)
SERVED_KEYLESS = (
    _READ_API + f"is served WITHOUT a key ({ENV_CAPTURE_API}=open): anyone who reaches this server reads and deletes "
    "every captured session" + _OFF_HINT
)
SERVED_KEYED = _READ_API + "is served behind this server's API key" + _OFF_HINT
OFF = _READ_API + f"is off ({ENV_CAPTURE_API}=off): read the store with `vllm-nvext sessions export`"


async def serve_sessions(app: ASGIApp, sink: Sink, api: CaptureApi, scope: Scope, receive: Receive, send: Send) -> bool:
    """`GET`/`DELETE /v1/nvext/sessions/{id}` under vLLM's key check exactly as `/v1` is: a request the check
    refuses goes on to vLLM (or the proxy's upstream), which refuses it as it refuses `/v1`. Served only behind a
    key, unless `api` is `open` (never when `off`): a request not served goes on as any other route (vLLM's 404,
    the proxy's upstream). False (nothing done) for any other request. The lifespan's start-up says who the read
    API is served to."""
    if scope["type"] != "http":
        if scope["type"] == "lifespan" and ANNOUNCED not in scope:  # the outer of two mounts says it, once
            scope[ANNOUNCED] = True
            announce(api, bool(_vllm_compat.server_facts(scope).key_digests))
        return False
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    if not capture_api.is_sessions_path(path) or not serves(api, scope):
        return False
    if _vllm_compat.auth_refuses(scope):
        await app(scope, receive, send)
        return True
    answer = await capture_api.answer(sink, scope.get("method", ""), path, scope.get("query_string", b""))
    if answer.status == 400:
        metrics.count_refusal(answer.param, answer.status)
    headers = [(b"content-type", answer.content_type.encode())]
    headers += [(name.encode(), value.encode()) for name, value in answer.headers]
    length = len(answer.body) if answer.pieces is None else answer.length
    if length is not None:  # else (ATIF) the server sends the pieces chunked
        headers.append((b"content-length", str(length).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    if answer.pieces is not None:
        async for piece in answer.pieces:  # each made in the reads' thread, the loop free meanwhile
            await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})
    return True


def serves(api: CaptureApi, scope: Scope) -> bool:
    """Whether this server answers the read API: `keyed` where it checks an API key, `open` always, `off` never."""
    if api is CaptureApi.OFF:
        return False
    return api is CaptureApi.OPEN or bool(_vllm_compat.server_facts(scope).key_digests)


def announce(api: CaptureApi, keyed: bool) -> None:
    """The start-up line: who the read API is served to (a warning where anyone could reach it, or it is withheld)."""
    if api is CaptureApi.OFF:
        _say(logging.INFO, OFF)
    elif keyed:
        _say(logging.INFO, SERVED_KEYED)
    else:
        _say(logging.WARNING, SERVED_KEYLESS if api is CaptureApi.OPEN else NOT_SERVED_KEYLESS)


def _say(level: int, message: str) -> None:
    """Logged where the operator reads it: inside vLLM's server, its `vllm` loggers print (ours would print a warning
    twice, through Python's last-resort handler too); elsewhere (the proxy), ours."""
    logging.getLogger("vllm.nvext" if "vllm.logger" in sys.modules else "vllm_nvext").log(level, message)

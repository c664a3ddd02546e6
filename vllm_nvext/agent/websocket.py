"""Codex's WebSocket attempt on /v1/responses, answered at once with the refusal Codex reads as "use HTTP".

docs/protocol.md §11.4. Codex opens `ws://HOST/v1/responses` before it POSTs when its provider has
`supports_websockets` (the built-in OpenAI provider does). In Codex's `codex-rs/core/src/client.rs` an
HTTP 426 answer to the upgrade (`StatusCode::UPGRADE_REQUIRED`) switches the session to HTTP at once;
any other refusal (vLLM's 403 for a route it lacks, a close after the handshake) is a stream error it
retries up to `stream_max_retries` (5) times first. vLLM has no WebSocket route there; no body is read.
"""

from __future__ import annotations

from .. import _vllm_compat
from ..asgi_types import Scope, Send
from ..protocol import error_body

RESPONSES_PATH = "/v1/responses"
# The ASGI extension by which a refused handshake carries an HTTP status (uvicorn, hypercorn, daphne).
DENIAL_EXTENSION = "websocket.http.response"
UPGRADE_REQUIRED = 426
REFUSAL = (
    "vLLM serves /v1/responses over HTTP only: POST the request (Codex: set supports_websockets = false "
    "on the model provider)"
)


def refuses(scope: Scope) -> bool:
    """A WebSocket upgrade to /v1/responses that vLLM's key check lets through: the one answered here."""
    if scope["type"] != "websocket":
        return False
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path == RESPONSES_PATH and not _vllm_compat.auth_refuses(scope)


async def refuse(scope: Scope, send: Send) -> None:
    """426 in vLLM's error envelope, before any handshake; a server without the denial extension
    can only close it (its servers answer that with 403)."""
    if DENIAL_EXTENSION not in (scope.get("extensions") or {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    payload = error_body(REFUSAL, None, UPGRADE_REQUIRED)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "websocket.http.response.start", "status": UPGRADE_REQUIRED, "headers": headers})
    await send({"type": "websocket.http.response.body", "body": payload, "more_body": False})

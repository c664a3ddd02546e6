"""Sessions by URL: `/nvext/sessions/{id}` before any route the server serves (docs/capture.md, Sessions by URL).

An RL trainer hands each rollout its own base URL (`http://host:8000/nvext/sessions/rollout-17/v1`): no header, no
client setting. The mount that sees such a request first rewrites its `path` and `raw_path` to the route it names
(`/v1/chat/completions`, `/v1/models`, ...), before anything routes it, and records the id on the scope
(`keys.URL_SESSION`) for the capture's tap, where it names the session before any header does.

The key check: on the plugin mount vLLM's `--api-key` middleware runs before this one and saw the prefixed path,
which starts with none of its guarded prefixes, so it let the request through. The rewritten request is therefore
checked here, as vLLM's check would check the route it names (`_vllm_compat.auth_refuses`), on every mount, and a
refused one gets vLLM's own 401 answer; an id that is no session id gets a 400 naming the path segment, after that
check (a keyless client learns nothing of the route).
"""

from __future__ import annotations

from .. import _vllm_compat
from ..asgi import send_error
from ..asgi_types import Scope, Send
from ..capture.keys import URL_PREFIX, URL_SESSION
from ..capture.record import SESSION_ID_MAX, valid_session_id
from ..protocol import RequestError

_RAW_PREFIX = URL_PREFIX.encode()
# vLLM's AuthenticationMiddleware's refusal, as starlette's JSONResponse writes it.
UNAUTHORIZED = b'{"error":"Unauthorized"}'
BAD_SEGMENT = (
    f"the URL's session segment (/nvext/sessions/{{session_id}}/...) must be 1 to {SESSION_ID_MAX} letters, digits "
    "or . _ : ~ -, not dots alone"
)
SEGMENT_PARAM = "session_id"


def _split(path: str) -> tuple[str, str] | None:
    """(the id, the route it prefixes) of a prefixed path; None: no prefix, or nothing after the id."""
    if not path.startswith(URL_PREFIX):
        return None
    segment, slash, rest = path[len(URL_PREFIX) :].partition("/")
    return (segment, slash + rest) if rest else None


async def rewrite(scope: Scope, send: Send) -> bool:
    """Rewrite a prefixed HTTP request to the route it names (once, by the outermost mount); True when it was
    answered here instead: vLLM's 401 for a request its key check refuses on that route, a 400 for a bad id."""
    if scope["type"] != "http" or URL_SESSION in scope:
        return False
    root: str = scope.get("root_path", "")
    path: str = scope.get("path", "")
    found = _split(path[len(root) :] if root and path.startswith(root) else path)
    if found is None:
        return False
    segment, rest = found
    raw: bytes | None = scope.get("raw_path")
    raw_root = len(root.encode("latin-1")) if root and raw is not None and raw.startswith(root.encode()) else 0
    raw_segment_end = -1 if raw is None else raw.find(b"/", raw_root + len(_RAW_PREFIX))
    scope["path"] = root + rest if root and path.startswith(root) else rest
    if raw is not None:
        raw_segment = raw[raw_root + len(_RAW_PREFIX) : raw_segment_end] if raw_segment_end >= 0 else b""
        if raw_segment != segment.encode("latin-1", "replace"):
            segment = ""  # escaped in the URL (`a%2Fb`): no session id the read API could be asked for
        scope["raw_path"] = raw[:raw_root] + (raw[raw_segment_end:] if raw_segment_end >= 0 else rest.encode())
    scope[URL_SESSION] = segment if valid_session_id(segment) else None
    if _vllm_compat.auth_refuses(scope):
        await _unauthorized(send)
        return True
    if scope[URL_SESSION] is None:
        await send_error(send, RequestError(BAD_SEGMENT, SEGMENT_PARAM))
        return True
    return False


async def _unauthorized(send: Send) -> None:
    headers = [(b"content-length", str(len(UNAUTHORIZED)).encode()), (b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": UNAUTHORIZED, "more_body": False})

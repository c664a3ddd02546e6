"""The read API of the capture store: `GET` and `DELETE /v1/nvext/sessions/{session_id}`.

The middleware (both mounts) and the proxy answer the route after vLLM's key check, with `answer`:
the store is read in a worker thread, never on the event loop, and one answer holds at most
`store.READ_MAX_BYTES` of turns (however large, at least one): `next_index` says where the next
page starts (`?start=N`), null at the end. Errors are vLLM's envelope; none carries an exception's
text or a path. docs/capture.md "Reading it". No ASGI here: the callers send the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs

from ..protocol import error_body
from . import continuation
from .atif import trajectory
from .record import SESSION_ID_MAX, valid_session_id
from .store import READ_MAX_BYTES, Sink

SESSIONS_PATH = "/v1/nvext/sessions/"
STORE_WAIT_S = 30.0  # how long an answer waits for the store (a disk that hangs): past it, a 503
STORE_THREADS = 16  # store calls running at once, hung ones included: past it, a 503 without a new thread
FORMATS = ("json", "atif")
_READ_ONLY = ("GET",)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    param: str | None = None  # the request field a refusal names (counted by the caller)


def is_sessions_path(path: str) -> bool:
    return path.startswith(SESSIONS_PATH)


def _refusal(message: str, param: str | None, status: int = 400) -> Answer:
    return Answer(status, error_body(message, param, status), param)


async def answer(sink: Sink, method: str, path: str, query_string: bytes) -> Answer:
    """The answer to one request of the sessions route (`path` after the root path)."""
    if method not in (*_READ_ONLY, "DELETE"):
        return _refusal("Method Not Allowed: GET or DELETE", None, 405)
    session_id = path[len(SESSIONS_PATH) :]
    if not valid_session_id(session_id):
        return _refusal(
            f"session_id: expected 1 to {SESSION_ID_MAX} letters, digits or the characters . _ : ~ -, not dots alone",
            "session_id",
        )
    try:
        query = parse_qs(query_string.decode("latin-1"), keep_blank_values=True, strict_parsing=False)
    except ValueError:
        query = {}
    fmt = query.get("format", ["json"])[-1]
    if fmt not in FORMATS:
        return _refusal(f"format: expected one of {', '.join(FORMATS)}", "format")
    raw_start = query.get("start", ["0"])[-1]
    if not raw_start.isdigit() or len(raw_start) > 12:
        return _refusal("start: expected a non-negative integer", "start")
    try:
        if method == "DELETE":
            found = await in_thread(sink.delete, session_id, timeout=STORE_WAIT_S)
            if continuation.MEMORY is not None:  # on the event loop, which owns it: never continued after
                continuation.MEMORY.forget(session_id)
            body = json.dumps({"session_id": session_id, "deleted": True}).encode() if found else None
        else:
            body = await in_thread(_read, sink, session_id, int(raw_start), fmt, timeout=STORE_WAIT_S)
    except Exception:  # the store's failure is the operator's to see in the log, never the client's
        return _refusal("the capture store is unavailable", None, 503)
    if body is None:
        return _refusal(f"session {session_id} not found", "session_id", 404)
    return Answer(200, body)


_T = TypeVar("_T")
_running = 0  # store calls in their threads now (`in_thread`)
_running_lock = threading.Lock()


async def in_thread(fn: Callable[..., _T], *args: Any, timeout: float | None, limited: bool = True) -> _T:
    """`fn(*args)` in a daemon thread of its own, awaited up to `timeout` (None: no bound; TimeoutError past it, the
    thread left to end or hang). Not the event loop's executor: a thread of it that hangs on the store (a frozen
    disk) would stall vLLM's own work queued there and hold the process's exit; a daemon thread holds neither.
    RuntimeError when STORE_THREADS calls are still running (hung): no thread is started for more (`limited`
    False: the shutdown's one call, which those never hold back)."""
    global _running
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            if error is not None:
                done.set_exception(error)
            else:
                done.set_result(result)

    def run() -> None:
        global _running
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        finally:
            if limited:
                with _running_lock:
                    _running -= 1
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for the answer
            loop.call_soon_threadsafe(settle, result, error)

    if limited:
        with _running_lock:
            if _running >= STORE_THREADS:
                raise RuntimeError("the capture store's calls are all still running")
            _running += 1
    threading.Thread(target=run, name="vllm-nvext-capture-call", daemon=True).start()
    return await asyncio.wait_for(done, timeout)


def _read(sink: Sink, session_id: str, start: int, fmt: str) -> bytes | None:
    """The answer's body, built in the worker thread (the turns joined as stored, not re-encoded)."""
    page = sink.read_page(session_id, start, READ_MAX_BYTES)
    if page is None:
        return None
    if fmt == "atif":
        if not page.turns:
            return None
        doc = trajectory(session_id, [json.loads(t) for t in page.turns])
        if page.next_index is not None:
            doc["extra"] = {"next_index": page.next_index}
        return json.dumps(doc, separators=(",", ":")).encode()
    head = b'{"session_id":' + json.dumps(session_id).encode() + b',"turns":['
    tail = b'],"next_index":' + json.dumps(page.next_index).encode() + b"}"
    return head + ",".join(page.turns).encode() + tail

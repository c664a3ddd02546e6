"""The read API of the capture store: `GET` and `DELETE /v1/nvext/sessions/{session_id}`.

The middleware (both mounts) and the proxy answer the route after vLLM's key check, with `answer`. What a read
takes from the server's event loop is bounded: the store is read, and the answer built, in one reader thread per
process (concurrent reads take turns, never several threads holding the interpreter at once), in steps of at most
READ_PIECE_BYTES of stored turns each (json's encoder handed `atif.ENCODE_SLICE` values at a time), each step a
piece of the body sent as soon as it is made: between two steps the loop serves everyone else. One answer holds
at most `store.READ_MAX_BYTES` of turns (however large, at least one): `next_index` says where the next page
starts (`?start=N`), null at the end. Errors are vLLM's envelope; none carries an exception's text or a path; a
503 is logged with the kind of failure. docs/capture.md "Reading it". No ASGI here: the callers send the answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs

from ..protocol import error_body
from . import atif, continuation
from .record import SESSION_ID_MAX, valid_session_id
from .store import READ_MAX_BYTES, Page, Sink

SESSIONS_PATH = "/v1/nvext/sessions/"
FORMATS = ("json", "atif")
_READ_ONLY = ("GET",)
_START = re.compile(r"[0-9]{1,12}")  # ASCII digits: `str.isdigit` takes `²`, which `int` refuses
READ_PIECE_BYTES = 1024 * 1024  # the stored turns one step of a read decodes and encodes (at least one turn)
# The reads' one thread per process: reads take turns, and never more than one thread of them competes with the
# event loop for the interpreter (four reads in four threads stalled another client's stream ~2 s).
_READER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vllm-nvext-capture-read")
logger = logging.getLogger("vllm_nvext.capture")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    param: str | None = None  # the request field a refusal names (counted by the caller)
    pieces: AsyncIterator[bytes] | None = None  # a read's body, piece by piece as it is made (`body` is then b"")
    length: int | None = None  # the pieces' total size, where it is known before they are made


def is_sessions_path(path: str) -> bool:
    return path.startswith(SESSIONS_PATH)


def _refusal(message: str, param: str | None, status: int = 400) -> Answer:
    return Answer(status, error_body(message, param, status), param)


def _unavailable(exc: BaseException, method: str) -> Answer:
    """The 503 of a store that failed, logged with the failure's kind (never its text, which may name a path or an
    address); the answer says nothing more."""
    if isinstance(exc, TimeoutError) and method == "DELETE":
        why = "the store's writer had not written the turns queued before the DELETE in 10 s"
    else:
        why = f"the store failed ({type(exc).__name__})"
    logger.warning("vllm-nvext capture: the read API answered %s with a 503: %s", method, why)
    return _refusal("the capture store is unavailable", None, 503)


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
    if not _START.fullmatch(raw_start):
        return _refusal("start: expected a non-negative integer (the digits 0-9)", "start")
    try:
        if method == "DELETE":
            found = await asyncio.to_thread(sink.delete, session_id)  # not the reader: it may wait for the writer
            if continuation.MEMORY is not None:  # on the event loop, which owns it: never continued after
                continuation.MEMORY.forget(session_id)
            if not found:
                return _refusal(f"session {session_id} not found", "session_id", 404)
            return Answer(200, json.dumps({"session_id": session_id, "deleted": True}).encode())
        page = await _reading(sink.read_page, session_id, int(raw_start), READ_MAX_BYTES)
        if page is None or (fmt == "atif" and not page.turns):
            return _refusal(f"session {session_id} not found", "session_id", 404)
        if fmt == "atif":
            return Answer(200, b"", pieces=_atif_pieces(session_id, page))
        length = await _reading(_json_length, session_id, page)
        return Answer(200, b"", pieces=_json_pieces(session_id, page), length=length)
    except Exception as exc:  # the store's failure is the operator's to see in the log, never the client's
        return _unavailable(exc, method)


async def _reading(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the reads' thread, the event loop free meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(_READER, fn, *args)


def _groups(turns: list[str]) -> list[tuple[int, int]]:
    """The turns' (start, end) in steps of READ_PIECE_BYTES of stored text (at least one turn each)."""
    spans: list[tuple[int, int]] = []
    start = size = 0
    for i, turn in enumerate(turns):
        if i > start and size + len(turn) > READ_PIECE_BYTES:
            spans.append((start, i))
            start, size = i, 0
        size += len(turn)
    if start < len(turns):
        spans.append((start, len(turns)))
    return spans


def _json_head(session_id: str) -> bytes:
    return b'{"session_id":' + json.dumps(session_id).encode() + b',"turns":['


def _json_tail(page: Page) -> bytes:
    return b'],"next_index":' + json.dumps(page.next_index).encode() + b"}"


def _json_length(session_id: str, page: Page) -> int:
    """The JSON answer's size: the turns as stored (JSON text, ASCII as the store writes it), joined."""
    size = sum(len(t) if t.isascii() else len(t.encode()) for t in page.turns) + max(len(page.turns) - 1, 0)
    return len(_json_head(session_id)) + size + len(_json_tail(page))


async def _json_pieces(session_id: str, page: Page) -> AsyncIterator[bytes]:
    """The session's turns joined as stored (never re-encoded), a piece of at most about READ_PIECE_BYTES at a time."""
    yield _json_head(session_id)
    for n, (start, end) in enumerate(_groups(page.turns)):
        group = page.turns[start:end]
        text = ("," if n else "") + ",".join(group)
        for i in range(0, len(text), READ_PIECE_BYTES):  # one turn larger than a piece goes in several
            yield await _reading(str.encode, text[i : i + READ_PIECE_BYTES])
    yield _json_tail(page)


def _atif_steps(turns: list[str], first_step: int) -> tuple[bytes, str | None, dict[str, int]]:
    """Some turns' steps (numbered from `first_step`), encoded; the first model they name; their token counts."""
    encoded: list[str] = []
    model: str | None = None
    totals: dict[str, int] = {}
    for n, text in enumerate(turns):
        made = atif.step(first_step + n, json.loads(text))
        model = model or made.get("model_name")
        for key in ("prompt_tokens", "completion_tokens"):
            if key in made.get("metrics", {}):
                totals[key] = totals.get(key, 0) + made["metrics"][key]
        encoded.append(atif.encode(made))
    return ",".join(encoded).encode(), model, totals


async def _atif_pieces(session_id: str, page: Page) -> AsyncIterator[bytes]:
    """The ATIF document of the page's turns (`atif.trajectory`'s, byte for byte), a step of turns at a time; the
    head, which names the first model a turn names, goes once that turn is read."""
    held: list[bytes] = []  # the steps made before the first that names a model
    model: str | None = None
    totals: dict[str, int] = {}
    started = False
    for start, end in _groups(page.turns):
        piece, named, counts = await _reading(_atif_steps, page.turns[start:end], start + 1)
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        model = model or named
        held.append(b"," + piece if start else piece)
        if model is not None or end == len(page.turns):
            if not started:
                started = True
                yield atif.document_head(session_id, model).encode()
            for part in held:
                for i in range(0, len(part), READ_PIECE_BYTES):
                    yield part[i : i + READ_PIECE_BYTES]
            held.clear()
    yield atif.document_tail(len(page.turns), totals, page.next_index).encode()

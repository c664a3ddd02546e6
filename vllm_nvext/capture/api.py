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
import contextlib
import json
import logging
import re
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import parse_qs

from ..protocol import error_body
from . import atif, continuation, nemo_gym
from .base import Page
from .record import SESSION_ID_MAX, valid_session_id
from .store import READ_MAX_BYTES, Sink

SESSIONS_PATH = "/v1/nvext/sessions/"
STORE_WAIT_S = 30.0  # how long an answer waits for the store (a disk that hangs): past it, a 503
STORE_THREADS = 16  # store calls running at once, hung ones included: past it, a 503 without a new thread
FORMATS = ("json", "atif", "nemo-gym")
NDJSON = "application/x-ndjson"
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
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()  # more response headers


def is_sessions_path(path: str) -> bool:
    return path.startswith(SESSIONS_PATH)


def _refusal(message: str, param: str | None, status: int = 400) -> Answer:
    return Answer(status, error_body(message, param, status), param)


def _unavailable(exc: BaseException, method: str) -> Answer:
    """The 503 of a store that failed, logged with the failure's kind (never its text, which may name a path or an
    address); the answer says nothing more."""
    if isinstance(exc, TimeoutError):  # a store that hangs, or (a DELETE) a writer too stuck to reach its turns
        why = "the store did not answer in time" + (
            " (or its writer did not reach the DELETE)" if method == "DELETE" else ""
        )
    elif isinstance(exc, RuntimeError) and str(exc) == _ALL_RUNNING:
        why = f"{STORE_THREADS} calls of the store are still running (hung)"
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
            # Not the reader: it may wait for the writer. A thread of its own, bounded (a disk that hangs).
            found = await in_thread(sink.delete, session_id, timeout=STORE_WAIT_S)
            if continuation.MEMORY is not None:  # on the event loop, which owns it: never continued after
                continuation.MEMORY.forget(session_id)
            if not found:
                return _refusal(f"session {session_id} not found", "session_id", 404)
            return Answer(200, json.dumps({"session_id": session_id, "deleted": True}).encode())
        page = await in_thread(sink.read_page, session_id, int(raw_start), READ_MAX_BYTES, timeout=STORE_WAIT_S)
        if page is None:
            return _refusal(f"session {session_id} not found", "session_id", 404)
        if (
            fmt != "json" and not page.turns
        ):  # a trajectory (or a record file) holds one step at least: none past the end
            return _refusal(f"start: session {session_id} has no turn at or after {int(raw_start)}", "start", 404)
        if fmt == "atif":
            return Answer(200, b"", pieces=_atif_pieces(session_id, page, sink.decode))
        if fmt == "nemo-gym":
            return await _nemo_gym(session_id, page)
        length = await _reading(_json_length, session_id, page)
        return Answer(200, b"", pieces=_json_pieces(session_id, page), length=length)
    except Exception as exc:  # the store's failure is the operator's to see in the log, never the client's
        return _unavailable(exc, method)


async def _reading(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in the reads' thread, the event loop free meanwhile: the encoding steps, never the store's
    calls (`in_thread`: a store that hangs never holds the reads' thread)."""
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


def _head_of(text: str) -> dict[str, Any]:
    """A stored turn's keys before its ids (`index`, `model`, `agent_id`, ...: `Turn.to_json`'s order), read without
    decoding the ids (the first `,"prompt_token_ids":` is the key's: inside a string a quote is escaped); the whole
    turn where it is not there."""
    cut = text.find(',"prompt_token_ids":')
    head: dict[str, Any] = json.loads(text[:cut] + "}" if cut > 0 else text)
    return head


def _atif_plan(page: Page) -> tuple[int, list[tuple[str | None, list[int], str | None]], dict[str, str]]:
    """The page's first index, its threads (`atif.threads`: each its agent, its turns' places, the first model they
    name; the root thread first), and how the session nests in its run (`atif.nesting`)."""
    heads = [_head_of(text) for text in page.turns]
    root, others = atif.threads(heads)
    threads = [(heads[0].get("agent_id"), root), *others.items()]
    plan = [
        (agent, places, next((heads[n]["model"] for n in places if heads[n].get("model")), None))
        for agent, places in threads
    ]
    return int(heads[0].get("index") or 0), plan, atif.nesting(heads[0])


def _atif_steps(turns: list[str], first_step: int, decode: atif.Decode | None) -> tuple[bytes, dict[str, int]]:
    """Some turns' steps (numbered from `first_step`), encoded, and their token counts."""
    made = [atif.step(first_step + n, json.loads(text), decode) for n, text in enumerate(turns)]
    totals: dict[str, int] = {}
    atif.add_totals(totals, made)
    return ",".join(atif.encode(m) for m in made).encode(), totals


async def _thread_pieces(
    session_id: str, doc_id: str, texts: list[str], model: str | None, decode: atif.Decode | None
) -> AsyncIterator[bytes]:
    """One trajectory of the document (its head, its steps a step of turns at a time, its final metrics), as
    `atif.trajectory` encodes it; the object left open."""
    yield atif.document_head(session_id, doc_id, model).encode()
    totals: dict[str, int] = {}
    for start, end in _groups(texts):
        piece, counts = await _reading(_atif_steps, texts[start:end], start + 1, decode)
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
        piece = b"," + piece if start else piece
        for i in range(0, len(piece), READ_PIECE_BYTES):
            yield piece[i : i + READ_PIECE_BYTES]
    yield atif.document_steps_end(len(texts), totals).encode()


async def _atif_pieces(session_id: str, page: Page, decode: atif.Decode | None) -> AsyncIterator[bytes]:
    """The ATIF document of the page's turns (`atif.trajectory`'s, byte for byte): the root thread, then each
    other agent's in `subagent_trajectories`, a step of turns at a time."""
    first, plan, nested = await _reading(_atif_plan, page)
    doc_id = atif.trajectory_id(session_id, first)
    for n, (agent, places, model) in enumerate(plan):
        if n == 1:
            yield b',"subagent_trajectories":['
        thread_id = doc_id if n == 0 else atif.subagent_id(doc_id, agent)
        async for piece in _thread_pieces(session_id, thread_id, [page.turns[p] for p in places], model, decode):
            yield piece
        if n:
            yield b"}" + (b"," if n < len(plan) - 1 else b"]")
    yield atif.document_extra(page.next_index, nested).encode()


def _nemo_gym_lines(rollout: nemo_gym.Rollout, turns: list[str]) -> bytes:
    made = (rollout.add(json.loads(text)) for text in turns)
    return "".join(nemo_gym.line(record) for record in made if record is not None).encode()


async def _nemo_gym(session_id: str, page: Page) -> Answer:
    """The page's turns as NeMo Gym's records, one JSON line each, made a step of turns at a time in the reads'
    thread before the answer starts (its headers count the turns left out); a 422 naming `logprobs` (or
    `prompt_token_ids`) where no turn makes a record."""
    rollout = nemo_gym.Rollout(session_id, first_page=_head_of(page.turns[0]).get("index") == 0)
    pieces = [await _reading(_nemo_gym_lines, rollout, page.turns[start:end]) for start, end in _groups(page.turns)]
    skipped = rollout.skipped
    if not any(pieces):
        param = "logprobs" if nemo_gym.NO_LOGPROBS in skipped.reasons else "prompt_token_ids"
        return _refusal(
            f"session {session_id} has no turn that makes a NeMo Gym record ({skipped.describe()}): a record needs "
            "the prompt and generated ids and one logprob per generated id (docs/capture.md)",
            param,
            422,
        )
    headers = [("x-nvext-skipped-turns", str(skipped.total))]
    if skipped.total:
        headers.append(("x-nvext-skipped-reasons", ",".join(f"{r}={n}" for r, n in sorted(skipped.reasons.items()))))
    if page.next_index is not None:
        headers.append(("x-nvext-next-index", str(page.next_index)))

    async def sent() -> AsyncIterator[bytes]:
        for piece in pieces:
            for i in range(0, len(piece), READ_PIECE_BYTES):
                yield piece[i : i + READ_PIECE_BYTES]

    return Answer(200, b"", pieces=sent(), length=sum(map(len, pieces)), content_type=NDJSON, headers=tuple(headers))


_running = 0  # store calls in their threads now (`in_thread`)
_ALL_RUNNING = "the capture store's calls are all still running"
_running_lock = threading.Lock()


async def in_thread(fn: Callable[..., T], *args: Any, timeout: float | None, limited: bool = True) -> T:
    """`fn(*args)` in a daemon thread of its own, awaited up to `timeout` (None: no bound; TimeoutError past it, the
    thread left to end or hang). Not the event loop's executor: a thread of it that hangs on the store (a frozen
    disk) would stall vLLM's own work queued there and hold the process's exit; a daemon thread holds neither.
    RuntimeError when STORE_THREADS calls are still running (hung): no thread is started for more (`limited`
    False: the shutdown's one call, which those never hold back)."""
    global _running
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

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
                raise RuntimeError(_ALL_RUNNING)
            _running += 1
    threading.Thread(target=run, name="vllm-nvext-capture-call", daemon=True).start()
    return await asyncio.wait_for(done, timeout)

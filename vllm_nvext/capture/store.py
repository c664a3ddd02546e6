"""The capture sink: the request path hands it turns, a writer thread puts them in the store.

`submit` never blocks and never raises: the turn goes into a bounded queue, or is dropped and
counted when the queue is full. The writer thread takes what is queued in small batches and
writes each batch in one transaction (SQLite) or one round of transactions (Redis); a full or
broken store drops the batch and counts it. Reads and deletes run in the caller's thread (the
read API calls them from a worker thread, never on the event loop). docs/capture.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from typing import Any, Protocol

from ..config import (
    DEFAULT_CAPTURE_MAX_BYTES,
    DEFAULT_CAPTURE_QUEUE_BYTES,
    DEFAULT_CAPTURE_RETENTION_S,
    ConfigError,
    capture_password,
)
from .base import Backend, Page, PartlyWritten, StoreFull
from .record import Decode, Turn, valid_session_id

logger = logging.getLogger("vllm_nvext.capture")

QUEUE_SIZE = 4096  # turns waiting for the writer; past this a submit drops its turn (and past the queue's bytes)
ITEM_BYTES = 36  # what one queued id or logprob holds: a Python int or float (24-28 bytes) and its list slot (8)
TURN_BYTES = 2048  # what a queued turn holds beside its ids and logprobs
BATCH = 64  # turns written in one transaction at most
PRUNE_EVERY_S = 60.0  # how often the writer removes sessions past their retention
READ_MAX_BYTES = 64 * 1024 * 1024  # one page of the read API (at least one turn, however large)
CLOSE_WAIT_S = 10.0  # how long `close` (at shutdown) and a DELETE wait for the writer to reach what was queued

# Why a turn was dropped (the `reason` label of vllm_nvext:capture_turns_dropped_total); INVALID_TURN: a turn no
# store can hold (`Turn.problem`), refused alone before its batch is written; SHUTDOWN: queued when the server shut
# down and not written in CLOSE_WAIT_S (a store that hangs); NOT_ON_THIS_MOUNT: a /v1/messages request where its ids
# cannot be read (the `--middleware` mount alone, `vllm-nvext proxy`: they exist only inside vLLM's handler).
QUEUE_FULL, STORE_FULL, STORE_ERROR, INVALID_TURN = "queue_full", "store_full", "store_error", "invalid_turn"
SHUTDOWN, NOT_ON_THIS_MOUNT = "shutdown", "not_on_this_mount"


class Counts(Protocol):
    """Where the sink reports (metrics.CAPTURE on the server)."""

    def recorded(self, n: int) -> None: ...

    def dropped(self, reason: str, n: int) -> None: ...

    def store_bytes(self, n: int) -> None: ...


class Tally:
    """The sink's own counts, kept whatever else it reports to (tests and `vllm-nvext sessions` read them)."""

    __slots__ = ("recorded_turns", "dropped_turns", "bytes", "_lock")

    def __init__(self) -> None:
        self.recorded_turns = 0
        self.dropped_turns: dict[str, int] = {}
        self.bytes = 0
        self._lock = threading.Lock()

    def recorded(self, n: int) -> None:
        with self._lock:
            self.recorded_turns += n

    def dropped(self, reason: str, n: int) -> None:
        with self._lock:
            self.dropped_turns[reason] = self.dropped_turns.get(reason, 0) + n

    def store_bytes(self, n: int) -> None:
        self.bytes = n


class Sink:
    """The request path's door to the store (`submit`), and the read API's (`read`, `delete`)."""

    def __init__(
        self,
        backend: Backend,
        counts: Counts | None = None,
        queue_size: int = QUEUE_SIZE,
        queue_bytes: int = DEFAULT_CAPTURE_QUEUE_BYTES,
    ) -> None:
        self.backend = backend
        self.decode: Decode | None = None  # the server's tokenizer, once the mount found it (a break's texts)
        self.tokenizer_sought = False
        self.tally = Tally()
        self._reports: tuple[Counts, ...] = (self.tally,) if counts is None else (self.tally, counts)
        self._queue: queue.Queue[Turn | None] = queue.Queue(maxsize=queue_size)
        self._queued = 0  # turns queued so far, and of them the writer has handled (written or dropped)
        self._handled = 0
        self._queue_bytes = queue_bytes  # the bound on what the queued turns hold (`queued_bytes`)
        self._held_bytes = 0
        self._queued_lock = threading.Lock()
        self._closed = False
        self._abandoned = False  # `close` gave up on the writer: what it handles after is no longer counted
        self._told_mount = False  # the log said once that a route is not captured on this mount
        self._writer = threading.Thread(target=self._run, name="vllm-nvext-capture", daemon=True)
        self._writer.start()

    def submit(self, turn: Turn) -> None:
        """Queue `turn` for the writer; never blocks, never raises (a full queue drops and counts it). A turn whose
        session is no valid session id (a response id that is not one, where no key named the session) is not
        recorded: it would be a store key the read API can never be asked for (docs/capture.md)."""
        if not isinstance(turn.session_id, str) or not valid_session_id(turn.session_id):
            return
        size = queued_bytes(turn)
        try:
            with self._queued_lock:  # the count in the queue's order: `flush` waits for what was queued before
                if self._closed or self._held_bytes + size > self._queue_bytes:
                    raise queue.Full  # a queue of huge turns is full in bytes before it is in turns
                self._queue.put_nowait(turn)
                self._queued += 1
                self._held_bytes += size
        except queue.Full:
            self._count_drop(QUEUE_FULL, 1)

    @property
    def closed(self) -> bool:
        """`close` was called: what is submitted since is dropped."""
        return self._closed

    def not_on_this_mount(self, route: str) -> None:
        """A request of `route` this mount cannot read the ids of: counted as dropped, and said once in the log."""
        self._count_drop(NOT_ON_THIS_MOUNT, 1)
        if not self._told_mount:
            self._told_mount = True
            logger.warning(
                "vllm-nvext capture: %s is not captured on this mount: its ids exist only inside vLLM's handler. "
                "Mount the plugin (VLLM_PLUGINS=nvext) in the vLLM server, capturing into the same store "
                "(docs/capture.md, Mounts); counted as vllm_nvext:capture_turns_dropped_total{reason=\"%s\"}",
                route, NOT_ON_THIS_MOUNT,
            )  # fmt: skip

    def read(self, session_id: str) -> list[dict[str, Any]] | None:
        """Every turn of the session (None: no such session). Blocking: call it off the event loop."""
        turns: list[dict[str, Any]] = []
        start: int | None = 0
        while start is not None:
            page = self.backend.read(session_id, start, READ_MAX_BYTES)
            if page is None:
                return turns or None
            turns.extend(json.loads(t) for t in page.turns)
            start = page.next_index
        return turns

    def read_page(self, session_id: str, start: int = 0, max_bytes: int = READ_MAX_BYTES) -> Page | None:
        """Turns of the session from `start`, about `max_bytes` of them. Blocking: call it off the event loop."""
        return self.backend.read(session_id, start, max_bytes)

    def delete(self, session_id: str) -> bool:
        """Remove the session; False when there was none. Blocking: call it off the event loop.

        The turns queued before it are written first, so a turn that ended before the DELETE never brings the
        session back; TimeoutError when the writer has not reached them in CLOSE_WAIT_S (the store is stuck)."""
        if not self.flush():
            raise TimeoutError("the capture writer is behind")
        return self.backend.delete(session_id)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every turn queued so far is written (or dropped), up to `timeout` (CLOSE_WAIT_S); False on
        timeout. Turns queued while it waits are not waited for."""
        target = self._queued
        deadline = time.monotonic() + (CLOSE_WAIT_S if timeout is None else timeout)
        while self._handled < target and time.monotonic() < deadline:
            time.sleep(0.005)
        return self._handled >= target

    def close(self, timeout: float | None = None) -> int:
        """Write what is queued, waiting up to `timeout` (CLOSE_WAIT_S) in all, then close the store; how many queued
        turns were not written in that time (counted dropped, reason SHUTDOWN, and logged): a store that hangs never
        holds the server's exit longer (the writer is a daemon thread). The server's lifespan shutdown calls it
        (middleware.capture.closing_capture): uvicorn re-raises SIGTERM once it has shut down, and no `atexit` runs
        then."""
        with self._queued_lock:
            if self._closed:
                return 0
            self._closed = True
            waiting = self._queued - self._handled
        wait = CLOSE_WAIT_S if timeout is None else timeout
        if waiting:
            logger.warning("vllm-nvext capture: writing the %d queued turns before exit (at most %g s)", waiting, wait)
        deadline = time.monotonic() + wait
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=wait)
        self._writer.join(max(0.0, deadline - time.monotonic()))
        if self._writer.is_alive():
            with self._queued_lock:
                self._abandoned = True
                lost = self._queued - self._handled
            if lost:
                logger.warning(
                    "vllm-nvext capture: %d queued turns not written, the store took none in %g s", lost, wait
                )
                self._count_drop(SHUTDOWN, lost)
            return lost
        try:
            self.backend.close()
        except Exception:
            logger.warning("vllm-nvext capture: the store did not close cleanly")
        return 0

    # --- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        next_prune = 0.0
        while True:
            try:  # woken at least every PRUNE_EVERY_S: an idle server's store still honours the retention
                first = self._queue.get(timeout=PRUNE_EVERY_S)
            except queue.Empty:
                now = time.time()
                if now >= next_prune:
                    next_prune = now + PRUNE_EVERY_S
                    self._prune(now)
                continue
            batch: list[Turn] = [] if first is None else [first]
            stop = first is None
            while not stop and len(batch) < BATCH:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    batch.append(more)
            now = time.time()
            if batch and now >= next_prune:
                next_prune = now + PRUNE_EVERY_S
                self._prune(now)
            if batch:
                self._write(batch, now)
            for _ in range(len(batch) + (1 if stop else 0)):
                self._queue.task_done()
            if stop:
                return

    def _storable(self, batch: list[Turn]) -> list[Turn]:
        """The batch less the turns no store can hold, each counted and logged by its field, never written: one
        would fail its batch's transaction, or every later turn of its session that reads it back."""
        kept: list[Turn] = []
        for turn in batch:
            problem = turn.problem()
            if problem is None:
                kept.append(turn)
                continue
            logger.warning("vllm-nvext capture: a turn dropped, no store can hold it (%s)", problem)
            self._count_drop(INVALID_TURN, 1)
        return kept

    def _write(self, batch: list[Turn], now: float) -> None:
        """Write the batch and count how it went, unless `close` gave up on this writer meanwhile (it counted them)."""
        storable = self._storable(batch)
        written, dropped, failure = 0, None, None
        try:
            if storable:
                self.backend.write(storable, now)
            written = len(storable)
        except StoreFull:
            dropped = STORE_FULL
        except Exception as exc:  # a broken store never reaches a request: drop, count, log the kind
            cause: BaseException = exc
            if isinstance(exc, PartlyWritten):
                written, cause = exc.written, exc.__cause__ or exc
            dropped, failure = STORE_ERROR, type(cause).__name__
        lost = len(storable) - written
        with self._queued_lock:  # counted before `flush` sees the batch handled, never once `close` counted it lost
            if self._abandoned:
                return
            if dropped is not None:
                self._count_drop(dropped, lost)
            if written:
                for report in self._reports:
                    report.recorded(written)
            self._handled += len(batch)
            self._held_bytes -= sum(queued_bytes(turn) for turn in batch)
        if failure is not None:
            logger.warning("vllm-nvext capture: %d turns dropped, the store failed (%s)", lost, failure)
        self._report_bytes()

    def _prune(self, now: float) -> None:
        try:
            self.backend.prune(now)
        except Exception as exc:
            logger.warning("vllm-nvext capture: pruning old sessions failed (%s)", type(exc).__name__)

    def _report_bytes(self) -> None:
        try:
            used = self.backend.used_bytes()
        except Exception:
            return
        for report in self._reports:
            report.store_bytes(used)

    def _count_drop(self, reason: str, n: int) -> None:
        for report in self._reports:
            with contextlib.suppress(Exception):  # a counter never fails the request that submitted
                report.dropped(reason, n)


def queued_bytes(turn: Turn) -> int:
    """About what `turn` holds while it waits for the writer: its ids and logprobs, the other choices' too."""
    items = len(turn.prompt_token_ids or ()) + len(turn.completion_token_ids or ()) + len(turn.logprobs or ())
    for choice in turn.choices or ():
        for key in ("completion_token_ids", "logprobs"):
            value = choice.get(key) if isinstance(choice, dict) else None
            items += len(value) if isinstance(value, list) else 0
    return TURN_BYTES + ITEM_BYTES * items


def open_backend(
    url: str,
    *,
    max_bytes: int = DEFAULT_CAPTURE_MAX_BYTES,
    retention_s: int = DEFAULT_CAPTURE_RETENTION_S,
    read_only: bool = False,
) -> Backend:
    """The store a URL names: `sqlite:////abs/path.sqlite3` or `redis://[:password@]host:port/db`; `read_only`: one
    that exists, opened to read alone (an export: a SQLite file is never created nor written).

    ConfigError (never echoing the URL, which may carry a password) for anything else."""
    lowered = url.lower()
    if lowered.startswith("sqlite://"):
        from .sqlite_store import SQLiteBackend, SQLiteReader, sqlite_path

        if read_only:
            return SQLiteReader(sqlite_path(url))
        return SQLiteBackend(sqlite_path(url), max_bytes=max_bytes, retention_s=retention_s)
    if lowered.startswith(("redis://", "rediss://")):
        from .redis_store import RedisBackend

        return RedisBackend(url, max_bytes=max_bytes, retention_s=retention_s, password=capture_password())
    raise ConfigError("capture: expected a store URL starting with sqlite:// or redis://")


def open_sink(
    url: str,
    *,
    max_bytes: int = DEFAULT_CAPTURE_MAX_BYTES,
    retention_s: int = DEFAULT_CAPTURE_RETENTION_S,
    counts: Counts | None = None,
    queue_bytes: int = DEFAULT_CAPTURE_QUEUE_BYTES,
) -> Sink:
    """A Sink on the store `url` names (see `open_backend`); run at start-up, never on a request."""
    return Sink(open_backend(url, max_bytes=max_bytes, retention_s=retention_s), counts, queue_bytes=queue_bytes)

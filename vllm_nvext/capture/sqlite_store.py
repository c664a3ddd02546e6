"""The embedded capture store: one SQLite file in WAL mode, written by the sink's writer thread.

Each batch of turns is one transaction (`BEGIN IMMEDIATE`), so a killed server loses at most the
turns still queued; several processes (vLLM's API servers, proxy workers) may share the file. The
file is created 0600 (it holds prompts); the session id is a key in it, never a file name.
docs/capture.md.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from urllib.parse import quote

from ..config import ConfigError
from .base import Page, PartlyWritten, StoreFull, readable
from .record import SIDE_KINDS, Turn

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS sessions (session_id TEXT PRIMARY KEY, turns INTEGER NOT NULL, last REAL NOT NULL)",
    "CREATE INDEX IF NOT EXISTS sessions_last ON sessions (last)",
    "CREATE TABLE IF NOT EXISTS turns (session_id TEXT NOT NULL, idx INTEGER NOT NULL, body TEXT NOT NULL,"
    " PRIMARY KEY (session_id, idx)) WITHOUT ROWID",
)
BUSY_TIMEOUT_MS = 5000
# How long a batch waits for another process's write lock (a second server's long transaction), a try of
# BUSY_TIMEOUT_MS at a time: past it the batch fails (dropped, `store_error`); a shutdown waits store.CLOSE_WAIT_S.
BUSY_WAIT_S = 60.0
_SQLITE_BUSY = 5  # SQLite's primary result code (an extended one in its low byte: SQLITE_BUSY_RECOVERY, ...)
PRUNE_CHUNK = 500  # sessions removed per transaction
_LAST_TURNS = 256  # sessions whose last turn the writer keeps (extends_previous without a re-read)
_LAST_IDS = 16 * 1024 * 1024  # the ids those turns hold in all (4 bytes each: 64 MiB); past it the least recent go


def sqlite_path(url: str) -> str:
    """The file of `sqlite:////abs/path.sqlite3` (an absolute path: four slashes)."""
    path = url[len("sqlite:///") :] if url.lower().startswith("sqlite:///") else ""
    if not path.startswith("/") or path.startswith("//") or "?" in path or "\x00" in path:
        raise ConfigError("capture: a SQLite store is sqlite:////absolute/path/to/file.sqlite3")
    if not os.path.isdir(os.path.dirname(path)):
        raise ConfigError("capture: the SQLite store's directory does not exist")
    return path


class SQLiteBackend:
    """Turns as JSON text keyed by (session_id, index); a sessions table for indexes, retention and export."""

    def __init__(self, path: str, *, max_bytes: int, retention_s: int) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.retention_s = retention_s
        self._conn: sqlite3.Connection | None = None  # the writer thread's
        self._inode: int | None = None
        # Each recent session's last turn: (its index, its row's `last` when this writer wrote it, its prompt +
        # completion ids, None: no prompt ids reported). The `last` marker tells that no other process deleted or
        # rewrote the session since (docs/capture.md, the store): where it differs, the turn is read back.
        self._last: OrderedDict[str, tuple[int, float, array[int] | None]] = OrderedDict()
        self._last_ids = 0
        self._lock = threading.Lock()
        try:  # create the file and schema now, and write to it: a bad path or a read-only file stops start-up
            conn = self._writer_conn()
            try:
                conn.execute("BEGIN IMMEDIATE")  # SQLite opens a file it may not write read-only: a write tells
                conn.execute("INSERT INTO sessions (session_id, turns, last) VALUES ('', 0, 0)")
                conn.execute("ROLLBACK")
            finally:
                conn.close()
        except (OSError, sqlite3.Error):
            raise ConfigError("capture: the SQLite store cannot be opened for writing") from None
        self._conn = None

    def _connect(self) -> sqlite3.Connection:
        # Create the file 0600 before SQLite does (its WAL and shm files take the database file's mode); only a
        # file this call created is opened and closed here. Closing a descriptor of a file that a connection of
        # this process holds open drops every POSIX lock the process has on it, so another process would take
        # this one's live WAL for a stale one and delete it (sqlite.org/howtocorrupt.html, 2.2; docs/capture.md).
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            os.close(fd)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=BUSY_TIMEOUT_MS / 1e3)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _writer_conn(self) -> sqlite3.Connection:
        """The writer's connection, reopened when the file was removed or replaced since it was opened."""
        try:
            inode: int | None = os.stat(self.path).st_ino
        except OSError:
            inode = None
        if self._conn is not None and inode == self._inode:
            return self._conn
        if self._conn is not None:
            self._conn.close()
            self._conn = None
            self._forget()
        conn = self._connect()
        for statement in _SCHEMA:
            conn.execute(statement)
        self._conn, self._inode = conn, os.stat(self.path).st_ino
        return conn

    def write(self, turns: Sequence[Turn], now: float) -> None:
        with self._lock:
            try:
                self._write(turns, now)
            except BaseException:
                if self._conn is not None:  # reopen on the next batch: the file may have been replaced
                    self._conn.close()
                    self._conn = None
                    self._forget()
                raise

    def _write(self, turns: Sequence[Turn], now: float) -> None:
        conn = self._writer_conn()
        if self._used(conn) >= self.max_bytes:
            raise StoreFull
        failed: Exception | None = None
        written = 0
        _begin(conn)
        try:
            for turn in turns:  # each turn its own savepoint: one that fails is rolled back alone, never its batch
                conn.execute("SAVEPOINT turn")
                try:
                    placed = self._place(conn, turn, now)
                except Exception as exc:
                    conn.execute("ROLLBACK TO turn")
                    conn.execute("RELEASE turn")
                    self._forget(turn.session_id)
                    failed = exc
                    continue
                conn.execute("RELEASE turn")
                self._remember(placed, now)
                written += 1
            conn.execute("COMMIT")
        except BaseException:
            self._forget()
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        if failed is not None:
            raise PartlyWritten(written) from failed  # those written are recorded, the others dropped

    def _place(self, conn: sqlite3.Connection, turn: Turn, now: float) -> Turn:
        """Write `turn` as its session's next, in the open transaction; the turn as placed."""
        sid = turn.session_id
        row = conn.execute("SELECT turns, last FROM sessions WHERE session_id = ?", (sid,)).fetchone()
        index, marker = (0, None) if row is None else (int(row[0]), float(row[1]))
        placed = turn.placed(index, self._previous(conn, sid, index, marker))
        body = json.dumps(placed.to_json(), separators=(",", ":"), allow_nan=False)
        conn.execute("INSERT INTO turns (session_id, idx, body) VALUES (?, ?, ?)", (sid, index, body))
        conn.execute(
            "INSERT INTO sessions (session_id, turns, last) VALUES (?, 1, ?) ON CONFLICT (session_id)"
            " DO UPDATE SET turns = turns + 1, last = excluded.last",
            (sid, now),
        )
        return placed

    def _previous(self, conn: sqlite3.Connection, sid: str, index: int, marker: float | None) -> Turn | None:
        if index == 0:
            return None
        cached = self._last.get(sid)
        if cached is not None and cached[0] == index - 1 and cached[1] == marker:  # the row is as this writer left it
            ids = None if cached[2] is None else cached[2].tolist()  # what `Turn.placed` reads of it
            return Turn(sid, "", "", 0.0, "", prompt_token_ids=ids, index=index - 1)
        row = conn.execute("SELECT body FROM turns WHERE session_id = ? AND idx = ?", (sid, index - 1)).fetchone()
        return None if row is None else readable(row[0])

    def _remember(self, turn: Turn, marker: float) -> None:
        """Keep `turn`'s ids compactly for the session's next turn, within _LAST_TURNS sessions and _LAST_IDS ids;
        `marker`: the `last` its session's row holds once it is written."""
        self._forget(turn.session_id)
        ids: array[int] | None = None
        if turn.prompt_token_ids is not None and turn.request_kind not in SIDE_KINDS:  # a side turn: a new segment
            try:
                ids = array("i", turn.prompt_token_ids)
                ids.extend(turn.completion_token_ids or ())
            except (OverflowError, TypeError):
                return  # not kept: the next turn reads it back
            if len(ids) > _LAST_IDS:
                return
        assert turn.index is not None
        self._last[turn.session_id] = (turn.index, marker, ids)
        self._last_ids += len(ids or ())
        while len(self._last) > _LAST_TURNS or self._last_ids > _LAST_IDS:
            self._forget(next(iter(self._last)))

    def _forget(self, session_id: str | None = None) -> None:
        """Drop one session's kept turn (None: every one)."""
        if session_id is None:
            self._last.clear()
            self._last_ids = 0
            return
        kept = self._last.pop(session_id, None)
        if kept is not None:
            self._last_ids -= len(kept[2] or ())

    @staticmethod
    def _used(conn: sqlite3.Connection) -> int:
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
        free = conn.execute("PRAGMA freelist_count").fetchone()[0]
        size = conn.execute("PRAGMA page_size").fetchone()[0]
        return int((pages - free) * size)

    def _reader(self) -> sqlite3.Connection:
        if not os.path.exists(self.path):
            raise FileNotFoundError("the capture store is gone")
        conn = sqlite3.connect(self.path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1e3)
        conn.execute("PRAGMA query_only=1")
        return conn

    def read(self, session_id: str, start: int, max_bytes: int) -> Page | None:
        conn = self._reader()
        try:
            conn.execute("BEGIN")  # one snapshot for the session's row and its turns
            row = conn.execute("SELECT turns FROM sessions WHERE session_id = ?", (session_id,)).fetchone()
            if row is None:
                return None
            rows = conn.execute(
                "SELECT idx, body FROM turns WHERE session_id = ? AND idx >= ? ORDER BY idx", (session_id, start)
            )
            turns: list[str] = []
            size = 0
            for idx, body in rows:
                if turns and size + len(body) > max_bytes:
                    return Page(turns, int(idx))
                turns.append(body)
                size += len(body)
            return Page(turns, None)
        finally:
            conn.close()

    def delete(self, session_id: str) -> bool:
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM turns WHERE session_id = ?", (session_id,))
            found = conn.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,)).rowcount > 0
            conn.execute("COMMIT")
        finally:
            conn.close()
        with self._lock:
            self._forget(session_id)
        return found

    def sessions(self, since: float | None) -> Iterator[str]:
        conn = self._reader()
        try:
            rows = conn.execute(
                "SELECT session_id FROM sessions WHERE last >= ? ORDER BY last, session_id",
                (float("-inf") if since is None else since,),
            ).fetchall()
        finally:
            conn.close()
        return iter([r[0] for r in rows])

    def prune(self, now: float) -> int:
        """Remove the sessions whose last turn is older than the retention; how many were removed."""
        with self._lock:
            conn = self._writer_conn()
            removed = 0
            while True:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    old = conn.execute(
                        "SELECT session_id FROM sessions WHERE last < ? LIMIT ?", (now - self.retention_s, PRUNE_CHUNK)
                    ).fetchall()
                    for (sid,) in old:
                        conn.execute("DELETE FROM turns WHERE session_id = ?", (sid,))
                        conn.execute("DELETE FROM sessions WHERE session_id = ?", (sid,))
                        self._forget(sid)
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
                removed += len(old)
                if len(old) < PRUNE_CHUNK:
                    return removed

    def used_bytes(self) -> int:
        with self._lock:
            return self._used(self._writer_conn())

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def _begin(conn: sqlite3.Connection) -> None:
    """`BEGIN IMMEDIATE`, waiting up to BUSY_WAIT_S for the write lock another process holds (nothing is written
    before it: a try that meets the lock is tried again, never the batch dropped for a store that is only busy)."""
    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except sqlite3.OperationalError as exc:
            if getattr(exc, "sqlite_errorcode", 0) & 0xFF != _SQLITE_BUSY or time.monotonic() >= deadline:
                raise


class SQLiteReader(SQLiteBackend):
    """The store opened to read alone (`vllm-nvext sessions export`): never created, never written; a backup on a
    read-only disk (or in a folder its reader cannot write) is read as the live file is. docs/capture.md."""

    def __init__(self, path: str) -> None:  # nothing of the writer's state: this one never writes
        if not os.path.isfile(path):
            raise ConfigError("capture: there is no SQLite store at that path (an export never creates one)")
        self.path = path
        self._immutable = False
        try:
            self._reader().close()
        except sqlite3.Error:
            raise ConfigError("capture: the file is no SQLite capture store, or cannot be read") from None

    def _reader(self) -> sqlite3.Connection:
        mode = "immutable=1" if self._immutable else "mode=ro"
        conn = sqlite3.connect(f"file:{quote(self.path)}?{mode}", uri=True, isolation_level=None,
                               timeout=BUSY_TIMEOUT_MS / 1e3)  # fmt: skip
        try:
            conn.execute("SELECT 1 FROM sessions LIMIT 1").fetchall()
        except sqlite3.OperationalError:
            conn.close()
            if self._immutable or os.path.exists(self.path + "-wal"):
                raise
            # A WAL-mode file alone, its `-shm` not there to make: no writer is at it (one would have made its `-wal`).
            self._immutable = True
            return self._reader()
        return conn

    def write(self, turns: Sequence[Turn], now: float) -> None:
        raise PermissionError("the store is open to read alone")

    def delete(self, session_id: str) -> bool:
        raise PermissionError("the store is open to read alone")

    def prune(self, now: float) -> int:
        raise PermissionError("the store is open to read alone")

    def used_bytes(self) -> int:
        return os.stat(self.path).st_size

    def close(self) -> None:
        return None

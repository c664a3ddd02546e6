"""The capture store's writer under pressure (docs/capture.md, the store): two real processes on one SQLite file,
a turn no store can hold beside good ones, a server sent SIGTERM with turns still queued, a queue of huge turns
and a store that hangs. Real parts throughout: SQLite files, a real redis-server, real OS processes."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.support.capture import make_turn
from vllm_nvext.capture.store import Sink, open_sink

ROOT = Path(__file__).resolve().parents[2]


def _python(script: str, *args: str) -> subprocess.Popen[str]:
    """A real OS process running `script` from the checkout's root, its stdin and stdout piped to the test."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


# --- two processes on one SQLite file -------------------------------------------------------------------------

# A server's store: one turn written, a DELETE of a session it does not hold (the read API's 404), then, once the
# test says so, 50 more turns of the same session, each flushed; then it waits to be killed.
_SERVER = (
    "import sys\n"
    "from tests.support.capture import make_turn\n"
    "from vllm_nvext.capture.store import open_sink\n"
    "s = open_sink(sys.argv[1])\n"
    "s.submit(make_turn('live', [0])); assert s.flush()\n"
    "assert s.delete('no-such-session') is False\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "for n in range(1, 51):\n"
    "    s.submit(make_turn('live', [n])); assert s.flush()\n"
    "print('written', len(s.read('live') or []), s.tally.recorded_turns, flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_a_server_and_sessions_export_on_one_sqlite_file_lose_no_turn(tmp_path):
    """`vllm-nvext sessions export --store` run beside a server on its file (after one DELETE on the server) leaves
    the server's -wal and -shm in place, and every turn the server writes after it is in the file, also once the
    server is killed: the store never drops the process's locks on the file by opening and closing it."""
    path = tmp_path / "capture.sqlite3"
    url = f"sqlite:///{path}"
    server = _python(_SERVER, url)
    assert server.stdin is not None and server.stdout is not None
    try:
        assert server.stdout.readline().strip() == "ready"
        export = subprocess.run(
            [sys.executable, "-m", "vllm_nvext.tools.cli", "sessions", "export", "--store", url],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert export.returncode == 0, export.stderr
        assert [json.loads(line)["session_id"] for line in export.stdout.splitlines()] == ["live"]
        assert Path(f"{path}-wal").exists() and Path(f"{path}-shm").exists(), "the server's WAL and shm survive"
        server.stdin.write("go\n")
        server.stdin.flush()
        assert server.stdout.readline().split() == ["written", "51", "51"], "the server reads back all it wrote"
    finally:
        server.send_signal(signal.SIGKILL)
        server.communicate()
    check = sqlite3.connect(path)
    try:
        assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    finally:
        check.close()
    sink = open_sink(url)
    turns = sink.read("live") or []
    sink.close()
    assert [t["prompt_token_ids"] for t in turns] == [[n] for n in range(51)], "no turn lost with the killed server"


# --- a turn no store can hold ---------------------------------------------------------------------------------


def _hold_writer(sink: Sink) -> threading.Event:
    """The store's writer thread held before each write until the returned gate is set (a writer behind)."""
    gate, write = threading.Event(), sink.backend.write

    def held_write(turns: Any, now: float) -> None:
        gate.wait(10)
        write(turns, now)

    sink.backend.write = held_write  # type: ignore[method-assign]
    return gate


def test_a_turn_no_store_can_hold_is_refused_alone_counted_and_logged(store_url, caplog):
    """An upstream that is not vLLM (behind the proxy) answers float ids or no `id`: the float turn is refused before
    it is written (counted `invalid_turn`, the log names the field), the turn without an id is recorded with
    `request_id: null`; the session's later turns and the 200 other sessions' turns written with it are all kept."""
    sink = open_sink(store_url)
    gate = _hold_writer(sink)  # every turn queued first: the bad ones share their batches with the others
    sink.submit(make_turn("poisoned", [1, 2], [3]))
    sink.submit(make_turn("poisoned", [1.0, 2.0], [3]))  # type: ignore[list-item]
    sink.submit(make_turn("poisoned", [1, 2, 3, 4], [5]))
    sink.submit(make_turn("no-id", [1], [2], request_id=None))
    sink.submit(make_turn("no-id", [1, 2, 3], [4], request_id=None))
    for n in range(200):
        sink.submit(make_turn(f"other-{n}", [n]))
    gate.set()
    assert sink.flush(60)
    try:
        for n in range(200):
            assert [t["prompt_token_ids"] for t in sink.read(f"other-{n}") or []] == [[n]], f"other-{n}"
        poisoned = sink.read("poisoned") or []
        assert [t["prompt_token_ids"] for t in poisoned] == [[1, 2], [1, 2, 3, 4]]
        assert [t["extends_previous"] for t in poisoned] == [None, True]
        no_id = sink.read("no-id") or []
        assert [(t["request_id"], t["extends_previous"]) for t in no_id] == [(None, None), (None, True)]
        assert sink.tally.recorded_turns == 204 and sink.tally.dropped_turns == {"invalid_turn": 1}
        assert "prompt_token_ids: expected a list of integers or null" in caplog.text
    finally:
        sink.close()


def test_a_stored_turn_that_does_not_read_back_never_blocks_its_session(store_url):
    """A store written before turns were checked holds one that does not read back (float ids): its session's next
    turn is placed after it (`extends_previous: null`, its ids unknown) and the turns written with it are kept."""
    sink = open_sink(store_url)
    sink.backend.write([make_turn("legacy", [1.0], [2])], time.time())  # type: ignore[list-item]
    gate = _hold_writer(sink)
    sink.submit(make_turn("legacy", [1, 2], [3]))
    for n in range(100):
        sink.submit(make_turn(f"other-{n}", [n]))
    gate.set()
    assert sink.flush(60)
    try:
        legacy = sink.read("legacy") or []
        assert [(t["index"], t["prompt_token_ids"], t["extends_previous"]) for t in legacy] == [
            (0, [1.0], None),
            (1, [1, 2], None),
        ]
        assert all(sink.read(f"other-{n}") for n in range(100))
        assert sink.tally.recorded_turns == 101 and sink.tally.dropped_turns == {}
    finally:
        sink.close()


def test_a_turn_sqlite_cannot_insert_is_rolled_back_alone(tmp_path):
    """A session's row removed by hand with its turns left behind: its next turn cannot take its index and is
    dropped (`store_error`); the 100 turns of its batch are written."""
    path = tmp_path / "capture.sqlite3"
    sink = open_sink(f"sqlite:///{path}")
    sink.submit(make_turn("orphan", [1]))
    assert sink.flush()
    db = sqlite3.connect(path)
    db.execute("DELETE FROM sessions WHERE session_id = 'orphan'")
    db.commit()
    db.close()
    gate = _hold_writer(sink)
    sink.submit(make_turn("orphan", [1, 2]))
    for n in range(100):
        sink.submit(make_turn(f"other-{n}", [n]))
    gate.set()
    assert sink.flush(60)
    try:
        assert all(sink.read(f"other-{n}") for n in range(100))
        assert sink.tally.recorded_turns == 101 and sink.tally.dropped_turns == {"store_error": 1}
    finally:
        sink.close()

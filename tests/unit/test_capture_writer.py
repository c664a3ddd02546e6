"""The capture store's writer under pressure (docs/capture.md, the store): two real processes on one SQLite file,
a turn no store can hold beside good ones, a server sent SIGTERM with turns still queued, a queue of huge turns
and a store that hangs. Real parts throughout: SQLite files, a real redis-server, real OS processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.capture import hold_writer, make_turn
from tests.support.redis_server import free_port
from tests.unit.asgi import Upstream, call
from vllm_nvext import NvextMiddleware
from vllm_nvext.capture import api
from vllm_nvext.capture.record import Turn
from vllm_nvext.capture.store import open_sink

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-writer"
AUTH = {"Authorization": f"Bearer {KEY}"}


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


# Another process writing to the file: it holds SQLite's write lock until the test says so.
_LOCKER = (
    "import sqlite3, sys\n"
    "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
    "c.execute('BEGIN IMMEDIATE')\n"
    "print('locked', flush=True)\n"
    "sys.stdin.readline()\n"
    "c.execute('ROLLBACK')\n"
)


def test_a_store_another_process_holds_busy_past_its_busy_timeout_loses_no_turn(tmp_path, monkeypatch):
    """Another process holds the file's write lock for several of the writer's busy timeouts (a long transaction
    of a second server; SIGTERM's shutdown with a busy store): the writer waits for the lock and writes every turn
    once it is free, never dropping the batch as a failed store (before: 1 of 40 turns lost on SIGTERM with the
    store busy ~5 s)."""
    from vllm_nvext.capture import sqlite_store

    monkeypatch.setattr(sqlite_store, "BUSY_TIMEOUT_MS", 50)  # the writer's connection is made with it
    path = tmp_path / "c.sqlite3"
    sink = open_sink(f"sqlite:///{path}")
    locker = _python(_LOCKER, str(path))
    try:
        assert locker.stdout is not None and locker.stdout.readline().strip() == "locked"
        for n in range(5):
            sink.submit(make_turn("busy", [n]))
        deadline = time.monotonic() + 30
        while sink._queue.qsize() and time.monotonic() < deadline:  # the writer has taken the batch
            time.sleep(0.01)
        time.sleep(0.5)  # ten busy timeouts on the lock
    finally:
        assert locker.stdin is not None
        locker.stdin.write("\n")
        locker.stdin.close()
        locker.wait(30)
        locker.stdout.close()
    try:
        assert sink.flush()
        assert sink.tally.dropped_turns == {}, sink.tally.dropped_turns
        assert [t.prompt_token_ids for t in map(Turn.from_json, sink.read("busy") or [])] == [[n] for n in range(5)]
    finally:
        sink.close()


def test_a_turn_no_store_can_hold_is_refused_alone_counted_and_logged(store_url, caplog):
    """An upstream that is not vLLM (behind the proxy) answers float ids, a NaN logprob, a time no float holds, or no
    `id`: the first three are refused before they are written (counted `invalid_turn`, the log names the field),
    the turn without an id is recorded with `request_id: null`; the session's later turns and the 200 other
    sessions' turns written with them are all kept."""
    sink = open_sink(store_url)
    gate = hold_writer(sink)  # every turn queued first: the bad ones share their batches with the others
    sink.submit(make_turn("poisoned", [1, 2], [3]))
    sink.submit(make_turn("poisoned", [1.0, 2.0], [3]))  # type: ignore[list-item]
    sink.submit(make_turn("poisoned", [1, 2, 3, 4], [5]))
    sink.submit(make_turn("no-id", [1], [2], request_id=None))
    sink.submit(make_turn("no-id", [1, 2, 3], [4], request_id=None))
    sink.submit(make_turn("nan", [1], [2], logprobs=[float("nan")]))
    sink.submit(make_turn("huge-time", [1], [2], time=10**400))
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
        assert sink.read("nan") is None and sink.read("huge-time") is None
        assert sink.tally.recorded_turns == 204 and sink.tally.dropped_turns == {"invalid_turn": 3}
        assert "prompt_token_ids: expected a list of integers or null" in caplog.text
        assert "logprobs: expected finite numbers or null" in caplog.text
    finally:
        sink.close()


def test_a_stored_turn_that_does_not_read_back_never_blocks_its_session(store_url):
    """A store written before turns were checked holds one that does not read back (float ids): its session's next
    turn is placed after it (`extends_previous: null`, its ids unknown) and the turns written with it are kept."""
    sink = open_sink(store_url)
    sink.backend.write([make_turn("legacy", [1.0], [2])], time.time())  # type: ignore[list-item]
    gate = hold_writer(sink)
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
    gate = hold_writer(sink)
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


# --- SIGTERM with turns queued ---------------------------------------------------------------------------------


class _Served:
    """A server process of this test (tests/support/capture_app.py or `vllm-nvext proxy`), its stderr piped."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", *(a.replace("PORT", str(self.port)) for a in args)]
        env = {**os.environ, "VLLM_API_KEY": KEY}
        self.proc = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env
        )
        deadline = time.monotonic() + 120
        while True:  # ready once its /health answers (the proxy's: the upstream's, through it)
            assert self.proc.poll() is None and time.monotonic() < deadline, self.stop()
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)

    def said(self, text: str) -> bool:
        """Whether the process writes a stderr line holding `text` before it ends (read up to that line)."""
        assert self.proc.stderr is not None
        return any(text in line for line in self.proc.stderr)

    def stop(self) -> str:
        """Its stderr from here on, once it has ended (SIGKILL if it still runs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        return self.proc.communicate()[1] or ""


def _chats(url: str, session: str, n: int) -> None:
    with httpx.Client(base_url=url, headers={**AUTH, "x-nvext-session-id": session}, timeout=60) as client:
        for _ in range(n):
            answer = client.post(
                "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            )
            assert answer.status_code == 200, answer.text


@pytest.mark.parametrize("mount", ["proxy", "middleware"])
def test_sigterm_writes_the_queued_turns_before_the_server_ends(mount, tmp_path):
    """40 turns queued behind a busy store when the server is sent SIGTERM: `vllm-nvext proxy` and the app vLLM's
    `--middleware` and plugin mount NvextMiddleware into (uvicorn re-raises the signal once shut down, so `atexit`
    never runs) write all 40 in their lifespan shutdown, and say so in the log."""
    path = tmp_path / "capture.sqlite3"
    url = f"sqlite:///{path}"
    served: list[_Served] = []
    try:
        if mount == "proxy":
            served.append(_Served("tests.support.capture_app", "PORT"))
            proxy = ["vllm_nvext.tools.cli", "proxy", "--upstream", served[0].url, "--host", "127.0.0.1"]
            served.append(_Served(*proxy, "--port", "PORT", "--api-key", KEY, "--capture", url))
        else:
            served.append(_Served("tests.support.capture_app", "PORT", "--capture", url))
        server = served[-1]
        busy = sqlite3.connect(path, isolation_level=None)
        busy.execute("BEGIN IMMEDIATE")  # the server's writer waits for the store (its busy timeout: 5 s)
        try:
            _chats(server.url, "sigterm", 40)
            server.proc.send_signal(signal.SIGTERM)
            assert server.said("writing the 40 queued turns before exit")
        finally:
            busy.execute("ROLLBACK")
            busy.close()
        server.proc.wait(60)
    finally:
        logs = [s.stop() for s in served]
    assert "not written" not in logs[-1] and "dropped" not in logs[-1], logs[-1]
    sink = open_sink(url)
    try:
        assert len(sink.read("sigterm") or []) == 40
    finally:
        sink.close()


def test_close_gives_up_on_a_store_that_hangs_and_counts_what_it_did_not_write(tmp_path, caplog):
    """The writer held (a frozen disk): `close` returns after its bound with the 3 queued turns counted dropped
    (`shutdown`) and logged, and the batch the writer settles after that is not counted again."""
    sink = open_sink(f"sqlite:///{tmp_path / 'c.sqlite3'}")
    gate = hold_writer(sink)
    for n in range(3):
        sink.submit(make_turn("hung", [n]))
    assert sink.close(0.2) == 3
    assert sink.tally.dropped_turns == {"shutdown": 3} and sink.tally.recorded_turns == 0
    assert "3 queued turns not written" in caplog.text
    gate.set()
    sink._writer.join(10)
    assert sink.tally.dropped_turns == {"shutdown": 3} and sink.tally.recorded_turns == 0, "counted once"


# --- a queue of huge turns, a store that hangs ----------------------------------------------------------------


async def test_the_queue_is_bounded_in_bytes_and_counts_what_it_drops(tmp_path, monkeypatch):
    """A frozen disk and answers of 200,000 ids each: with VLLM_NVEXT_CAPTURE_QUEUE_BYTES at 16 MiB, two turns
    (~7.2 MB each as queued) wait for the writer and the other 8 are dropped and counted (`queue_full`), where the
    4,096-turn bound alone would hold all 10; every client gets its answer."""
    monkeypatch.setenv("VLLM_NVEXT_CAPTURE_QUEUE_BYTES", str(16 * 1024 * 1024))
    answer = {
        "id": "chatcmpl-big",
        "object": "chat.completion",
        "model": "tiny",
        "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length",
                     "token_ids": [7] * 200_000}],
    }  # fmt: skip
    app = NvextMiddleware(Upstream(body=json.dumps(answer).encode()), capture=f"sqlite:///{tmp_path / 'c.sqlite3'}")
    sink = app.sink
    assert sink is not None
    gate = hold_writer(sink)
    request = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
    headers = ((b"content-type", b"application/json"), (b"x-nvext-session-id", b"big"))
    for _ in range(10):
        assert (await call(app, "/v1/chat/completions", request, headers=headers)).status == 200
    assert sink.tally.dropped_turns == {"queue_full": 8}
    gate.set()
    assert sink.flush(60)
    assert [len(t["completion_token_ids"]) for t in sink.read("big") or []] == [200_000, 200_000]
    sink.close()


def test_a_store_that_hangs_holds_neither_a_read_nor_the_servers_exit(tmp_path):
    """The store's reads and writes never return (a frozen disk), in a server that handles SIGTERM as vLLM's does
    (the process ends by returning): a GET of the read API is a 503 once its bound (1 s here) is past, and SIGTERM
    ends the server once the shutdown's bound (2 s here) is past, the 3 turns it could not write counted in the log."""
    url = f"sqlite:///{tmp_path / 'capture.sqlite3'}"
    server = _Served("tests.support.capture_app", "PORT", "--capture", url, "--hang", "--vllm-signals")
    try:
        _chats(server.url, "hung", 3)
        read = httpx.get(server.url + "/v1/nvext/sessions/hung", headers=AUTH, timeout=30)
        assert read.status_code == 503 and "unavailable" in read.text
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0
    finally:
        log = server.stop()
    assert "3 queued turns not written" in log


async def test_reads_of_a_store_that_hangs_are_503s_and_leave_at_most_store_threads_behind(tmp_path, monkeypatch):
    """The store's reads never return (a frozen disk): 24 GETs of the read API are each a 503 once the bound is past
    (0.2 s here), and at most `api.STORE_THREADS` (16) threads are left waiting on the store, not one per GET."""
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    monkeypatch.setattr(api, "STORE_WAIT_S", 0.2, raising=False)
    app = NvextMiddleware(Upstream(), capture=f"sqlite:///{tmp_path / 'c.sqlite3'}")
    assert app.sink is not None
    frozen, before = threading.Event(), threading.active_count()
    monkeypatch.setattr(app.sink.backend, "read", lambda *args: frozen.wait())
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            reads = [client.get("/v1/nvext/sessions/hung", headers=AUTH) for _ in range(24)]
            answers = await asyncio.wait_for(asyncio.gather(*reads), 30)
        assert [a.status_code for a in answers] == [503] * 24
        assert threading.active_count() - before <= 16, "api.STORE_THREADS"
    finally:
        frozen.set()
        app.sink.close()

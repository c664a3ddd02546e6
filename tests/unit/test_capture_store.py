"""The capture store, on a real SQLite file and a real redis-server: what is written is read back, in
order, with each turn placed against the previous one; a full or broken store drops and counts, and the
request path's `submit` never blocks or raises."""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tests.support.capture import make_turn
from vllm_nvext.capture import store as store_module
from vllm_nvext.capture.store import QUEUE_FULL, STORE_ERROR, STORE_FULL, Sink, open_sink
from vllm_nvext.config import ConfigError


@pytest.fixture
def sink(store_url):
    s = open_sink(store_url)
    yield s
    s.close()


def test_a_session_reads_back_in_order_each_turn_placed_against_the_previous(sink):
    sink.submit(make_turn("agent-1", [1, 2, 3], [4, 5]))
    sink.submit(make_turn("agent-1", [1, 2, 3, 4, 5, 6], [7]))
    sink.submit(make_turn("agent-1", [1, 2, 9], [8]))
    sink.submit(make_turn("other", [5], [6]))
    assert sink.flush()
    turns = sink.read("agent-1")
    assert turns is not None
    assert [t["index"] for t in turns] == [0, 1, 2]
    assert [t["extends_previous"] for t in turns] == [None, True, False]
    assert turns[2]["break"]["index"] == 2
    assert turns[1]["prompt_token_ids"] == [1, 2, 3, 4, 5, 6] and turns[1]["completion_token_ids"] == [7]
    assert sink.read("never-seen") is None
    assert sink.tally.recorded_turns == 4 and sink.tally.dropped_turns == {}


def test_a_deleted_session_is_gone_and_others_stay(sink):
    sink.submit(make_turn("a", [1]))
    sink.submit(make_turn("b", [2]))
    assert sink.flush()
    assert sink.delete("a") is True
    assert sink.delete("a") is False
    assert sink.read("a") is None
    assert [t["prompt_token_ids"] for t in sink.read("b") or []] == [[2]]


def test_a_read_is_paged_by_size_and_a_page_holds_at_least_one_turn(sink):
    for i in range(5):
        sink.submit(make_turn("big", list(range(1000 * (i + 1)))))
    assert sink.flush()
    page = sink.read_page("big", 0, max_bytes=1)
    assert page is not None and len(page.turns) == 1 and page.next_index == 1
    seen, start = [], 0
    while start is not None:
        page = sink.read_page("big", start, max_bytes=12_000)
        assert page is not None
        seen += page.turns
        start = page.next_index
    assert len(seen) == 5
    assert len(sink.read("big") or []) == 5


def test_200_concurrent_submits_lose_no_turn(sink):
    sessions = [f"s{i}" for i in range(10)]
    barrier = threading.Barrier(200)

    def one(n: int) -> None:
        barrier.wait()
        sink.submit(make_turn(sessions[n % 10], [n, n + 1], [n + 2]))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sink.flush()
    stored = {s: sink.read(s) or [] for s in sessions}
    assert sum(len(turns) for turns in stored.values()) == 200
    for turns in stored.values():
        assert [t["index"] for t in turns] == list(range(20))  # one index each, none twice
    assert sorted(t["prompt_token_ids"][0] for turns in stored.values() for t in turns) == list(range(200))
    assert sink.tally.recorded_turns == 200


def test_two_writers_on_one_store_give_each_turn_its_own_index(store_url):
    """Two API-server processes, or two proxy workers, share one store."""
    a, b = open_sink(store_url), open_sink(store_url)
    try:
        for n in range(50):
            (a if n % 2 else b).submit(make_turn("shared", [n]))
        assert a.flush() and b.flush()
        turns = a.read("shared") or []
        assert [t["index"] for t in turns] == list(range(50))
        assert sorted(t["prompt_token_ids"][0] for t in turns) == list(range(50))
    finally:
        a.close()
        b.close()


def test_a_full_store_drops_and_counts_the_turns(store_url):
    full = open_sink(store_url, max_bytes=1)  # any store is past one byte
    try:
        for n in range(10):
            full.submit(make_turn("s", [n]))
        assert full.flush()
        assert full.tally.dropped_turns == {STORE_FULL: 10}
        assert full.tally.recorded_turns == 0
        assert full.read("s") is None
    finally:
        full.close()


def test_retention_removes_sessions_whose_last_turn_is_older(store_url):
    sink = open_sink(store_url, retention_s=100)
    try:
        sink.submit(make_turn("old", [1]))
        assert sink.flush()
        assert sink.backend.prune(time.time() + 50) == 0
        assert sink.read("old") is not None
        assert sink.backend.prune(time.time() + 101) == 1
        assert list(sink.backend.sessions(None)) == []
    finally:
        sink.close()


def test_a_full_queue_drops_and_counts_without_blocking_the_submitter(tmp_path):
    """The writer is held by another process's write lock on the file: submits past the queue drop."""
    path = tmp_path / "c.sqlite3"
    sink = open_sink(f"sqlite:///{path}")
    sink._queue.maxsize = 4  # noqa: SLF001 (a small queue, the same code)
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        for n in range(200):
            sink.submit(make_turn("s", [n]))
        assert sink.tally.dropped_turns.get(QUEUE_FULL, 0) >= 200 - store_module.BATCH - 4
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert sink.flush()
    tally = sink.tally
    assert tally.recorded_turns + sum(tally.dropped_turns.values()) == 200
    sink.close()


def test_a_store_whose_directory_is_gone_drops_and_counts(tmp_path):
    folder = tmp_path / "store"
    folder.mkdir()
    sink = open_sink(f"sqlite:///{folder / 'c.sqlite3'}")
    try:
        sink.submit(make_turn("s", [1]))
        assert sink.flush()
        for p in folder.iterdir():
            p.unlink()
        folder.rmdir()
        sink.submit(make_turn("s", [2]))
        assert sink.flush()
        assert sink.tally.dropped_turns == {STORE_ERROR: 1}
        assert sink.tally.recorded_turns == 1
    finally:
        sink.close()


def test_a_store_file_that_is_no_longer_a_database_drops_and_counts(tmp_path):
    path = tmp_path / "c.sqlite3"
    sink = open_sink(f"sqlite:///{path}")
    try:
        sink.submit(make_turn("s", [1]))
        assert sink.flush()
        for p in tmp_path.glob("c.sqlite3*"):
            p.unlink()
        path.write_bytes(b"not a database" * 512)
        sink.submit(make_turn("s", [2]))
        assert sink.flush()
        assert sink.tally.dropped_turns == {STORE_ERROR: 1}
    finally:
        sink.close()


def test_a_read_only_store_file_stops_start_up_with_a_message_without_its_path():
    """The operator's store cannot be written: the server refuses to start (not a silent capture of
    nothing). Root writes through any mode, so the writer runs as `nobody` in a forked child then."""
    folder = Path(tempfile.mkdtemp())
    try:
        os.chmod(folder, 0o777)
        path = folder / "c.sqlite3"
        open_sink(f"sqlite:///{path}").close()
        for p in folder.glob("c.sqlite3*"):
            os.chmod(p, 0o444)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover (the child reports through the pipe)
            answer = b"opened"
            try:
                if os.getuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                open_sink(f"sqlite:///{path}").close()
            except ConfigError as exc:
                answer = str(exc).encode()
            except BaseException:
                answer = b"other error"
            os.write(write, answer)
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            answer = pipe.read().decode()
        os.waitpid(child, 0)
        assert answer == "capture: the SQLite store cannot be opened for writing"
        assert str(folder) not in answer
    finally:
        shutil.rmtree(folder)


def test_the_store_file_is_readable_by_its_owner_alone(tmp_path):
    sink = open_sink(f"sqlite:///{tmp_path / 'c.sqlite3'}")
    sink.submit(make_turn("s", [1]))
    assert sink.flush()
    files = sorted(tmp_path.glob("c.sqlite3*"))
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), files
    sink.close()


def test_a_stopped_redis_server_drops_and_counts_and_submit_returns_at_once():
    from tests.support.redis_server import redis_server

    with redis_server() as url:
        sink = open_sink(url)
        sink.submit(make_turn("s", [1]))
        assert sink.flush()
    started = time.monotonic()
    for n in range(20):
        sink.submit(make_turn("s", [n]))
    assert time.monotonic() - started < 1.0  # the submits never waited on the dead server
    assert sink.flush(60)
    assert sink.tally.recorded_turns == 1 and sink.tally.dropped_turns == {STORE_ERROR: 20}
    sink.close()


def test_a_killed_writer_keeps_every_turn_it_had_written(tmp_path):
    """SQLite WAL, one commit per small batch: a SIGKILL loses at most the turns still queued."""
    path = tmp_path / "c.sqlite3"
    script = (
        "import sys, time\n"
        "from tests.support.capture import make_turn\n"
        "from vllm_nvext.capture.store import open_sink\n"
        "s = open_sink(sys.argv[1])\n"
        "for n in range(100): s.submit(make_turn('s', [n]))\n"
        "s.flush(); print('written', flush=True)\n"
        "n = 100\n"
        "while True:\n"
        "    s.submit(make_turn('s', [n])); n += 1; time.sleep(0.001)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, f"sqlite:///{path}"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None
    with proc.stdout:
        try:
            assert proc.stdout.readline().strip() == "written"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    check = sqlite3.connect(path)
    assert check.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    check.close()
    sink = open_sink(f"sqlite:///{path}")
    turns = sink.read("s") or []
    assert len(turns) >= 100
    assert [t["index"] for t in turns] == list(range(len(turns)))
    assert [t["prompt_token_ids"][0] for t in turns] == list(range(len(turns)))
    sink.close()


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///relative.sqlite3",
        "sqlite:////no/such/folder/c.sqlite3",
        "redis://127.0.0.1:notaport/0",
        "memcached://x",
    ],
)
def test_a_bad_store_url_stops_start_up_with_a_clear_message(url):
    with pytest.raises(ConfigError, match="^capture: "):
        open_sink(url)


def test_a_closed_sink_drops_what_it_is_handed(tmp_path):
    sink = Sink(store_module.open_backend(f"sqlite:///{tmp_path / 'c.sqlite3'}"))
    sink.close()
    sink.submit(make_turn("s", [1]))
    assert sink.tally.dropped_turns == {QUEUE_FULL: 1}


def _registry_value(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY

    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_the_counts_reach_vllms_metrics(tmp_path):
    """`vllm_nvext:capture_turns_recorded_total`, `..._dropped_total{reason}` and `capture_store_bytes`,
    from a sink opened as the middleware opens it."""
    from vllm_nvext import Settings
    from vllm_nvext.middleware.capture import open_capture

    recorded = _registry_value("vllm_nvext:capture_turns_recorded_total")
    full = _registry_value("vllm_nvext:capture_turns_dropped_total", reason=STORE_FULL)
    sink = open_capture(Settings(capture=f"sqlite:///{tmp_path / 'c.sqlite3'}", capture_max_bytes=40_000))
    assert sink is not None
    for n in range(3):
        sink.submit(make_turn("s", [n]))
    assert sink.flush()
    assert _registry_value("vllm_nvext:capture_turns_recorded_total") - recorded == 3
    assert _registry_value("vllm_nvext:capture_store_bytes") == sink.tally.bytes > 0
    sink.submit(make_turn("big", list(range(20_000))))  # past the cap once written
    assert sink.flush()
    sink.submit(make_turn("s", [9]))
    assert sink.flush()
    assert _registry_value("vllm_nvext:capture_turns_dropped_total", reason=STORE_FULL) - full == 1
    sink.close()


def test_writers_contending_for_one_session_lose_no_turn(store_url):
    """Four API-server processes (or proxy workers) appending to one hot session: every turn is kept, each
    at its own index (on Redis, two writers that collide retry after a random wait, not in lock-step)."""
    sinks = [open_sink(store_url) for _ in range(4)]
    try:
        for n in range(200):
            sinks[n % 4].submit(make_turn("hot", [n]))
        assert all(s.flush(60) for s in sinks)
        turns = sinks[0].read("hot") or []
        assert [t["index"] for t in turns] == list(range(200))
        assert sorted(t["prompt_token_ids"][0] for t in turns) == list(range(200))
        assert [s.tally.dropped_turns for s in sinks] == [{}] * 4
        assert sum(s.tally.recorded_turns for s in sinks) == 200
    finally:
        for s in sinks:
            s.close()


def test_a_turn_redis_cannot_append_is_the_only_one_dropped(redis_url):
    """A session key Redis holds as another type refuses its turn; the turns beside it, in whatever batch,
    are written and counted recorded, and only the refused one is counted dropped."""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    client.set("nvext:capture:turns:clobbered", b"not a list")
    sink = open_sink(redis_url)
    try:
        sink.submit(make_turn("kept", [1]))
        sink.submit(make_turn("clobbered", [2]))
        sink.submit(make_turn("kept", [1, 3]))
        assert sink.flush()
        assert [t["prompt_token_ids"] for t in sink.read("kept") or []] == [[1], [1, 3]]
        assert sink.tally.recorded_turns == 2 and sink.tally.dropped_turns == {STORE_ERROR: 1}
    finally:
        sink.close()
        client.close()


def test_an_idle_servers_store_still_removes_sessions_past_their_retention(tmp_path, monkeypatch):
    """Retention holds while no request comes: the writer prunes on its own clock, not only when a turn arrives
    (docs/capture.md, "a session is removed this many seconds after its last turn")."""
    monkeypatch.setattr(store_module, "PRUNE_EVERY_S", 0.02)
    sink = open_sink(f"sqlite:///{tmp_path / 'c.sqlite3'}", retention_s=100)
    try:
        sink.submit(make_turn("old", [1]))
        assert sink.flush() and sink.read("old") is not None

        class Later:  # the writer's clock, 101 s on: the session's last turn is past its retention
            monotonic, sleep = staticmethod(time.monotonic), staticmethod(time.sleep)

            @staticmethod
            def time() -> float:
                return time.time() + 101

        monkeypatch.setattr(store_module, "time", Later)
        deadline = time.monotonic() + 10
        while sink.read("old") is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sink.read("old") is None, "no turn came after it, and the session is still there"
    finally:
        sink.close()


def test_the_sqlite_writers_memory_of_last_turns_is_bounded_by_ids_not_by_sessions_alone(tmp_path, monkeypatch):
    """The writer keeps each recent session's last turn to place the next one without a re-read: with long
    prompts (an agent's 100k-token context) 256 of them held as Python lists were gigabytes. Bounded by ids."""
    import gc
    import tracemalloc

    from vllm_nvext.capture import sqlite_store

    monkeypatch.setattr(sqlite_store, "_LAST_IDS", 1 << 18)  # 256 Ki ids kept at most (1 MiB)
    sink = open_sink(f"sqlite:///{tmp_path / 'c.sqlite3'}")
    try:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for n in range(12):  # 12 sessions of 100k ids: 1.2 M ids, 43 MB as Python ints
            sink.submit(make_turn(f"long-{n}", list(range(1000 + n, 101_000 + n)), [7, 8]))
            assert sink.flush()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    try:
        assert held < 8 << 20, f"{held >> 20} MiB held after the turns were written"
        # The kept turns still place the next ones: a session continued past the memory, and one in it.
        sink.submit(make_turn("long-0", [*range(1000, 101_000), 7, 8, 9], [1]))
        sink.submit(make_turn("long-11", [*range(1011, 101_011), 7, 8, 9], [1]))
        sink.submit(make_turn("long-10", [5], [1]))
        assert sink.flush()
        assert [(sink.read(s) or [])[-1]["extends_previous"] for s in ("long-0", "long-11", "long-10")] == [
            True,
            True,
            False,
        ]
    finally:
        sink.close()

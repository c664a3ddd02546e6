"""The capture store's writer under pressure (docs/capture.md, the store): two real processes on one SQLite file,
a turn no store can hold beside good ones, a server sent SIGTERM with turns still queued, a queue of huge turns
and a store that hangs. Real parts throughout: SQLite files, a real redis-server, real OS processes."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

from vllm_nvext.capture.store import open_sink

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

"""`VllmServer`'s process handling, with a stand-in process in vLLM's place.

The stand-in answers /health and starts a child of its own, as vLLM starts engine processes:
`stop()` must end both.
"""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from vllm_nvext.tools.server import VllmServer

STAND_IN = textwrap.dedent(
    """
    import http.server, subprocess, sys

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print("engine pid", child.pid, flush=True)
    http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Health).serve_forever()
    """
)


class StandIn(VllmServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STAND_IN, self.host, str(self.port)]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie's parent died with the server: init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ends_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process states from /proc")
def test_stop_ends_the_server_and_its_engine_processes(tmp_path):
    with StandIn(model="m", name="stand-in", log_path=tmp_path / "log") as server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server.proc is not None
        engine = int(server.log_text().split("engine pid ")[1].split()[0])
        assert _running(engine)
    assert server.proc.poll() is not None
    assert _ends_within(engine, 30), "the engine process outlived its server"  # SIGTERM went to the group
    assert "engine pid" in server.log_tail()
    server.stop()  # stopping twice is harmless


def test_a_server_that_exits_during_start_up_raises_with_its_log():
    failing = VllmServer(model="m", name="failing")
    failing.command = lambda: [sys.executable, "-c", "print('no such model'); raise SystemExit(1)"]  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="'failing' exited during start-up:\nno such model"):
        failing.start().wait_ready(timeout=60)
    assert failing.log_path is not None
    failing.log_path.unlink()


def test_a_wildcard_bind_is_reached_on_loopback():
    assert VllmServer(model="m", host="0.0.0.0", port=8123).url == "http://127.0.0.1:8123"

"""A real redis-server on a free port of 127.0.0.1, started for a test session and stopped after it.

`scripts/setup_redis.sh` (run by `make setup-redis`, which `make test-unit` and `make test-e2e-scaleout`
reach) installs Debian's `redis-server`; a missing one fails the test that asks for it, naming that target.

`RedisServer` is a server kind of tests/support/servers.py (`start()`, `wait_ready(timeout)`,
`terminate()`, `stop()`, `url`): the capture fleet's shared store (tests/e2e/test_capture_fleet.py).
`redis_server()` is the same as a context manager (the unit tests' store).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process (no persistence, its files in a temp directory), on `port` or a free one."""

    def __init__(self, password: str | None = None, port: int | None = None) -> None:
        self.password = password
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make setup-redis` (Debian's redis-server package)")
        self._workdir = tempfile.TemporaryDirectory(prefix="nvext-redis-")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", self._workdir.name]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def wait_ready(self, timeout: float = 20.0) -> RedisServer:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._workdir is not None:
            with contextlib.suppress(OSError):
                self._workdir.cleanup()
            self._workdir = None


@contextmanager
def redis_server(password: str | None = None) -> Iterator[str]:
    """Yields the server's URL (redis://[:password@]127.0.0.1:PORT/0); the server is gone after."""
    server = RedisServer(password)
    try:
        yield server.start().wait_ready().url
    finally:
        server.stop()

"""A real redis-server on a free port of 127.0.0.1, started for a test session and stopped after it.

`scripts/setup_redis.sh` (run by `make setup-redis`, which `make test-unit` reaches) installs Debian's
`redis-server`; a missing one fails the test that asks for it, naming that target.
"""

from __future__ import annotations

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


@contextmanager
def redis_server(password: str | None = None) -> Iterator[str]:
    """Yields the server's URL (redis://[:password@]127.0.0.1:PORT/0); the server is gone after."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: run `make setup-redis` (Debian's redis-server package)")
    port = free_port()
    with tempfile.TemporaryDirectory() as workdir:
        args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", workdir]
        if password is not None:
            args += ["--requirepass", password]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
            auth = f":{password}@" if password is not None else ""
            yield f"redis://{auth}127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

"""Start and stop real vLLM OpenAI servers (used by tests, benchmarks, examples and `serve`).

Each server runs vLLM's own CLI in a subprocess on a free loopback port, with its output in
a log file; `stop()` ends the whole process group, engine processes included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

MIDDLEWARE = "vllm_nvext.NvextMiddleware"
TINY_ARGS = ("--dtype", "float32", "--max-model-len", "1024")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_Server = TypeVar("_Server", bound="ServerProcess")


class ServerProcess:
    """Waiting for, reading and stopping a server subprocess: what every kind of server shares.

    The class using it provides `proc`, `name`, `log_path` and `url`; `LABEL` names it in errors.
    """

    LABEL = "server"
    READY_TIMEOUT_S = 600.0
    READY_POLL_S = 0.5
    STOP_TIMEOUT_S = 30.0
    proc: subprocess.Popen[bytes] | None
    name: str
    log_path: Path | None

    @property
    def url(self) -> str:
        raise NotImplementedError

    def wait_ready(self: _Server, timeout: float | None = None) -> _Server:
        """Block until `GET /health` answers 200; raise with the log's tail if it exits or times out."""
        assert self.proc is not None, "start() first"
        timeout = self.READY_TIMEOUT_S if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.LABEL} {self.name!r} exited during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(self.READY_POLL_S)
        raise TimeoutError(f"{self.LABEL} {self.name!r} not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def spawn(self, command: list[str], env: Mapping[str, str]) -> None:
        """Start `command` in a process group of its own, its output to `log_path` (a new temp file if unset)."""
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"vllm-nvext-{self.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(path)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, lines: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path and self.log_path.exists() else ""

    def terminate(self) -> None:
        """Ask the whole process group to exit, without waiting (see stop())."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float | None = None) -> None:
        """End the whole process group: SIGTERM, then SIGKILL after `timeout` (STOP_TIMEOUT_S)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.STOP_TIMEOUT_S if timeout is None else timeout)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


@dataclass
class VllmServer(ServerProcess):
    """A vLLM server subprocess; `start()` returns at once, `wait_ready()` blocks until /health."""

    LABEL = "vLLM server"

    model: str
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    name: str = "vllm"
    host: str = "127.0.0.1"
    port: int = 0
    log_path: Path | None = None
    # Output to this process's terminal instead of a log file (`vllm-nvext serve`).
    log_to_terminal: bool = False
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """Where to reach it from this machine (a wildcard bind is reached on loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm_nvext.tools._vllm_cli", "serve", self.model,
            "--host", self.host, "--port", str(self.port), *self.args,
        ]  # fmt: skip

    def start(self) -> VllmServer:
        if not self.port:
            self.port = free_port()
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(self.env)
        if self.log_to_terminal:
            self.proc = subprocess.Popen(self.command(), env=env, start_new_session=True)
            return self
        self.spawn(self.command(), env)
        return self

    def __enter__(self) -> VllmServer:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class ProxyServer(ServerProcess):
    """A `vllm-nvext proxy` subprocess in front of `upstream`; ready once the upstream's /health answers through it."""

    LABEL = "vllm-nvext proxy"
    READY_POLL_S = 0.2

    upstream: str
    args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    name: str = "proxy"
    port: int = 0
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm_nvext.tools.cli", "proxy", "--upstream", self.upstream,
            "--host", "127.0.0.1", "--port", str(self.port), *self.args,
        ]  # fmt: skip

    def start(self) -> ProxyServer:
        if not self.port:
            self.port = free_port()
        self.spawn(self.command(), {**os.environ, **self.env})
        return self

    def __enter__(self) -> ProxyServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

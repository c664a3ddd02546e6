"""A real NVIDIA Dynamo 1.6.1 (its frontend + its `dynamo.vllm` worker) on the tiny model.

The reference the conformance tests compare vllm-nvext's `nvext` answers with. Dynamo lives in
its own venv, built by `make setup-dynamo` (scripts/setup_dynamo.sh) under
"${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}/dynamo-1.6.1"; the worker loads the two
import-only shims in scripts/dynamo_shims/ through PYTHONPATH. Both processes bind loopback only,
use file discovery (no etcd, no NATS) in a private directory and are stopped by process group.
Usage mirrors `vllm_nvext.tools.server.VllmServer`: `start()` returns at once, `wait_ready()` blocks.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.servers import EAGER_ARGS
from vllm_nvext.tools.reference_venvs import is_built, refs_dir
from vllm_nvext.tools.server import TINY_ARGS, free_port

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_VERSION = "1.6.1"
SHIMS = ROOT / "scripts" / "dynamo_shims"


def venv_dir() -> Path:
    return refs_dir() / f"dynamo-{DYNAMO_VERSION}"


class DynamoMissing(RuntimeError):
    """The Dynamo venv is not built."""


def require_venv() -> Path:
    venv = venv_dir()
    if not is_built(venv):
        raise DynamoMissing(
            f"the reference Dynamo {DYNAMO_VERSION} venv is missing or incomplete at {venv}; "
            "build it with `make setup-dynamo` (scripts/setup_dynamo.sh)"
        )
    return venv


@dataclass
class DynamoReference:
    """Dynamo's OpenAI frontend in front of one `dynamo.vllm` worker serving `model` as `served_name`."""

    model: str
    served_name: str = "tiny"
    worker_args: Sequence[str] = ()
    frontend_args: Sequence[str] = ()
    name: str = "dynamo"
    port: int = 0
    log_dir: Path | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _state_dir: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        assert self._state_dir is not None
        env = dict(os.environ)
        for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(key, None)
        env.update(
            {
                "DYN_FILE_KV": self._state_dir,
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_REQUEST_PLANE": "tcp",
                "DYN_EVENT_PLANE": "zmq",
                "DYN_TCP_RPC_HOST": "127.0.0.1",
                "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
                "DYN_EVENT_PLANE_HOST": "127.0.0.1",
                "DYN_SYSTEM_HOST": "127.0.0.1",
                "DYN_SELF_HOST_METADATA": "0",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            }
        )
        return env

    def commands(self, python: str) -> dict[str, list[str]]:
        planes = ("--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq")
        return {
            "worker": [
                python, "-m", "dynamo.vllm", "--model", self.model, "--served-model-name", self.served_name,
                *TINY_ARGS, *EAGER_ARGS, *planes, *self.worker_args,
            ],
            "frontend": [
                python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(self.port),
                *planes, "--router-mode", "round-robin", *self.frontend_args,
            ],
        }  # fmt: skip

    def start(self) -> DynamoReference:
        venv = require_venv()
        if not self.port:
            self.port = free_port()
        self._state_dir = tempfile.mkdtemp(prefix="vllm-nvext-dynamo-kv-")
        if self.log_dir is None:
            self.log_dir = Path(tempfile.mkdtemp(prefix="vllm-nvext-dynamo-log-"))
        env = self._env()
        for role, cmd in self.commands(str(venv / "bin" / "python")).items():
            role_env = dict(env)
            if role == "worker":
                role_env["PYTHONPATH"] = str(SHIMS)
            with open(self.log_dir / f"{role}.log", "wb") as log:
                self.procs[role] = subprocess.Popen(
                    cmd, env=role_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.log_dir
                )
        return self

    def wait_ready(self, timeout: float = 600.0) -> DynamoReference:
        """Ready when the frontend's /v1/models lists the served model (the worker registered)."""
        assert self.procs, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for role, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"Dynamo {role} exited during start-up:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as resp:
                    models = json.loads(resp.read())
                if any(m.get("id") == self.served_name for m in models.get("data", [])):
                    return self
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Dynamo not ready after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        out = []
        for role in ("worker", "frontend"):
            path = self.log_dir / f"{role}.log" if self.log_dir else None
            if path is not None and path.exists():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {role} ({path}) ---\n" + "\n".join(text))
        return "\n".join(out)

    def terminate(self) -> None:
        """Ask both process groups to exit, without waiting (see stop())."""
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> None:
        self.terminate()
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=timeout)
            with contextlib.suppress(ProcessLookupError):  # stragglers of the group too
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        if self._state_dir:
            shutil.rmtree(self._state_dir, ignore_errors=True)
            self._state_dir = None

    def __enter__(self) -> DynamoReference:
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()

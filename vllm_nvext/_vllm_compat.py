"""What the middleware knows of vLLM itself: version capabilities, probed once from its source
without importing it, and a replica of its `--api-key` check.

vLLM is an optional dependency and heavy to import; a probe reads the one file that decides.
Without vLLM installed (pure unit tests, a middleware in front of a remote server) the newest
behaviour is assumed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
from collections.abc import MutableMapping
from functools import cache
from pathlib import Path
from typing import Any


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
def untyped_body_is_json() -> bool:
    """Does vLLM's FastAPI read a body without a Content-Type as JSON?

    FastAPI did until it grew `strict_content_type` (on by default); vLLM pins no version.
    """
    spec = importlib.util.find_spec("fastapi")
    if spec is None or spec.origin is None:
        return False
    try:
        source = (Path(spec.origin).parent / "routing.py").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    return "strict_content_type" not in source


@cache
def chat_accepts_prompt_token_ids() -> bool:
    """Chat serves `kv_transfer_params.prompt_token_ids` as the prompt (vLLM's decode-side reuse)."""
    return _source_mentions("renderers/online_renderer.py", "_reused_prompt_token_ids")


@cache
def has_thinking_token_budget() -> bool:
    return _source_mentions("entrypoints/openai/completion/protocol.py", "thinking_token_budget")


def auth_refuses(scope: MutableMapping[str, Any]) -> bool:
    """Would vLLM's `--api-key` check refuse this request? (Only matters when mounted outside it.)

    A replica of vLLM's `AuthenticationMiddleware`: the keys from `app.state.args.api_key` or
    `VLLM_API_KEY`, a `Bearer` token compared in constant time.
    """
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    tokens = [t for t in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if t]
    if not tokens:
        return False
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, param = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return True
            digest = hashlib.sha256(param.encode()).digest()
            return not any(secrets.compare_digest(digest, hashlib.sha256(t.encode()).digest()) for t in tokens)
    return True

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


def _source_mentions(relative: str | tuple[str, ...], needle: str) -> bool:
    """Does the file (the first of several places it has had that exists) say `needle`?"""
    root = _vllm_root()
    if root is None:
        return True
    for candidate in (relative,) if isinstance(relative, str) else relative:
        try:
            return needle in (root / candidate).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
    return False


# The files that decide each capability (relative to the vllm package), and what they must say.
# `vllm serve`'s arguments: under launchers/ in 0.30-0.32, under common/ from 0.33.
_CLI_ARGS = ("entrypoints/launchers/cli_args.py", "entrypoints/common/cli_args.py")
_COMPLETION_PROTOCOL = "entrypoints/openai/completion/protocol.py"
_CHAT_PROTOCOL = "entrypoints/openai/chat_completion/protocol.py"
_HIDDEN_STATES_CONNECTOR = "distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"


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
    return _source_mentions(_COMPLETION_PROTOCOL, "thinking_token_budget")


@cache
def has_endpoint_plugins() -> bool:
    """Does vLLM load `vllm.endpoint_plugins` entry points (`VLLM_PLUGINS=nvext`, the plugin mount)?"""
    return _source_mentions("plugins/__init__.py", '"vllm.endpoint_plugins"')


@cache
def has_middleware_arg() -> bool:
    """Does `vllm serve` take `--middleware` (the outermost mount)?"""
    return _source_mentions(_CLI_ARGS, "middleware: list[str]")


@cache
def returns_token_ids(endpoint: str) -> bool:
    """Does this route ("chat" or "completions") answer `return_token_ids` with the ids?

    Where it does not, vLLM ignores the field, and nvext placement has no ids to move.
    """
    return _source_mentions(_CHAT_PROTOCOL if endpoint == "chat" else _COMPLETION_PROTOCOL, "return_token_ids")


@cache
def has_per_request_metrics() -> bool:
    """Does vLLM take `--enable-per-request-metrics` (the source of `timing`'s prefill times)?"""
    return _source_mentions(_CLI_ARGS, "enable_per_request_metrics")


@cache
def has_hidden_states_connector() -> bool:
    """Is vLLM's `ExampleHiddenStatesConnector` there, with the hook the CPU connector overrides?"""
    return _source_mentions(_HIDDEN_STATES_CONNECTOR, "def _submit_async_write(")


def capabilities() -> dict[str, bool]:
    """Every probe's answer for the installed vLLM, by name."""
    return {
        "endpoint_plugins": has_endpoint_plugins(),
        "middleware_arg": has_middleware_arg(),
        "chat_returns_token_ids": returns_token_ids("chat"),
        "completions_returns_token_ids": returns_token_ids("completions"),
        "per_request_metrics": has_per_request_metrics(),
        "chat_accepts_prompt_token_ids": chat_accepts_prompt_token_ids(),
        "thinking_token_budget": has_thinking_token_budget(),
        "hidden_states_connector": has_hidden_states_connector(),
        "untyped_body_is_json": untyped_body_is_json(),
    }


# Where a key for vLLM's check comes from when the middleware runs outside vLLM's process
# (`vllm-nvext proxy --api-key`): the scope carries the keys, the check is the same.
API_KEYS = "vllm_nvext.api_keys"
# vLLM's `AuthenticationMiddleware.GUARDED_PREFIX` (the same in 0.30-0.33; a unit test compares it
# with the installed vLLM's): only paths under these need the key (`/invocations` does not).
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")


def api_keys(scope: MutableMapping[str, Any]) -> list[str]:
    """The keys vLLM checks: the scope's `API_KEYS` (the proxy), else `app.state.args.api_key` or `VLLM_API_KEY`."""
    if API_KEYS in scope:
        return [t for t in scope[API_KEYS] if t]
    args = getattr(getattr(scope.get("app"), "state", None), "args", None)
    return [t for t in (getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]) if t]


def auth_refuses(scope: MutableMapping[str, Any]) -> bool:
    """Would vLLM's `--api-key` check refuse this request? (Only matters when mounted outside it.)

    A replica of vLLM's `AuthenticationMiddleware`: paths under `GUARDED_PREFIXES` (after the root
    path), a `Bearer` token compared in constant time with each key.
    """
    root = scope.get("root_path", "")
    path = scope.get("path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    if scope.get("method") == "OPTIONS" or not path.startswith(GUARDED_PREFIXES):
        return False
    tokens = api_keys(scope)
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

"""The nvext request fields vLLM has an equivalent for, mapped onto the body vLLM receives.

`greed_sampling`, `cache_salt`, `max_thinking_tokens`, `token_data` and `dp_rank` (docs/protocol.md §3);
routing-only fields are dropped with `nvext`.
"""

from __future__ import annotations

import logging
from typing import Any

from .. import _json, _vllm_compat
from ..protocol import Endpoint, RequestError
from .reading import Request
from .rewrite import BodyRewrite

logger = logging.getLogger("vllm_nvext")


def apply_nvext_fields(
    rewrite: BodyRewrite, request: Request, dp_rank_header: bytes | None
) -> tuple[tuple[bytes, bytes], ...]:
    """Map the nvext request fields vLLM has an equivalent for; routing-only ones are dropped."""
    nvext, data = request.nvext, request.data
    if nvext.get("greed_sampling") is True:
        rewrite.set("temperature", "0.0", "nvext.greed_sampling")
    salt = nvext.get("cache_salt")
    if salt:  # an empty salt counts as absent, as in Dynamo; nvext wins over a root cache_salt, as in Dynamo
        rewrite.set("cache_salt", _json.dumps_text(salt), "nvext.cache_salt")
    budget = nvext.get("max_thinking_tokens")
    if budget is not None and data.get("thinking_token_budget") is None:
        # A root thinking_token_budget wins, as in Dynamo.
        if _vllm_compat.has_thinking_token_budget():
            rewrite.set("thinking_token_budget", str(budget), "nvext.max_thinking_tokens")
        else:
            logger.debug("nvext.max_thinking_tokens ignored: this vLLM has no thinking_token_budget")
    token_data = nvext.get("token_data")
    if token_data is not None:
        if not token_data:
            raise RequestError("`nvext.token_data` must not be empty", "nvext.token_data")
        if request.endpoint is Endpoint.COMPLETIONS:
            rewrite.set("prompt", _json.dumps_text(token_data), "nvext.token_data")
        else:
            _chat_from_token_ids(rewrite, request, token_data)
    dp_rank = nvext.get("dp_rank")
    if dp_rank is None:
        return ()
    if dp_rank_header is not None:
        client_rank = _vllm_rank(dp_rank_header)
        if client_rank != dp_rank:
            raise RequestError(
                f"`nvext.dp_rank` ({dp_rank}) conflicts with the X-data-parallel-rank header "
                f"({dp_rank_header.decode('latin-1')!r}); send one of them, or the same rank in both",
                "nvext.dp_rank",
            )
        return ()  # the client's header already says the same rank
    return ((b"x-data-parallel-rank", str(dp_rank).encode()),)


def _vllm_rank(value: bytes) -> int | None:
    """The rank vLLM reads from an `X-data-parallel-rank` value (`int(...)`, else none)."""
    try:
        return int(value.decode("latin-1"))
    except ValueError:
        return None


def _chat_from_token_ids(rewrite: BodyRewrite, request: Request, token_data: list[int]) -> None:
    """Serve a chat request from pre-tokenized ids; the messages are the client's placeholder.

    vLLM's chat endpoint takes `kv_transfer_params.prompt_token_ids` as the prompt (the ids a
    disaggregated prefill stage hands to decode), so the answer stays a real chat completion.
    """
    if not _vllm_compat.chat_accepts_prompt_token_ids():
        raise RequestError(
            "`nvext.token_data` on /v1/chat/completions needs a vLLM whose chat endpoint accepts "
            "`kv_transfer_params.prompt_token_ids`; send it to /v1/completions instead",
            "nvext.token_data",
        )
    if request.fields.echo or _has_non_text_content(request.data.get("messages")):
        # vLLM would then render the messages and silently ignore the ids.
        raise RequestError(
            "`nvext.token_data` cannot be combined with `echo` or non-text message content", "nvext.token_data"
        )
    rewrite.kv_prompt_ids = token_data
    rewrite.sources["kv_transfer_params.prompt_token_ids"] = "nvext.token_data"


def _has_non_text_content(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not (isinstance(part, dict) and part.get("type") == "text") for part in content
        ):
            return True
    return False

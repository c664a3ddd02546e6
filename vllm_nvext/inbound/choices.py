"""How many choices a request asks vLLM for, and what its prompts are: the request side's counts.

`choices` is (prompts, n), from which the Plan's single-choice shortcuts follow; it refuses what one
choice or one prompt cannot serve. `echo_prompts` are the prompts vLLM echoes, put back into `text`.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from typing import Any, cast

from ..protocol import COMPLETION_TOKEN_IDS, SINGLE_PROMPT_SELECTORS, Endpoint, RequestError
from .fields import DecisionFields
from .reading import Request

ECHO_EMBEDS = (
    "`echo` of `prompt_embeds` cannot be combined with token ids vllm-nvext turns on (nvext selectors, or an "
    "nvext-placing mode): vLLM then leaves the echoed prompt out of `text`, and embeddings have no text to put "
    "back. Send `return_token_ids: true` in vLLM placement (the answer stock vLLM gives), or leave out `echo`"
)


def choices(request: Request, nvext_trio: bool, asked: AbstractSet[str]) -> tuple[int, int]:
    """(prompts, n): vLLM generates prompts * n choices. Refuses the trio on more than one choice and
    the single-prompt selectors (`asked`) on a batch."""
    endpoint, fields = request.endpoint, request.fields
    batch = endpoint is Endpoint.CHAT_BATCH
    if batch:
        check_chat_batch(request)
        messages = request.data.get("messages")
        prompts = len(messages) if isinstance(messages, list) and messages else 1
    else:
        prompts = num_prompts(fields) if endpoint is Endpoint.COMPLETIONS else 1
    n = fields.n if fields.n is not None and fields.n > 0 else 1
    prompt_param = "messages" if batch else "prompt"
    if nvext_trio and n * prompts > 1:
        raise RequestError(
            f'`nvext.extra_fields=["{COMPLETION_TOKEN_IDS}"]` requires exactly one generated choice',
            prompt_param if prompts > 1 else "n",
        )
    if prompts > 1:
        single_prompt = [s for s in SINGLE_PROMPT_SELECTORS if s in asked]
        if single_prompt:
            name = single_prompt[0]
            raise RequestError(f'`nvext.extra_fields=["{name}"]` requires a single prompt, got a batch', prompt_param)
    return prompts, n


def conversations(messages: Any) -> bool:
    """Is `messages` what vLLM's batch route takes: a non-empty list of non-empty conversations?"""
    return isinstance(messages, list) and bool(messages) and all(isinstance(m, list) and m for m in messages)


def check_chat_batch(request: Request) -> None:
    """What /v1/chat/completions/batch cannot serve as asked, refused instead of answered wrong."""
    if request.fields.stream is True:
        # vLLM does not refuse it: each conversation is then generated as a stream whose unary
        # answer keeps only the last delta (one token instead of the completion).
        raise RequestError(
            "`stream` is not supported on /v1/chat/completions/batch (vLLM would answer each conversation "
            "with its last token only); leave it out, or stream each conversation from /v1/chat/completions",
            "stream",
        )
    if request.nvext.get("token_data") is not None:
        raise RequestError(
            "`nvext.token_data` is not supported on /v1/chat/completions/batch; send it to /v1/chat/completions",
            "nvext.token_data",
        )


def echo_prompts(request: Request) -> tuple[str | tuple[int, ...], ...]:
    """The prompts vLLM echoes, in its order: a text as sent, ids as vLLM will decode them."""
    token_data = request.nvext.get("token_data")
    if token_data:
        return (tuple(token_data),)
    prompt, embeds = request.fields.prompt, request.fields.prompt_embeds
    if embeds is not None:
        raise RequestError(ECHO_EMBEDS, "echo")
    if isinstance(prompt, str):
        return (prompt,)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return (tuple(prompt),)
    if isinstance(prompt, list):
        batch = cast("list[str] | list[list[int]]", prompt)  # a list of ids was the case above
        return tuple(p if isinstance(p, str) else tuple(p) for p in batch)
    return ()


def num_prompts(fields: DecisionFields) -> int:
    """How many prompts vLLM serves for a completions request (a batch is several)."""
    prompt, embeds = fields.prompt, fields.prompt_embeds
    count = 0
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        count += len(prompt)  # a list of strings or of id lists
    elif prompt is not None:
        count += 1
    if isinstance(embeds, list):
        count += len(embeds)
    elif embeds is not None:
        count += 1
    return max(count, 1)


def logprobs_requested(fields: DecisionFields, endpoint: Endpoint) -> bool:
    lp = fields.logprobs
    if endpoint is not Endpoint.COMPLETIONS:
        return lp is True
    return lp is not None and lp >= 0


# Request fields whose reading by vLLM depends on `logprobs` (`top_logprobs` sizes what is computed, and an
# invalid one fails the engine only when logprobs are on; `logprob_token_ids` is refused without them; beam
# search answers them otherwise): a request that sets one gets no logprobs turned on for the capture.
_LOGPROBS_BOUND = ("top_logprobs", "logprob_token_ids", "use_beam_search")


def capture_logprobs(request: Request, fields: DecisionFields) -> str | None:
    """The `logprobs` value the capture sends vLLM for a request that asked for none (chat: `true`, with vLLM's
    default `top_logprobs` 0; completions: `0`), encoded; None where it asked for them (any `logprobs` vLLM reads
    on completions, `true` on chat), or where turning them on could change what vLLM decides or answers beyond
    them (a field above; completions' `echo`, whose logprobs cover the prompt and turn prompt logprobs on)
    (docs/capture.md, Logprobs)."""
    if any(request.data.get(key) is not None for key in _LOGPROBS_BOUND):
        return None
    if request.endpoint is Endpoint.COMPLETIONS:
        return "0" if fields.logprobs is None and fields.echo is not True else None
    return "true" if request.endpoint is Endpoint.CHAT and fields.logprobs is not True else None

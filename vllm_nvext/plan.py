"""The Plan: what one request asked for, made by the request side (`inbound/`) and read by the
response side (`outbound/`) and the ASGI layer; nothing else passes between them."""

from __future__ import annotations

from dataclasses import dataclass

from .protocol import Endpoint


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send upstream and how to reshape what comes back, for one request."""

    endpoint: Endpoint
    # The client gets vLLM's own placement of the ids (docs/protocol.md §1).
    vllm_ids: bool
    # The trio under `nvext` (docs/protocol.md §3.4): completion_token_ids, prompt_token_ids, kv_transfer_params.
    nvext_trio: bool
    # `nvext.prompt_token_ids` without the rest of the trio.
    nvext_prompt_ids: bool
    # Other selectors answered under `nvext` (NVEXT_ONLY_SELECTORS).
    selectors: frozenset[str]
    # The middleware turned `return_token_ids` on and the client must not see vLLM's copies.
    strip_vllm_ids: bool
    # A completions stream with `echo`: vLLM sends prompt ids by itself: leave those alone.
    echo: bool
    # The middleware turned `return_token_ids` on for a completions `echo`: vLLM then drops the
    # echoed prompt from `text`, and the response side puts it back in front of each choice's first
    # text. One entry per prompt: its text, or its ids (the middleware has vLLM decode those, as vLLM
    # echoes them, before the request goes upstream); empty when nothing is to be put back.
    echo_prompts: tuple[str | tuple[int, ...], ...]
    # The client asked for logprobs (engine_data.completion_logprobs follows them).
    logprobs: bool
    # The rewritten upstream body; None keeps the client's bytes.
    body: bytes | None
    # Extra request headers for vLLM (e.g. the data-parallel rank).
    headers: tuple[tuple[bytes, bytes], ...] = ()
    # What the client asked in (`vllm`, `nvext` or `both`) and whether it streams: for the metrics.
    dialect: str = "vllm"
    stream: bool = False
    # One prompt and n == 1: every chunk is about choice 0.
    single_choice: bool = True
    # Choices per prompt (vLLM's `n`): choice `i` answers prompt `i // n`.
    n: int = 1
    # A one-choice stream with `timing` or `engine_data`: vLLM reports its per-request metrics and
    # cached tokens on the usage chunk right after the finish chunk, which waits for it.
    await_usage: bool = False
    # The client sent a root `kv_transfer_params` (an orchestrator's prefill/decode handoff):
    # vLLM's root `kv_transfer_params` comes back at the root in every mode.
    root_kv: bool = False
    # (vLLM's field, the client's field) for each vLLM field set from an nvext field: an error
    # vLLM raises about the former names the latter (docs/protocol.md §9).
    error_params: tuple[tuple[str, str], ...] = ()
    # A chat stream whose ids vLLM withholds (`include_reasoning: false` on a server with a parser):
    # every chunk says "not reported", the role chunk before any id too (docs/protocol.md §3.4).
    ids_withheld: bool = False

    @property
    def reshapes_answer(self) -> bool:
        """A successful answer changes (error bodies and events are `error_params`' business)."""
        return bool(
            self.nvext_trio or self.nvext_prompt_ids or self.selectors or self.strip_vllm_ids or self.echo_prompts
        )

    @property
    def reshapes_response(self) -> bool:
        return self.reshapes_answer or bool(self.error_params)

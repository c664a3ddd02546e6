"""The Plan: what one request asked for, made by the request side (`inbound/`) and read by the
response side (`outbound/`) and the ASGI layer; nothing else passes between them."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from ..protocol import Dialect, Endpoint


@dataclass(frozen=True)
class Plan:
    """What to send upstream and how to reshape what comes back, for one request.

    Its members live in the instance's `__dict__` (no slots): a plan kept per reading of a request
    is copied with another body in two C calls (`inbound.request.plan`).
    """

    endpoint: Endpoint
    # The client gets vLLM's own placement of the ids (docs/protocol.md §1).
    vllm_placement: bool
    # The trio under `nvext` (docs/protocol.md §3.4): completion_token_ids, prompt_token_ids, kv_transfer_params.
    nvext_trio: bool
    # `nvext.prompt_token_ids` without the rest of the trio.
    nvext_prompt_ids: bool
    # Other selectors answered under `nvext` (NVEXT_ONLY_SELECTORS).
    nvext_only_selectors: frozenset[str]
    # The middleware turned `return_token_ids` on and the client must not see vLLM's copies.
    strip_vllm_ids: bool
    # A completions stream with `echo`: vLLM sends prompt ids by itself: leave those alone.
    vllm_sends_prompt_ids: bool
    # The middleware turned `return_token_ids` on for a completions `echo`: vLLM then drops the
    # echoed prompt from `text`, and the response side puts it back in front of each choice's first
    # text. One entry per prompt: its text, or its ids (the middleware has vLLM decode those, as vLLM
    # echoes them, before the request goes upstream); empty when nothing is to be put back.
    echo_prompts: tuple[str | tuple[int, ...], ...]
    # The client asked for logprobs (engine_data.completion_logprobs follows them).
    logprobs_requested: bool
    # The rewritten upstream body; None keeps the client's bytes.
    body: bytes | None
    # Extra request headers for vLLM (e.g. the data-parallel rank).
    headers: tuple[tuple[bytes, bytes], ...] = ()
    # What the client asked in and whether it streams: for the metrics.
    dialect: Dialect = Dialect.VLLM
    stream: bool = False
    # One prompt and n == 1: every chunk is about choice 0.
    single_choice: bool = True
    # Choices per prompt (vLLM's `n`): choice `i` answers prompt `i // n`.
    n: int = 1
    # A one-choice stream with `timing` or `engine_data`: vLLM reports its per-request metrics and
    # cached tokens on the usage chunk right after the finish chunk, which waits for it.
    finish_waits_for_usage: bool = False
    # The client sent a root `kv_transfer_params` (an orchestrator's prefill/decode handoff):
    # vLLM's root `kv_transfer_params` comes back at the root in every mode.
    kv_stays_at_root: bool = False
    # (vLLM's field, the client's field) for each vLLM field set from an nvext field: an error
    # vLLM raises about the former names the latter (docs/protocol.md §9).
    error_params: tuple[tuple[str, str], ...] = ()
    # A chat stream whose ids vLLM withholds (`include_reasoning: false` on a server with a parser):
    # every chunk says "not reported", the role chunk before any id too (docs/protocol.md §3.4).
    ids_withheld: bool = False
    # The operator captures this request (docs/capture.md): ids are on upstream whatever the client
    # asked, and the response side reports what it saw to the request's capture tap.
    capture: bool = False
    # The middleware turned vLLM's `logprobs` on for the capture tap (VLLM_NVEXT_CAPTURE_LOGPROBS) and the client
    # must not see them: each choice's `logprobs` goes back to null, what vLLM writes when not asked.
    strip_logprobs: bool = False
    # The stream comes from vLLM's Rust frontend (vllm-rs, behind `vllm-nvext proxy`), which leaves a key out
    # where Python vLLM writes null: vLLM's copies of the ids are then deleted, not set back to null
    # (`for_upstream`): the choices' `token_ids`, and the prompt's ids.
    stream_ids_absent: bool = False
    stream_prompt_ids_absent: bool = False

    # A successful answer changes (error bodies and events are `error_params`' business); set from the
    # members above when the plan is made, so reading it enters no function.
    reshapes_answer: bool = field(init=False, repr=False, compare=False)
    # The answer changes, successful or not.
    reshapes_response: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        answer = bool(
            self.nvext_trio
            or self.nvext_prompt_ids
            or self.nvext_only_selectors
            or self.strip_vllm_ids
            or self.echo_prompts
            or self.strip_logprobs
        )
        members = self.__dict__
        members["reshapes_answer"] = answer
        members["reshapes_response"] = answer or bool(self.error_params) or self.capture


# vllm-rs's chat stream writes its root `"prompt_token_ids":null` from 0.34 on; 0.33's leaves the key out
# (tests/fixtures/vllm-0.33-rust, vllm-0.34-rust: chat_stream_plain). Its completions streams leave it out.
_CHAT_PROMPT_IDS_NULL_FROM = (0, 34)
_VERSION = re.compile(r"(\d+)\.(\d+)")


def for_upstream(plan: Plan, rust_frontend_version: str | None) -> Plan:
    """`plan` for the server that answers it: behind `vllm-nvext proxy` in front of vllm-rs (its /version's
    `rust_frontend_version`), a stream whose ids the client gets without vLLM's copies has those keys deleted,
    as vllm-rs writes a stream that asked for no ids (docs/scaling-out.md, vLLM's Rust frontend)."""
    if rust_frontend_version is None or not plan.stream or not plan.strip_vllm_ids:
        return plan
    found = _VERSION.match(rust_frontend_version)
    older = found is not None and (int(found[1]), int(found[2])) < _CHAT_PROMPT_IDS_NULL_FROM
    prompt_absent = plan.endpoint is Endpoint.COMPLETIONS or older
    return dataclasses.replace(plan, stream_ids_absent=True, stream_prompt_ids_absent=prompt_absent)

"""The moves of ids and values between vLLM's placement and nvext's, shared by unary answers and stream chunks.

What vLLM reported (`reported_ids`, `prompt_ids_in`), what the middleware takes out of vLLM's places
(`take_kv`, `take_prompt_logprobs`, `take_routed_experts`), sets back to null (`strip_vllm_ids`) or puts
back (`put_back_echo`), and the final `nvext` object built from them in Dynamo's key order (`final_nvext`).
Pure: decoded JSON in, decoded JSON out (docs/protocol.md §1, §3).
"""

from __future__ import annotations

from typing import Any

from ..inbound.plan import Plan
from ..protocol import DETAILED_FINISH_REASON, PROMPT_LOGPROBS, ROUTED_EXPERTS, STOP_REASON, Endpoint
from .nvext_values import detailed_finish_reason


def reported_ids(choice: dict[str, Any]) -> list[int] | None:
    """A copy of a choice's generated ids; None where vLLM withheld them.

    vLLM writes `token_ids: null` under `return_token_ids` when it hides them on purpose
    (`include_reasoning: false` on a server with a reasoning or tool parser): "not reported",
    which the middleware never turns into "no tokens" (docs/protocol.md §3.4).
    """
    ids = choice.get("token_ids")
    return list(ids) if isinstance(ids, list) else None


def put_back_echo(choice: dict[str, Any], plan: Plan) -> bool:
    """Put the echoed prompt vLLM left out (Plan.echo_prompts) in front of the choice's text; True if done."""
    index = choice.get("index")
    text = choice.get("text")
    if not isinstance(index, int) or isinstance(index, bool) or not isinstance(text, str):
        return False
    prompt_index = index // plan.n
    if not 0 <= prompt_index < len(plan.echo_prompts):
        return False
    prompt = plan.echo_prompts[prompt_index]
    if not isinstance(prompt, str):
        return False  # not decoded (vLLM's /detokenize answered otherwise): the text as vLLM wrote it
    choice["text"] = prompt + text
    return True


def prompt_ids_in(obj: dict[str, Any], choice: dict[str, Any] | None, endpoint: Endpoint) -> Any:
    if endpoint is not Endpoint.COMPLETIONS:
        return obj.get("prompt_token_ids")
    return choice.get("prompt_token_ids") if choice is not None else None


def strip_vllm_ids(obj: dict[str, Any], choices: list[Any], plan: Plan) -> bool:
    """Set vLLM's copies back to null, or delete them where the upstream leaves the key out (vllm-rs's streams:
    `plan.stream_ids_absent`, `stream_prompt_ids_absent`); True if there was one."""
    stripped = False
    ids_absent, prompt_absent = plan.stream_ids_absent, plan.stream_prompt_ids_absent
    for choice in choices:
        if isinstance(choice, dict):
            stripped = _strip(choice, "token_ids", ids_absent) or stripped
            if plan.endpoint is Endpoint.COMPLETIONS and (prompt_absent or not plan.vllm_sends_prompt_ids):
                stripped = _strip(choice, "prompt_token_ids", prompt_absent) or stripped
    if plan.endpoint is not Endpoint.COMPLETIONS:
        stripped = _strip(obj, "prompt_token_ids", prompt_absent) or stripped
    return stripped


def strip_logprobs(choices: list[Any]) -> bool:
    """Set each choice's `logprobs` back to null, what vLLM writes when the client asked for none (the capture
    turned them on: `Plan.strip_logprobs`); True if there was one."""
    stripped = False
    for choice in choices:
        if isinstance(choice, dict):
            stripped = _strip(choice, "logprobs", False) or stripped
    return stripped


def _strip(owner: dict[str, Any], key: str, absent: bool) -> bool:
    """`owner[key]` deleted (`absent`) or set back to null; True if it changed."""
    if absent:
        return owner.pop(key, _GONE) is not _GONE
    if owner.get(key) is None:
        return False
    owner[key] = None
    return True


_GONE = object()


def take_prompt_logprobs(obj: dict[str, Any], choice: dict[str, Any], plan: Plan) -> Any:
    """vLLM's prompt_logprobs (root in chat, per choice in completions); moved out when selected."""
    owner = obj if plan.endpoint is not Endpoint.COMPLETIONS else choice
    value = owner.get("prompt_logprobs")
    if value is not None and PROMPT_LOGPROBS in plan.nvext_only_selectors:
        owner["prompt_logprobs"] = None
    return value


def take_kv(obj: dict[str, Any], plan: Plan) -> Any:
    """vLLM's kv_transfer_params for the trio; moved out of the root unless vLLM placement is on.

    A request that carried a root `kv_transfer_params` is an orchestrator's (a prefill/decode
    handoff): vLLM's answer to it stays at the root in every mode, where the orchestrator reads it.
    """
    kv = obj.get("kv_transfer_params")
    if kv is not None and plan.nvext_trio and not plan.vllm_placement and not plan.kv_stays_at_root:
        obj["kv_transfer_params"] = None
    return kv


def take_routed_experts(choice: dict[str, Any], plan: Plan) -> Any:
    value = choice.get("routed_experts")
    if value is not None and ROUTED_EXPERTS in plan.nvext_only_selectors and not plan.vllm_placement:
        choice["routed_experts"] = None
    return value


def final_nvext(
    plan: Plan,
    *,
    unary: bool,
    completion_ids: list[int] | None,
    prompt_ids: Any,
    kv: Any,
    timing_obj: dict[str, Any] | None,
    engine: dict[str, Any] | None,
    choice: dict[str, Any],
    prompt_logprobs: Any,
    routed_experts: Any,
) -> dict[str, Any]:
    """The `nvext` object of a unary answer or of a choice's finish chunk, in Dynamo's key order.

    Dynamo 1.6.1 writes, on a finish chunk: [worker_id, routed_experts,] timing, engine_data,
    stop_reason, detailed_finish_reason, completion_token_ids, prompt_token_ids, prompt_logprobs;
    unary: completion_token_ids first, then the same order. `kv_transfer_params`, which 1.6.1
    lacks, follows `completion_token_ids`, where the token-id trio places it (docs/protocol.md §3.4).
    """
    sel = plan.nvext_only_selectors
    nv: dict[str, Any] = {}
    if unary and plan.nvext_trio:
        nv["completion_token_ids"] = completion_ids
        if kv is not None:
            nv["kv_transfer_params"] = kv
    if ROUTED_EXPERTS in sel and routed_experts is not None:
        nv["routed_experts"] = routed_experts
    if timing_obj is not None:
        nv["timing"] = timing_obj
    if engine is not None:
        nv["engine_data"] = engine
    if STOP_REASON in sel and choice.get("stop_reason") is not None:
        nv["stop_reason"] = choice["stop_reason"]
    if DETAILED_FINISH_REASON in sel:
        reason = detailed_finish_reason(choice.get("finish_reason"))
        if reason is not None:
            nv["detailed_finish_reason"] = reason
    if not unary and plan.nvext_trio:
        nv["completion_token_ids"] = completion_ids
        if kv is not None:
            nv["kv_transfer_params"] = kv
    if (plan.nvext_trio or plan.nvext_prompt_ids) and prompt_ids is not None:
        nv["prompt_token_ids"] = prompt_ids
    if PROMPT_LOGPROBS in sel and prompt_logprobs is not None:
        nv["prompt_logprobs"] = prompt_logprobs
    return nv

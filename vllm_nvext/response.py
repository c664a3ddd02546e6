"""Pure response side: reshape vLLM's decoded unary bodies and stream chunks as a Plan says.

Bytes and SSE framing live in `stream.py`; this module only sees parsed JSON.

vLLM placement (PROTOCOL §1) is what vLLM writes; nvext placement (PROTOCOL §3) is a root
`nvext` object. Only what the middleware caused is removed: a vLLM copy is set back to
`null`, exactly what vLLM writes when `return_token_ids` is off.
"""

from __future__ import annotations

import time
from typing import Any

from .request import (
    DETAILED_FINISH_REASON,
    ENGINE_DATA,
    PROMPT_LOGPROBS,
    ROUTED_EXPERTS,
    STOP_REASON,
    TIMING,
    Endpoint,
    Plan,
)


class Clock:
    """When the middleware received the request: epoch ms for reporting, monotonic for spans."""

    __slots__ = ("received_ms", "_t0")

    def __init__(self) -> None:
        self.received_ms = int(time.time() * 1000)
        self._t0 = time.perf_counter()

    def elapsed_ms(self) -> float:
        return round((time.perf_counter() - self._t0) * 1000.0, 3)


def detailed_finish_reason(finish_reason: str | None, stop_reason: Any) -> str | None:
    """Dynamo's finer finish reason: an EOS token and a stop string/token both read `stop` in vLLM."""
    if finish_reason is None:
        return None
    if finish_reason == "stop":
        return "eos" if stop_reason is None else "stop"
    if finish_reason == "abort":
        return "cancelled"
    return str(finish_reason)


def _choice_logprobs(choice: dict[str, Any], endpoint: Endpoint) -> list[Any] | None:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    if endpoint is Endpoint.CHAT:
        content = lp.get("content")
        if not isinstance(content, list):
            return None
        return [c.get("logprob") if isinstance(c, dict) else None for c in content]
    values = lp.get("token_logprobs")
    return list(values) if isinstance(values, list) else None


def _prompt_ids(obj: dict[str, Any], choice: dict[str, Any] | None, endpoint: Endpoint) -> Any:
    if endpoint is Endpoint.CHAT:
        return obj.get("prompt_token_ids")
    return choice.get("prompt_token_ids") if choice is not None else None


def _strip_vllm_ids(obj: dict[str, Any], choices: list[Any], plan: Plan) -> bool:
    """Set vLLM's copies back to null; True if there was one."""
    stripped = False
    for choice in choices:
        if isinstance(choice, dict):
            if choice.get("token_ids") is not None:
                choice["token_ids"] = None
                stripped = True
            if plan.endpoint is Endpoint.COMPLETIONS and not plan.echo and choice.get("prompt_token_ids") is not None:
                choice["prompt_token_ids"] = None
                stripped = True
    if plan.endpoint is Endpoint.CHAT and obj.get("prompt_token_ids") is not None:
        obj["prompt_token_ids"] = None
        stripped = True
    return stripped


def _move_prompt_logprobs(obj: dict[str, Any], choice: dict[str, Any], plan: Plan) -> Any:
    owner = obj if plan.endpoint is Endpoint.CHAT else choice
    value = owner.get("prompt_logprobs")
    if value is not None:
        owner["prompt_logprobs"] = None
    return value


def _final_selectors(
    nv: dict[str, Any],
    obj: dict[str, Any],
    choice: dict[str, Any],
    plan: Plan,
    clock: Clock,
    ttft_ms: float | None,
) -> None:
    """Selectors that appear once, on the unary body or the chunk carrying finish_reason."""
    sel = plan.selectors
    if TIMING in sel:
        timing: dict[str, Any] = {"request_received_ms": clock.received_ms}
        if ttft_ms is not None:
            timing["ttft_ms"] = ttft_ms
        timing["total_time_ms"] = clock.elapsed_ms()
        nv["timing"] = timing
    if STOP_REASON in sel and choice.get("stop_reason") is not None:
        nv["stop_reason"] = choice["stop_reason"]
    if DETAILED_FINISH_REASON in sel:
        reason = detailed_finish_reason(choice.get("finish_reason"), choice.get("stop_reason"))
        if reason is not None:
            nv["detailed_finish_reason"] = reason
    if PROMPT_LOGPROBS in sel:
        value = _move_prompt_logprobs(obj, choice, plan)
        if value is not None:
            nv["prompt_logprobs"] = value
    if ROUTED_EXPERTS in sel and choice.get("routed_experts") is not None:
        nv["routed_experts"] = choice["routed_experts"]
        if not plan.vllm_ids:
            choice["routed_experts"] = None


def _engine_data(
    completion_ids: list[int], finished: bool, logprobs: list[Any] | None, prompt_ids: Any
) -> dict[str, Any]:
    data: dict[str, Any] = {"completion_token_ids": completion_ids, "finished": finished}
    if logprobs is not None and len(logprobs) == len(completion_ids):
        data["completion_logprobs"] = logprobs
    if prompt_ids is not None:
        data["prompt_token_ids"] = prompt_ids
    return data


def _place_kv(nv: dict[str, Any], obj: dict[str, Any], plan: Plan) -> None:
    kv = obj.get("kv_transfer_params")
    if kv is not None:
        nv["kv_transfer_params"] = kv
        if not plan.vllm_ids:
            obj["kv_transfer_params"] = None


def reshape_unary(obj: Any, plan: Plan, clock: Clock) -> bool:
    """Reshape a unary chat.completion / text_completion in place; False if left unchanged."""
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    prompt_ids = _prompt_ids(obj, choice, plan.endpoint)
    completion_ids = choice.get("token_ids")
    nv: dict[str, Any] = {}
    if plan.nvext_trio:
        nv["completion_token_ids"] = list(completion_ids or ())  # a copy: never aliased with vLLM's
        if prompt_ids is not None:
            nv["prompt_token_ids"] = prompt_ids
        _place_kv(nv, obj, plan)
    elif plan.nvext_prompt_ids and prompt_ids is not None:
        nv["prompt_token_ids"] = prompt_ids
    if ENGINE_DATA in plan.selectors:
        logprobs = _choice_logprobs(choice, plan.endpoint) if plan.logprobs else None
        nv["engine_data"] = _engine_data(list(completion_ids or ()), True, logprobs, prompt_ids)
    _final_selectors(nv, obj, choice, plan, clock, None)
    if plan.strip_vllm_ids:
        _strip_vllm_ids(obj, choices, plan)
    if nv:
        obj["nvext"] = nv
    return True


class ChunkReshaper:
    """Per-stream state for reshaping decoded `chat.completion.chunk` / streamed `text_completion` chunks.

    `stream.StreamReshaper` drives it; its byte-level shortcut for mid-stream deltas updates
    `ids` and `ttft_ms` itself, exactly as `reshape` would.
    """

    __slots__ = ("plan", "clock", "prompt_ids", "ids", "logprobs", "ttft_ms", "_finished", "engine")

    def __init__(self, plan: Plan, clock: Clock) -> None:
        self.plan = plan
        self.clock = clock
        self.prompt_ids: Any = None
        self.ids: list[int] = []  # every completion id so far (engine_data only)
        self.logprobs: list[Any] | None = [] if plan.logprobs else None
        self.ttft_ms: float | None = None
        self._finished = False
        self.engine = ENGINE_DATA in plan.selectors

    def reshape(self, obj: Any) -> bool:
        """Reshape one decoded chunk in place; False if it is to be forwarded as it came."""
        if not isinstance(obj, dict):
            return False
        plan = self.plan
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return self._error_event(obj)
        if not choices or not isinstance(choices[0], dict):
            return False  # usage-only chunk: never carries nvext (PROTOCOL §3)
        choice = choices[0]
        if self.prompt_ids is None:
            self.prompt_ids = _prompt_ids(obj, choice, plan.endpoint)
        delta = choice.get("token_ids")
        delta_ids = delta if isinstance(delta, list) else []
        if delta_ids and self.ttft_ms is None:
            self.ttft_ms = self.clock.elapsed_ms()
        engine = self.engine
        if engine:
            self.ids.extend(delta_ids)
            if self.logprobs is not None:
                chunk_lp = _choice_logprobs(choice, plan.endpoint)
                if chunk_lp is None and delta_ids:
                    self.logprobs = None  # counts can no longer align
                elif chunk_lp:
                    self.logprobs.extend(chunk_lp)
        finished = choice.get("finish_reason") is not None
        nv: dict[str, Any] = {}
        if plan.nvext_trio:
            nv["completion_token_ids"] = delta_ids
            if finished:
                if self.prompt_ids is not None:
                    nv["prompt_token_ids"] = self.prompt_ids
                _place_kv(nv, obj, plan)  # vLLM >= 0.33 sends it on the finish chunk
        elif plan.nvext_prompt_ids and finished and self.prompt_ids is not None:
            nv["prompt_token_ids"] = self.prompt_ids
        changed = False
        if finished and not self._finished:
            self._finished = True
            if engine:
                nv["engine_data"] = _engine_data(self.ids, True, self.logprobs, self.prompt_ids)
            _final_selectors(nv, obj, choice, plan, self.clock, self.ttft_ms)
            changed = True  # the final selectors may move values out of the chunk
        if plan.strip_vllm_ids and _strip_vllm_ids(obj, choices, plan):
            changed = True
        if nv:
            obj["nvext"] = nv
            changed = True
        return changed  # an untouched chunk goes out as vLLM wrote it, without a re-encode

    def _error_event(self, obj: dict[str, Any]) -> bool:
        """A mid-stream error: engine_data says the generation did not finish."""
        if "error" not in obj or self._finished or not self.engine:
            return False
        self._finished = True
        obj["nvext"] = {"engine_data": _engine_data(self.ids, False, self.logprobs, self.prompt_ids)}
        return True

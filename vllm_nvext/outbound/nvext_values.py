"""Dynamo's response values under `nvext`, as its vLLM worker and frontend write them.

`timing`, `engine_data` (with `kv_cache_hit`) and `detailed_finish_reason`, built from what vLLM
reports, and the clock the middleware measures with; `chunks.py` decides where they go.
"""

from __future__ import annotations

import time
from typing import Any


class Clock:
    """When the middleware received the request: epoch ms for reporting, monotonic for spans."""

    __slots__ = ("received_ms", "_t0")

    def __init__(self, received_s: float | None = None, t0: float | None = None) -> None:
        """`received_s` (`time.time()`) and `t0` (`time.perf_counter()`): both read when the request
        came, now when not given (the middleware reads them before the body, and builds the clock
        only for a response it reshapes)."""
        self.received_ms = int((time.time() if received_s is None else received_s) * 1000)
        self._t0 = time.perf_counter() if t0 is None else t0

    def elapsed_ms(self) -> float:
        """Milliseconds since the request arrived, at full precision (as Dynamo reports them)."""
        return (time.perf_counter() - self._t0) * 1000.0


def detailed_finish_reason(finish_reason: str | None) -> str | None:
    """Dynamo's finer finish reason, as Dynamo 1.6.1 reports it in front of a vLLM worker.

    vLLM reports an EOS token and a stop string/token alike as `stop`, and Dynamo's vLLM worker
    passes that on, so an EOS reads `stop` too (`eos` only comes from engines that say so).
    """
    if finish_reason is None:
        return None
    if finish_reason == "abort":
        return "cancelled"
    return str(finish_reason)


def _metric(metrics: Any, key: str) -> float | None:
    value = metrics.get(key) if isinstance(metrics, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def timing(clock: Clock, ttft_ms: float | None, metrics: Any = None) -> dict[str, Any]:
    """Dynamo's `timing` object, with only what was measured (never an invented value).

    - `request_received_ms`: the middleware's clock when the request arrived (epoch ms).
    - `prefill_wait_time_ms`, `prefill_time_ms`: vLLM's per-request metrics `queue_time_ms`
      and `time_to_first_token_ms` (scheduled to first token), when the server reports them
      (`--enable-per-request-metrics`).
    - `ttft_ms`: their sum when both are known (Dynamo's ttft is wait + prefill), else the
      middleware's clock at the first chunk that carried a token (streams).
    - `total_time_ms`: the middleware's clock when the answer (or this choice's finish chunk) left.
    """
    out: dict[str, Any] = {"request_received_ms": clock.received_ms}
    wait = _metric(metrics, "queue_time_ms")
    prefill = _metric(metrics, "time_to_first_token_ms")
    if wait is not None:
        out["prefill_wait_time_ms"] = wait
    if prefill is not None:
        out["prefill_time_ms"] = prefill
    if wait is not None and prefill is not None:
        out["ttft_ms"] = wait + prefill
    elif ttft_ms is not None:
        out["ttft_ms"] = ttft_ms
    out["total_time_ms"] = clock.elapsed_ms()
    return out


def kv_cache_hit(prompt_ids: Any, usage: Any) -> dict[str, int] | None:
    """`{prompt_tokens, reused_tokens}` from vLLM's cached-token count, when vLLM reports it.

    vLLM reports it as `usage.prompt_tokens_details.cached_tokens` with
    `--enable-prompt-tokens-details`; without it there is nothing to report.
    """
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if not isinstance(cached, int) or isinstance(cached, bool):
        return None
    if isinstance(prompt_ids, list):
        prompt_tokens = len(prompt_ids)
    else:
        prompt_tokens = usage.get("prompt_tokens")
        if not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool):
            return None
    return {"prompt_tokens": prompt_tokens, "reused_tokens": cached}


def engine_data(
    *,
    prompt_ids: Any,
    completion_ids: list[int] | None,
    finished: bool,
    logprobs: list[Any] | None,
    cache_hit: dict[str, int] | None = None,
    prompt_logprobs: Any = None,
    kv_transfer_params: Any = None,
    routed_experts: Any = None,
) -> dict[str, Any]:
    """Dynamo's vLLM-worker `engine_data`, keys in the order its worker writes them."""
    data: dict[str, Any] = {}
    if prompt_ids is not None:
        data["prompt_token_ids"] = prompt_ids
    if cache_hit is not None:
        data["kv_cache_hit"] = cache_hit
    if prompt_logprobs is not None:
        data["prompt_logprobs"] = prompt_logprobs
    if kv_transfer_params is not None:
        data["kv_transfer_params"] = kv_transfer_params
    if routed_experts is not None:
        data["routed_experts"] = routed_experts
    data["completion_token_ids"] = completion_ids  # None: vLLM did not report them (never `[]`)
    data["finished"] = finished
    aligned = completion_ids is not None and logprobs is not None and len(logprobs) == len(completion_ids)
    if logprobs and aligned and all(isinstance(v, (int, float)) for v in logprobs):
        data["completion_logprobs"] = logprobs  # only when aligned one to one with the ids, as Dynamo
    return data

"""A captured session as an ATIF trajectory (Harbor's Agent Trajectory Interchange Format, v1.4).

One turn is one `agent` step; its ids and logprobs go in the step's `metrics` (v1.3's
`completion_token_ids`, v1.4's `prompt_token_ids`), the rest of the turn in the step's `extra`.
The capture keeps ids, not text: a step's `message` (which ATIF requires) is "". Pure.
docs/capture.md "Reading it".
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

SCHEMA_VERSION = "ATIF-v1.4"
AGENT_NAME = "vllm-nvext"
try:
    VERSION = metadata.version("vllm-nvext")  # read once, at start-up
except metadata.PackageNotFoundError:
    VERSION = "unknown"
# The turn's keys that go to the step's `extra` (the ids, logprobs and model have their own places).
_EXTRA = (
    "index",
    "route",
    "request_id",
    "session_source",
    "parent_id",
    "agent_id",
    "finish_reason",
    "usage",
    "spans",
    "extends_previous",
    "break",
    "choices",
)


def trajectory(session_id: str, turns: Sequence[dict[str, Any]], version: str = VERSION) -> dict[str, Any]:
    """The ATIF document of a session's turns (at least one), None values left out as Harbor writes them."""
    models = [t["model"] for t in turns if t.get("model")]
    agent: dict[str, Any] = {"name": AGENT_NAME, "version": version}
    if models:
        agent["model_name"] = models[0]
    steps = [_step(n, turn) for n, turn in enumerate(turns, start=1)]
    totals: dict[str, Any] = {"total_steps": len(steps)}
    for total, key in (("total_prompt_tokens", "prompt_tokens"), ("total_completion_tokens", "completion_tokens")):
        counts = [s["metrics"][key] for s in steps if key in s.get("metrics", {})]
        if counts:
            totals[total] = sum(counts)
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": session_id,
        "agent": agent,
        "steps": steps,
        "final_metrics": totals,
    }


def _step(step_id: int, turn: dict[str, Any]) -> dict[str, Any]:
    step: dict[str, Any] = {
        "step_id": step_id,
        "timestamp": datetime.fromtimestamp(float(turn["time"]), timezone.utc).isoformat(),
        "source": "agent",
        "message": "",
    }
    if turn.get("model"):
        step["model_name"] = turn["model"]
    metrics = _metrics(turn)
    if metrics:
        step["metrics"] = metrics
    step["extra"] = {key: turn[key] for key in _EXTRA if turn.get(key) is not None}
    return step


def _metrics(turn: dict[str, Any]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    usage = turn.get("usage")
    if isinstance(usage, dict):
        # Chat and completions' names, else /v1/responses' (`input_tokens`, `output_tokens`, `input_tokens_details`).
        for key, other in (("prompt_tokens", "input_tokens"), ("completion_tokens", "output_tokens")):
            value = usage.get(key, usage.get(other))
            if isinstance(value, int):
                metrics[key] = value
        details = usage.get("prompt_tokens_details", usage.get("input_tokens_details"))
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            metrics["cached_tokens"] = details["cached_tokens"]
    for key in ("prompt_token_ids", "completion_token_ids"):
        if turn.get(key) is not None:
            metrics[key] = turn[key]
    logprobs = turn.get("logprobs")
    if logprobs is not None:
        if all(isinstance(v, (int, float)) for v in logprobs):
            metrics["logprobs"] = logprobs
        else:  # ATIF's are numbers: a list with a gap (a null) goes in the metrics' `extra`
            metrics["extra"] = {"logprobs": logprobs}
    return metrics

"""A captured session as an ATIF trajectory (Harbor's Agent Trajectory Interchange Format, v1.4).

One turn is one `agent` step; its ids and logprobs go in the step's `metrics` (v1.3's
`completion_token_ids`, v1.4's `prompt_token_ids`), the rest of the turn in the step's `extra`.
The capture keeps ids, not text: a step's `message` (which ATIF requires) is "". Pure.
docs/capture.md "Reading it".
"""

from __future__ import annotations

import json
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
    "group_id",
    "request_kind",
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
    steps = [step(n, turn) for n, turn in enumerate(turns, start=1)]
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


# Encoded piece by piece by the read API (capture/api.py): a list is handed to json this many values at a time, so no
# one call of json's C encoder runs for long, whatever a turn holds (a million ids).
ENCODE_SLICE = 16384


def encode(value: Any) -> str:
    """`json.dumps(value, separators=(",", ":"))`, the same text, each call of json's encoder bounded: dicts and
    lists are walked here, their numbers and strings encoded ENCODE_SLICE at a time."""
    if isinstance(value, dict):
        return "{" + ",".join(_dumps(str(k)) + ":" + encode(v) for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, (dict, list, tuple)) for v in value):
            return "[" + ",".join(encode(v) for v in value) + "]"
        parts = (_dumps(value[i : i + ENCODE_SLICE])[1:-1] for i in range(0, len(value), ENCODE_SLICE))
        return "[" + ",".join(parts) + "]"
    return _dumps(value)


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def document_head(session_id: str, model: str | None, version: str = VERSION) -> str:
    """The document's text up to its first step, as `trajectory` encodes it (`model`: the first a turn names)."""
    agent: dict[str, Any] = {"name": AGENT_NAME, "version": version}
    if model:
        agent["model_name"] = model
    head = {"schema_version": SCHEMA_VERSION, "session_id": session_id, "agent": agent}
    return encode(head)[:-1] + ',"steps":['


def document_tail(steps: int, totals: dict[str, int], next_index: int | None) -> str:
    """The text after the last step: `final_metrics` (`totals`: the sums of the steps that report each), and the page's
    `extra.next_index` where another page follows."""
    final: dict[str, Any] = {"total_steps": steps}
    for total, key in (("total_prompt_tokens", "prompt_tokens"), ("total_completion_tokens", "completion_tokens")):
        if key in totals:
            final[total] = totals[key]
    tail = '],"final_metrics":' + encode(final)
    if next_index is not None:
        tail += ',"extra":' + encode({"next_index": next_index})
    return tail + "}"


def step(step_id: int, turn: dict[str, Any]) -> dict[str, Any]:
    """One turn's `agent` step."""
    made: dict[str, Any] = {
        "step_id": step_id,
        "timestamp": datetime.fromtimestamp(float(turn["time"]), timezone.utc).isoformat(),
        "source": "agent",
        "message": "",
    }
    if turn.get("model"):
        made["model_name"] = turn["model"]
    metrics = _metrics(turn)
    if metrics:
        made["metrics"] = metrics
    made["extra"] = {key: turn[key] for key in _EXTRA if turn.get(key) is not None}
    return made


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

"""A captured session as an ATIF trajectory (Harbor's Agent Trajectory Interchange Format, v1.7).

One turn is one `agent` step; its ids and logprobs go in the step's `metrics` (v1.3's
`completion_token_ids`, v1.4's `prompt_token_ids`), the rest of the turn in the step's `extra`.
The capture keeps ids, not text: a step's `message` (which ATIF requires) is the decoded ids of the
turn's text spans where the server's tokenizer is at hand (`decode`), else "" (`reasoning_content`: the
reasoning spans'). The root trajectory holds the turns of the session's first agent (`agent_id`); each
other agent's turns are one trajectory of `subagent_trajectories` (v1.7). Pure. docs/capture.md "Trainer formats".
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

SCHEMA_VERSION = "ATIF-v1.7"
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
# The step metrics `final_metrics` sums, each under its total's name.
TOTALS = (
    ("total_prompt_tokens", "prompt_tokens"),
    ("total_completion_tokens", "completion_tokens"),
    ("total_cached_tokens", "cached_tokens"),
)
Decode = Callable[[Sequence[int]], str]


def trajectory_id(session_id: str, first_index: int) -> str:
    """The session's id for a document from its turn 0; `<session_id>@<first index>` for a later page."""
    return session_id if first_index == 0 else f"{session_id}@{first_index}"


def subagent_id(document_id: str, agent_id: str | None) -> str:
    """An embedded subagent's `trajectory_id`: `<document's trajectory_id>:<agent_id>` (unique in the array)."""
    return f"{document_id}:{agent_id or ''}"


def nesting(turn: dict[str, Any]) -> dict[str, str]:
    """How a session's thread nests in its run, by its first turn (docs/trainer-formats.md, Subagents): `group_id`,
    the run (Codex's `session-id`, Claude Code's session) where it is not the session itself, and
    `parent_session_id`, the session of the thread that spawned it (a Claude Code subagent's parent agent is the
    session `{group}:{parent}`, the main agent `{group}`; other harnesses' `parent_id` names the session)."""
    session, group, parent = turn.get("session_id"), turn.get("group_id"), turn.get("parent_id")
    made: dict[str, str] = {}
    if isinstance(group, str) and group != session:
        made["group_id"] = group
        if turn.get("session_source") == "x-claude-code-session-id" and turn.get("agent_id") is not None:
            made["parent_session_id"] = group if parent is None else f"{group}:{parent}"
            return made
    if isinstance(parent, str):
        made["parent_session_id"] = parent
    return made


def threads(turns: Sequence[dict[str, Any]]) -> tuple[list[int], dict[str | None, list[int]]]:
    """The positions of the root thread's turns (those of the first turn's `agent_id`), and of each other agent's
    (in the order they first appear)."""
    root_agent = turns[0].get("agent_id") if turns else None
    root: list[int] = []
    others: dict[str | None, list[int]] = {}
    for n, turn in enumerate(turns):
        agent = turn.get("agent_id")
        (root if agent == root_agent else others.setdefault(agent, [])).append(n)
    return root, others


def trajectory(
    session_id: str, turns: Sequence[dict[str, Any]], version: str = VERSION, decode: Decode | None = None
) -> dict[str, Any]:
    """The ATIF document of a session's turns (at least one), None values left out as Harbor writes them."""
    doc_id = trajectory_id(session_id, int(turns[0].get("index") or 0))
    root, others = threads(turns)
    doc = _thread(session_id, doc_id, [turns[n] for n in root], version, decode)
    if others:
        doc["subagent_trajectories"] = [
            _thread(session_id, subagent_id(doc_id, agent), [turns[n] for n in places], version, decode)
            for agent, places in others.items()
        ]
    if nested := nesting(turns[0]):
        doc["extra"] = nested
    return doc


def _thread(
    session_id: str, doc_id: str, turns: Sequence[dict[str, Any]], version: str, decode: Decode | None
) -> dict[str, Any]:
    models = [t["model"] for t in turns if t.get("model")]
    agent: dict[str, Any] = {"name": AGENT_NAME, "version": version}
    if models:
        agent["model_name"] = models[0]
    steps = [step(n, turn, decode) for n, turn in enumerate(turns, start=1)]
    totals: dict[str, int] = {}
    add_totals(totals, steps)
    return {
        "schema_version": SCHEMA_VERSION,
        "session_id": session_id,
        "trajectory_id": doc_id,
        "agent": agent,
        "steps": steps,
        "final_metrics": final_metrics(len(steps), totals),
    }


def add_totals(totals: dict[str, int], steps: Sequence[dict[str, Any]]) -> None:
    """Adds the steps' token counts to `totals` (keyed by the metric's name): only the counts a step reports."""
    for made in steps:
        for _, key in TOTALS:
            if key in made.get("metrics", {}):
                totals[key] = totals.get(key, 0) + made["metrics"][key]


def final_metrics(steps: int, totals: dict[str, int]) -> dict[str, Any]:
    final: dict[str, Any] = {"total_steps": steps}
    for total, key in TOTALS:
        if key in totals:
            final[total] = totals[key]
    return final


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


def document_head(session_id: str, doc_id: str, model: str | None, version: str = VERSION) -> str:
    """A trajectory's text up to its first step, as `trajectory` encodes it (`model`: the first its turns name)."""
    agent: dict[str, Any] = {"name": AGENT_NAME, "version": version}
    if model:
        agent["model_name"] = model
    head = {"schema_version": SCHEMA_VERSION, "session_id": session_id, "trajectory_id": doc_id, "agent": agent}
    return encode(head)[:-1] + ',"steps":['


def document_steps_end(steps: int, totals: dict[str, int]) -> str:
    """The text after a trajectory's last step: its `final_metrics` (`totals`: the sums of the steps that report
    each), the object left open (`subagent_trajectories` and `extra` may follow)."""
    return '],"final_metrics":' + encode(final_metrics(steps, totals))


def document_extra(next_index: int | None, nested: dict[str, str] | None = None) -> str:
    """The document's `extra` (how it nests: `nesting`; `next_index` where another page follows), and its end."""
    extra: dict[str, Any] = {**(nested or {}), **({} if next_index is None else {"next_index": next_index})}
    return ("," + '"extra":' + encode(extra) if extra else "") + "}"


def step(step_id: int, turn: dict[str, Any], decode: Decode | None = None) -> dict[str, Any]:
    """One turn's `agent` step (`decode`: the server's tokenizer, for its text)."""
    message, reasoning = _texts(turn, decode)
    made: dict[str, Any] = {
        "step_id": step_id,
        "timestamp": datetime.fromtimestamp(float(turn["time"]), timezone.utc).isoformat(),
        "source": "agent",
        "message": message,
    }
    if turn.get("model"):
        made["model_name"] = turn["model"]
    if reasoning:
        made["reasoning_content"] = reasoning
    metrics = _metrics(turn)
    if metrics:
        made["metrics"] = metrics
    if turn.get("route") != "/v1/responses":  # one request, one inference; a Responses turn may hold several rounds
        made["llm_call_count"] = 1
    made["extra"] = {key: turn[key] for key in _EXTRA if turn.get(key) is not None}
    return made


def _texts(turn: dict[str, Any], decode: Decode | None) -> tuple[str, str]:
    """The decoded ids of the turn's text spans and of its reasoning spans (all its ids for the text where no span
    was recorded); ("", "") without a tokenizer, or ids it does not hold."""
    ids = turn.get("completion_token_ids")
    if decode is None or not isinstance(ids, list) or not ids:
        return "", ""
    spans = turn.get("spans")
    try:
        if not isinstance(spans, list):
            return str(decode(ids)), ""
        parts: dict[str, list[str]] = {"text": [], "reasoning": []}
        for span in spans:
            if span.get("kind") in parts:
                parts[span["kind"]].append(str(decode(ids[span["start"] : span["end"]])))
        return "".join(parts["text"]), "".join(parts["reasoning"])
    except Exception:  # ids the tokenizer does not hold: the ids are in the metrics
        return "", ""


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

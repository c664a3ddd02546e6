"""A captured session as NeMo Gym's token records: `TokenEntry`, record schema 3, one JSON line per turn.

The record, `cum_len` and `digest` as NeMo Gym's `nemo_gym/token_id_capture/records.py` defines them
(NVIDIA-NeMo/Gym at 88b03e1657cd5ac04723c67b49ec1511baccfee5; docs/trainer-formats.md "NeMo Gym's TokenEntry"),
each line as its `TokenCaptureStore` writes one (compact, keys sorted, every field present). A turn is a record
only with its prompt ids, its generated ids and one logprob (a number) per generated id: the others are left out
and counted by reason (`Skipped`), never written with an empty or made-up list. Pure. docs/capture.md
"Trainer formats".
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

SCHEMA_VERSION = 3
DIGEST_VERSION = 1
DIGEST_DOMAIN = b"nemo-gym-tokens"
_U64 = 2**64
# Why a turn is no record (the keys of `Skipped.reasons`).
NO_IDS = "no_ids"  # its prompt or generated ids were not reported
NO_LOGPROBS = "no_logprobs"  # not one logprob (a number) per generated id: the request asked for none, or a gap


def encode_token_ids(ids: Sequence[int]) -> bytes:
    """Gym's `encode_token_ids`: the version byte, the count and each id as unsigned 64-bit big-endian integers;
    ValueError for an id outside 0 .. 2**64 - 1 (Gym refuses those too)."""
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < _U64:
            raise ValueError("token ids: expected integers from 0 to 2**64 - 1")
    count = len(ids).to_bytes(8, "big")
    return bytes([DIGEST_VERSION]) + count + b"".join(i.to_bytes(8, "big") for i in ids)


def compute_digest(ids: Sequence[int]) -> str:
    """Gym's `compute_digest`: sha256 of the domain and the ids' encoding, lowercase hex; of the domain alone for
    no ids."""
    digest = hashlib.sha256(DIGEST_DOMAIN)
    if ids:
        digest.update(encode_token_ids(ids))
    return digest.hexdigest()


@dataclass
class Skipped:
    """The turns that made no record, counted by reason (NO_IDS, NO_LOGPROBS)."""

    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, reason: str, count: int = 1) -> None:
        self.reasons[reason] = self.reasons.get(reason, 0) + count

    def merge(self, other: Skipped) -> None:
        for reason, count in other.reasons.items():
            self.add(reason, count)

    @property
    def total(self) -> int:
        return sum(self.reasons.values())

    def describe(self) -> str:
        """`2 without logprobs (one per generated id), 1 without ids`, for a message."""
        words = {NO_LOGPROBS: "without logprobs (one per generated id)", NO_IDS: "without prompt or generated ids"}
        return ", ".join(f"{n} {words[r]}" for r, n in sorted(self.reasons.items()))


def _why_not(turn: dict[str, Any]) -> str | None:
    prompt, generated, logprobs = turn.get("prompt_token_ids"), turn.get("completion_token_ids"), turn.get("logprobs")
    if not isinstance(prompt, list) or not isinstance(generated, list):
        return NO_IDS
    if not isinstance(logprobs, list) or len(logprobs) != len(generated):
        return NO_LOGPROBS
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in logprobs):
        return NO_LOGPROBS
    return None


def model_call_id(turn: dict[str, Any]) -> str:
    """vLLM's response id; on /v1/completions with the turn's index (one request's prompts share the id), and
    `turn-<index>` where no id was reported."""
    request_id = turn.get("request_id")
    if not request_id:
        return f"turn-{turn['index']}"
    return f"{request_id}:{turn['index']}" if turn.get("route") == "/v1/completions" else str(request_id)


@dataclass
class _Made:
    call_id: str
    agent_id: str | None
    cumulative: list[int]  # prompt + generated ids: what a child's prompt starts with


class Rollout:
    """The records of one session's turns, told in turn order (`add`), and the turns left out (`skipped`).
    `first_page` False (turns read from a later index): an agent's first record may continue a turn of an earlier
    page, so it is `unresolved` (`not_attempted`), never `root`."""

    def __init__(self, session_id: str, first_page: bool = True) -> None:
        self.session_id, self.first_page = session_id, first_page
        self.skipped = Skipped()
        self._earlier: list[_Made] = []
        self._unrecorded: set[str | None] = set()  # the agents with a turn that made no record
        self._previous: _Made | None = None  # the record of the turn just before, if it made one

    def add(self, turn: dict[str, Any]) -> dict[str, Any] | None:
        """The turn's record (its keys sorted, as Gym writes them), or None: counted in `skipped`."""
        why = _why_not(turn)
        if why is not None:
            self.skipped.add(why)
            self._unrecorded.add(turn.get("agent_id"))
            self._previous = None
            return None
        prompt, generated = turn["prompt_token_ids"], turn["completion_token_ids"]
        this = _Made(model_call_id(turn), turn.get("agent_id"), [*prompt, *generated])
        parent, resolution, reason = _parent(
            this, prompt, turn, self._previous, self._earlier, self.first_page, self._unrecorded
        )
        self._earlier.append(this)
        self._previous = this
        return {
            "continuation_context_digest": "",
            "continuation_context_len": 0,
            "continuation_fingerprint": "",
            "created_at": float(turn["time"]),
            "cum_len": len(this.cumulative),
            "digest": compute_digest(this.cumulative),
            "fingerprint_version": None,
            "generation_log_probs": [float(v) for v in turn["logprobs"]],
            "generation_token_ids": generated,
            "model": turn.get("model") or "",
            "model_call_id": this.call_id,
            "output_items": [],
            "parent_call_id": parent,
            "parent_resolution": resolution,
            "parent_resolution_reason": reason,
            "prompt_token_ids": prompt,
            "rollout_id": self.session_id,
            "routed_experts": None,
            "schema_version": SCHEMA_VERSION,
            "token_item_index": None,
        }


def records(
    session_id: str, turns: Iterable[dict[str, Any]], first_page: bool = True
) -> tuple[list[dict[str, Any]], Skipped]:
    """The session's records in turn order, and the turns left out (`Rollout`)."""
    rollout = Rollout(session_id, first_page)
    made = [record for record in map(rollout.add, turns) if record is not None]
    return made, rollout.skipped


def _parent(
    this: _Made,
    prompt: list[int],
    turn: dict[str, Any],
    previous: _Made | None,
    earlier: list[_Made],
    first_page: bool,
    unrecorded: set[str | None],
) -> tuple[str | None, str, str]:
    """(`parent_call_id`, `parent_resolution`, `parent_resolution_reason`): the latest earlier record of the same
    agent whose ids the prompt starts with (the store's `extends_previous` says the turn just before is one); else
    `root` for the agent's first turn, `unresolved` otherwise (`not_attempted` where a turn before it is not here:
    on an earlier page, or no record)."""
    if previous is not None and turn.get("extends_previous") is True and previous.agent_id == this.agent_id:
        return previous.call_id, "resolved", ""
    mine = [m for m in earlier if m.agent_id == this.agent_id]
    for candidate in reversed(mine):
        n = len(candidate.cumulative)
        if n <= len(prompt) and prompt[:n] == candidate.cumulative:
            return candidate.call_id, "resolved", ""
    if this.agent_id in unrecorded or (not mine and not first_page):
        return None, "unresolved", "not_attempted"
    return (None, "root", "") if not mine else (None, "unresolved", "no_match")


def line(record: dict[str, Any]) -> str:
    """One record as NeMo Gym's store writes it (orjson, sorted keys, compact, UTF-8), with its newline."""
    return json.dumps(record, separators=(",", ":"), sort_keys=True, ensure_ascii=False) + "\n"

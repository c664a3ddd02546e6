"""One recorded request (a "turn") of a captured session, and where its prompt leaves the previous turn's ids.

Pure: no I/O. The tap (the request path) builds a `Turn` without `index`, `extends_previous` or
`break_`; the store assigns those in its writer, off the event loop (docs/capture.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# How many ids each side of a break `PrefixBreak` keeps (the window starts at max(0, index - BREAK_CONTEXT)).
BREAK_CONTEXT = 8

# A session id as the store keys it and the read API's path takes it: a key in the store, never a file name.
# Not dots alone: `.` and `..` are path segments a client resolves away (RFC 3986), so the read API could never
# be asked for such a session.
SESSION_ID_MAX = 256
_SESSION_ID = re.compile(rf"(?!\.*\Z)[A-Za-z0-9._:~-]{{1,{SESSION_ID_MAX}}}")


def valid_session_id(value: str) -> bool:
    """1 to SESSION_ID_MAX characters of letters, digits and `._:~-` (URL-safe unescaped), not dots alone."""
    return _SESSION_ID.fullmatch(value) is not None


# Request kinds that are no turn of their thread's conversation (Codex's `request_kind`): a compaction's prompt is a
# summary, a prewarm's or a memory request's is no continuation. Such a turn starts a new segment: never compared with
# the turn before it, nor the turn after it with it (`extends_previous: null`), never continued ids (docs/capture.md).
SIDE_KINDS = frozenset({"prewarm", "compaction", "memory"})

ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"})

# The server's tokenizer, ids to text with special tokens as they are (the break's texts): None without one.
Decode = Callable[[Sequence[int]], str]


@dataclass(frozen=True, slots=True)
class PrefixBreak:
    """Where a prompt stops repeating the previous turn's ids (prompt and completion) of its session.

    `previous_ids` / `prompt_ids` are the ids around the break in each, from max(0, index - BREAK_CONTEXT)
    to index + BREAK_CONTEXT; the texts are those ids decoded, None where no tokenizer was at hand.
    """

    index: int
    previous_ids: list[int]
    prompt_ids: list[int]
    previous_text: str | None = None
    prompt_text: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "previous_ids": list(self.previous_ids),
            "prompt_ids": list(self.prompt_ids),
            "previous_text": self.previous_text,
            "prompt_text": self.prompt_text,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PrefixBreak:
        return cls(
            index=_int(d, "index"),
            previous_ids=_ids(d, "previous_ids") or [],
            prompt_ids=_ids(d, "prompt_ids") or [],
            previous_text=_opt_str(d, "previous_text"),
            prompt_text=_opt_str(d, "prompt_text"),
        )


def _text(decode: Decode | None, ids: Sequence[int]) -> str | None:
    if decode is None:
        return None
    try:
        return str(decode(ids))
    except Exception:  # ids the tokenizer does not hold: the ids alone say where
        return None


def prefix_break(previous: Sequence[int], prompt: Sequence[int], decode: Decode | None = None) -> PrefixBreak | None:
    """None when `prompt` starts with `previous`; else where they first differ (the prompt's length when
    the prompt is shorter and a prefix of `previous`), with the texts of the ids around it where `decode` is
    the server's tokenizer."""
    n = len(previous)
    if len(prompt) >= n and list(prompt[:n]) == list(previous):
        return None
    index = next((i for i, (a, b) in enumerate(zip(previous, prompt, strict=False)) if a != b), min(n, len(prompt)))
    start = max(0, index - BREAK_CONTEXT)
    previous_ids, prompt_ids = (
        list(previous[start : index + BREAK_CONTEXT]),
        list(prompt[start : index + BREAK_CONTEXT]),
    )
    return PrefixBreak(index, previous_ids, prompt_ids, _text(decode, previous_ids), _text(decode, prompt_ids))


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session, as the read API shows it (docs/capture.md "What is recorded").

    A value not reported is None (JSON null), never an empty list or string. `break_` is the JSON
    key "break". `index`, `extends_previous` and `break_` are the store's to set (`placed`).
    """

    session_id: str
    route: str
    request_id: str | None  # None: the answer carried no `id` (an upstream that is not vLLM)
    time: float
    session_source: str
    model: str | None = None
    parent_id: str | None = None
    agent_id: str | None = None
    group_id: str | None = None
    request_kind: str | None = None
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float | None] | None = None
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    spans: list[dict[str, Any]] | None = None
    choices: list[dict[str, Any]] | None = None
    index: int | None = None
    extends_previous: bool | None = None
    break_: PrefixBreak | None = None
    # The server's tokenizer where it has one (the break's texts, when the store places the turn); not recorded.
    decode: Decode | None = field(default=None, compare=False, repr=False)

    def placed(self, index: int, previous: Turn | None) -> Turn:
        """This turn as the store keeps it: its position in the session and how it follows `previous`."""
        extends: bool | None = None
        found: PrefixBreak | None = None
        if previous is not None and (self.request_kind in SIDE_KINDS or previous.request_kind in SIDE_KINDS):
            previous = None  # a side request starts a new segment (`SIDE_KINDS`)
        if previous is not None and self.prompt_token_ids is not None and previous.prompt_token_ids is not None:
            before = previous.prompt_token_ids + (previous.completion_token_ids or [])
            found = prefix_break(before, self.prompt_token_ids, self.decode)
            extends = found is None
        return dataclasses.replace(self, index=index, extends_previous=extends, break_=found, decode=None)

    def problem(self) -> str | None:
        """Why no store can keep this turn as the read API shows it (the field and what it expects: never a value),
        None when one can: every value reads back through `from_json` (the store places a session's next turn by
        it), every choice's ids are integers and its logprobs finite numbers, and the rest encodes as JSON (no NaN
        or infinity). The long lists are checked item by item, not encoded twice: the writer encodes them once.
        An upstream that is not vLLM can answer anything (docs/capture.md, the store)."""
        try:
            Turn.from_json(self.to_json())
            if not math.isfinite(self.time):
                raise ValueError("time: expected a finite number")
            _finite("logprobs", self.logprobs)
            rest: list[Any] = [self.usage, self.spans]
            for choice in self.choices or ():
                if not isinstance(choice, Mapping):
                    raise ValueError("choices: expected objects")
                ids = choice.get("completion_token_ids")
                if ids is not None and not (isinstance(ids, list) and all(type(i) is int for i in ids)):
                    raise ValueError("choices: completion_token_ids: expected a list of integers or null")
                _finite("choices: logprobs", choice.get("logprobs"))
                rest.append({k: v for k, v in choice.items() if k not in ("completion_token_ids", "logprobs")})
        except ValueError as exc:
            return str(exc)
        except (OverflowError, RecursionError):  # a number no float holds, JSON nested past the interpreter's depth
            return "time, usage, spans or choices: a value no store can hold"
        try:
            json.dumps(rest, allow_nan=False)
        except (ValueError, TypeError, RecursionError):
            return "usage, spans or choices: a value JSON cannot hold (NaN, an infinity, or no JSON value)"
        return None

    def to_json(self) -> dict[str, Any]:
        """The read API's shape of one turn (CAPTURE contract: these keys, in this order)."""
        return {
            "index": self.index,
            "session_id": self.session_id,
            "route": self.route,
            "request_id": self.request_id,
            "time": self.time,
            "model": self.model,
            "parent_id": self.parent_id,
            "agent_id": self.agent_id,
            "group_id": self.group_id,
            "session_source": self.session_source,
            "request_kind": self.request_kind,
            "prompt_token_ids": self.prompt_token_ids,
            "completion_token_ids": self.completion_token_ids,
            "logprobs": self.logprobs,
            "finish_reason": self.finish_reason,
            "usage": self.usage,
            "spans": self.spans,
            "extends_previous": self.extends_previous,
            "break": None if self.break_ is None else self.break_.to_json(),
            "choices": self.choices,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Turn:
        """The inverse of `to_json`; ValueError naming the key for a value of the wrong type."""
        brk = d.get("break")
        if brk is not None and not isinstance(brk, Mapping):
            raise ValueError("break: expected an object or null")
        extends = d.get("extends_previous")
        if extends is not None and not isinstance(extends, bool):
            raise ValueError("extends_previous: expected true, false or null")
        when = d.get("time")
        if isinstance(when, bool) or not isinstance(when, (int, float)):
            raise ValueError("time: expected a number")
        return cls(
            session_id=_str(d, "session_id"),
            route=_str(d, "route"),
            request_id=_opt_str(d, "request_id"),
            time=float(when),
            session_source=_str(d, "session_source"),
            model=_opt_str(d, "model"),
            parent_id=_opt_str(d, "parent_id"),
            agent_id=_opt_str(d, "agent_id"),
            group_id=_opt_str(d, "group_id"),
            request_kind=_opt_str(d, "request_kind"),
            prompt_token_ids=_ids(d, "prompt_token_ids"),
            completion_token_ids=_ids(d, "completion_token_ids"),
            logprobs=_opt_list(d, "logprobs"),
            finish_reason=_opt_str(d, "finish_reason"),
            usage=_opt_dict(d, "usage"),
            spans=_opt_list(d, "spans"),
            choices=_opt_list(d, "choices"),
            index=None if d.get("index") is None else _int(d, "index"),
            extends_previous=extends,
            break_=None if brk is None else PrefixBreak.from_json(brk),
        )


def _str(d: Mapping[str, Any], key: str) -> str:
    value = d.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected a string")
    return value


def _opt_str(d: Mapping[str, Any], key: str) -> str | None:
    return None if d.get(key) is None else _str(d, key)


def _int(d: Mapping[str, Any], key: str) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected an integer")
    return value


def _ids(d: Mapping[str, Any], key: str) -> list[int] | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"{key}: expected a list of integers or null")
    return value


def _finite(name: str, values: object) -> None:
    """ValueError naming `name` unless `values` is None or a list of integers, finite floats and nulls."""
    if values is None:
        return
    if not isinstance(values, list) or not all(
        v is None or type(v) is int or (type(v) is float and math.isfinite(v)) for v in values
    ):
        raise ValueError(f"{name}: expected finite numbers or null")


def _opt_list(d: Mapping[str, Any], key: str) -> list[Any] | None:
    value = d.get(key)
    if value is not None and not isinstance(value, list):
        raise ValueError(f"{key}: expected a list or null")
    return value


def _opt_dict(d: Mapping[str, Any], key: str) -> dict[str, Any] | None:
    value = d.get(key)
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{key}: expected an object or null")
    return value

"""One choice's record in a captured turn (its ids, logprobs, finish reason and spans), and what kind of item
each chunk's or message's ids became (docs/capture.md, spans). Pure; capture/tap.py feeds it."""

from __future__ import annotations

from typing import Any

TEXT, REASONING, TOOL_CALL = "text", "reasoning", "tool_call"
# A chunk whose delta shows nothing (a parser holding back ids: a tool call's opening tag, its arguments' pieces,
# `</think>`): its ids belong to the span of what shows next, or of what showed last where nothing follows.
HELD = "held"


class Choice:
    """One choice's record: its ids, logprobs and spans so far."""

    __slots__ = ("ids", "logprobs", "finish_reason", "spans", "withheld", "reported", "tools", "prompt", "held")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] | None = []
        self.finish_reason: str | None = None
        self.spans: list[dict[str, Any]] = []
        self.withheld = False  # some chunk said `token_ids: null`: the ids are not reported
        self.reported = False  # some chunk or body reported ids (a list): never, and they are not reported either
        self.tools: dict[int, tuple[str | None, str | None]] = {}  # tool call index -> (id, name)
        self.prompt: list[int] | None = None  # the prompt it answers, where the choice says (completions)
        self.held: int | None = None  # where the ids of chunks that showed nothing begin, until one shows

    def add(self, ids: list[int] | None, logprobs: list[float] | None, kind: str | None, tool: int | None) -> None:
        if ids is None:
            self.withheld = True
            return
        self.reported = True
        start = len(self.ids)
        self.ids += ids
        if self.logprobs is not None:
            if logprobs is None or len(logprobs) != len(ids):
                self.logprobs = None if ids else self.logprobs  # counts can no longer align
            else:
                self.logprobs += logprobs
        if ids and kind == HELD:
            self.held = start if self.held is None else self.held
        elif ids and kind is not None:
            start, self.held = (start if self.held is None else self.held), None
            call_id, name = self.tools.get(tool, (None, None)) if tool is not None else (None, None)
            last = self.spans[-1] if self.spans else None
            if last is not None and last["kind"] == kind and last["end"] == start and last["_tool"] == tool:
                last["end"] = len(self.ids)
            else:
                self.spans.append({"kind": kind, "start": start, "end": len(self.ids), "tool_call_id": call_id,
                                   "name": name, "_tool": tool})  # fmt: skip

    @property
    def known(self) -> bool:
        """Whether the ids are the choice's: reported, and never withheld (else `null`, never `[]`)."""
        return self.reported and not self.withheld

    def fields(self) -> dict[str, Any]:
        spans = [{k: v for k, v in span.items() if k != "_tool"} for span in self.spans]
        for span, raw in zip(spans, self.spans, strict=True):
            if raw["_tool"] is not None:  # an id or name that came after the span began
                span["tool_call_id"], span["name"] = self.tools.get(raw["_tool"], (None, None))
        if self.held is not None:  # nothing showed after them: the last span's (a closing tag, EOS), else text
            if spans and spans[-1]["end"] == self.held:
                spans[-1]["end"] = len(self.ids)
            else:
                spans.append({"kind": TEXT, "start": self.held, "end": len(self.ids), "tool_call_id": None,
                              "name": None})  # fmt: skip
        return {
            "completion_token_ids": self.ids if self.known else None,
            "logprobs": self.logprobs if self.known and self.ids else None,
            "finish_reason": self.finish_reason,
            "spans": spans if self.known else None,
        }


def token_logprobs(choice: dict[str, Any]) -> list[float] | None:
    """The sampled tokens' logprobs of a chat (`content` entries) or completions (`token_logprobs`) choice."""
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    content = lp.get("content")
    values: Any = lp.get("token_logprobs")
    if isinstance(content, list):
        values = [e.get("logprob") if isinstance(e, dict) else None for e in content]
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
        return None
    return [float(v) for v in values]


def response_logprobs(response: dict[str, Any]) -> list[float] | None:
    """The sampled tokens' logprobs of a Responses object: its output texts' `logprobs` entries, in order; None
    where none carries them (vLLM computed none) or an entry holds no number."""
    values: list[Any] = []
    for item in response.get("output") or ():
        for part in (item.get("content") if isinstance(item, dict) else None) or ():
            entries = part.get("logprobs") if isinstance(part, dict) and part.get("type") == "output_text" else None
            if isinstance(entries, list):
                values += [e.get("logprob") if isinstance(e, dict) else None for e in entries]
    if not values or not all(isinstance(v, (int, float)) for v in values):
        return None
    return [float(v) for v in values]


def delta_kind(delta: Any, choice: dict[str, Any]) -> tuple[str | None, int | None, Any]:
    """What a chunk's ids became: (kind, tool call index, the tool call) by the delta that carried them."""
    if not isinstance(delta, dict):
        return (TEXT, None, None) if isinstance(choice.get("text"), str) else (None, None, None)
    calls = delta.get("tool_calls")
    if isinstance(calls, list) and calls and isinstance(calls[-1], dict):
        index = calls[-1].get("index")
        return TOOL_CALL, index if isinstance(index, int) else 0, calls[-1]
    if delta.get("reasoning") or delta.get("reasoning_content"):
        return REASONING, None, None
    return (TEXT if delta.get("content") else HELD), None, None


def message_kinds(message: Any) -> list[str]:
    """The kinds of item a unary chat message holds, in the order vLLM generates them."""
    if not isinstance(message, dict):
        return []
    kinds = []
    if message.get("reasoning") or message.get("reasoning_content"):
        kinds.append(REASONING)
    if message.get("content"):
        kinds.append(TEXT)
    if message.get("tool_calls"):
        kinds.append(TOOL_CALL)
    return kinds

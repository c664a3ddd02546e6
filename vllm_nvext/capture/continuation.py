"""A prefix that never drifts: a captured session's next prompt continues the ids its last turn was served
(`VLLM_NVEXT_CONTINUE_IDS=1`, docs/capture.md "Continuing the ids").

The pure part: `continued` splices the previous turn's prompt and completion ids with vLLM's own
rendering of the new request, or says why it does not; `Memory` keeps each session's last turns (per
API-server process); `Continuation` is what one request carries, in the context variable `TURN`, from
the middleware's tap (capture/tap.py) to vLLM's renderer (capture/render_hook.py).
"""

from __future__ import annotations

import contextvars
import re
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

SESSIONS = 4096  # sessions remembered per process; the least recently used one goes first
TURNS_PER_SESSION = 4  # the last turns of one session a new request may continue (newest first)
MAX_IDS = 64 * 1024 * 1024  # ids remembered in all (4 bytes each): past it, the oldest sessions go
# The routes whose requests vLLM renders with the chat template (completions takes its prompt as sent).
ROUTES = frozenset({"/v1/chat/completions", "/v1/responses", "/v1/messages"})

# The close of a reasoning block at the end of a text, as the reasoning parsers' models write it (`</think>`,
# `</seed:think>`, `[/THINK]`, `◁/think▷`): the only head of a served answer a client's answer may leave out.
_REASONING_CLOSE = re.compile(r"(?:</[\w:.-]*think[\w:.-]*>|\[/think\]|◁/think▷)\Z", re.IGNORECASE)

# Why a request was not continued (the log says it; the turn's `break` says where its prompt parts).
HISTORY, ANSWER, NO_MARKER, LENGTH = "history", "answer", "no_marker", "length"


Ids = Sequence[int]


class Served(Protocol):
    """A turn as the memory reads it when it ends: a finished one (`Kept`), or its tap (settled). `served()`:
    (prompt ids, choice 0's completion ids, whether it had n > 1 choices, vLLM's own rendering of its
    prompt where the prompt was continued, else None)."""

    def served(self) -> tuple[Ids | None, Ids | None, bool, Ids | None]: ...


@dataclass(slots=True)
class Kept:
    """A finished turn, compactly (`Served`)."""

    prompt: array[int]
    completion: array[int]
    several: bool
    rendered: array[int] | None = None

    def served(self) -> tuple[Ids | None, Ids | None, bool, Ids | None]:
        return self.prompt, self.completion, self.several, self.rendered

    def size(self) -> int:
        return len(self.prompt) + len(self.completion) + len(self.rendered or ())


@dataclass(slots=True)
class Continuation:
    """One captured request's door to its session's last turns: newest first; `used` once vLLM rendered it."""

    previous: list[Served] = field(default_factory=list)
    used: bool = False
    outcome: str | None = None  # "continued", or why not (HISTORY, ANSWER, ...)
    rendered: list[int] | None = None  # vLLM's own rendering, where the prompt ids were continued


# The process's memory of sessions: None while the setting is off (`enable`, at start-up).
MEMORY: Memory | None = None

TURN: contextvars.ContextVar[Continuation | None] = contextvars.ContextVar("vllm_nvext_continuation", default=None)


def _ids(values: Sequence[int] | None) -> array[int] | None:
    try:
        return None if values is None else array("i", values)
    except (TypeError, OverflowError):
        return None


class Memory:
    """Each session's last turns, in this process (never read back from the store). Event-loop only."""

    def __init__(self, sessions: int = SESSIONS, max_ids: int = MAX_IDS) -> None:
        self._sessions: OrderedDict[tuple[str, str | None], deque[Any]] = OrderedDict()
        self._limit = sessions
        self._max_ids = max_ids
        self._size = 0

    def begin(self, key: tuple[str, str | None], tap: Served) -> Continuation:
        """The request `tap` records joins its session: it gets the session's last turns that had ended (never
        one still running: its answer is not whole, docs/capture.md "Overlapping turns"), and is the newest."""
        turns = self._sessions.get(key)
        if turns is None:
            turns = self._sessions[key] = deque()
        self._sessions.move_to_end(key)
        found = Continuation([turn for turn in reversed(turns) if isinstance(turn, Kept)])
        if len(turns) == TURNS_PER_SESSION:
            self._drop(turns.popleft())
        turns.append(tap)
        while len(self._sessions) > self._limit:
            _, gone = self._sessions.popitem(last=False)
            for turn in gone:
                self._drop(turn)
        return found

    def settle(self, key: tuple[str, str | None], tap: Served) -> None:
        """`tap`'s answer is over: kept compactly (or forgotten when it reported no ids)."""
        turns = self._sessions.get(key)
        if turns is None or tap not in turns:
            return
        prompt, completion, several, rendered = tap.served()
        kept_prompt, kept_completion = _ids(prompt), _ids(completion)
        at = turns.index(tap)
        if kept_prompt is None or kept_completion is None:
            del turns[at]
            return
        kept = turns[at] = Kept(kept_prompt, kept_completion, several, _ids(rendered))
        self._size += kept.size()
        while self._size > self._max_ids and self._sessions:
            _, gone = self._sessions.popitem(last=False)
            for turn in gone:
                self._drop(turn)

    def forget(self, session_id: str) -> None:
        """The session's turns, every agent's, leave the memory: it was deleted (`DELETE /v1/nvext/sessions/{id}`)."""
        for key in [k for k in self._sessions if k[0] == session_id]:
            for turn in self._sessions.pop(key):
                self._drop(turn)

    def _drop(self, turn: Any) -> None:
        if isinstance(turn, Kept):
            self._size -= turn.size()

    def __len__(self) -> int:
        return len(self._sessions)


def enable() -> Memory:
    """Turn the memory on in this process (idempotent); the taps then mark their requests (capture/tap.py)."""
    global MEMORY
    if MEMORY is None:
        MEMORY = Memory()
    return MEMORY


def _last(ids: Sequence[int], stops: Collection[int]) -> int:
    """The position after the last stop id in `ids` (0: none)."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] in stops:
            return i + 1
    return 0


def _first(ids: Sequence[int], stops: Collection[int], start: int) -> int | None:
    for i in range(start, len(ids)):
        if ids[i] in stops:
            return i
    return None


def _plain(text: str) -> str:
    """A text as it is compared with what the client sent back: no whitespace, no U+FFFD."""
    return "".join(c for c in text if not c.isspace() and c != "\ufffd")


def continued(
    prompt: Ids,
    completion: Ids,
    rendered: Ids,
    stops: Collection[int],
    decode: Callable[[Ids], str],
    previous_rendered: Ids | None = None,
) -> tuple[list[int] | None, str]:
    """The ids vLLM gets for `rendered` (its own rendering of the new request), continuing the previous turn,
    whose prompt ids were `prompt` (vLLM's own rendering of them `previous_rendered`, where they were
    continued themselves) and whose answer was `completion`.

    (ids, "continued") when the new history begins with what that turn was served: `rendered` repeats
    vLLM's rendering of its prompt up to the generation prompt (the ids after its last stop id), and
    then renders, as text, the generation prompt and an answer the client sent back unchanged
    (`decode(completion)`, as the client got it: whitespace and U+FFFD aside; an answer whose reasoning
    the template dropped counts too, the part dropped ending with a reasoning's closing tag), closed by a
    stop id. The ids are then the previous prompt + its completion (less a trailing stop id, which the
    template re-adds) + `rendered` from that closing stop id on. (None, why) otherwise: vLLM's own rendering stands.
    """
    base = prompt if previous_rendered is None else previous_rendered
    start = _last(base, stops)
    if list(rendered[:start]) != list(base[:start]):  # start 0: a template that closes no message before
        return None, HISTORY  # an earlier message, the tools or the system prompt changed
    close = _first(rendered, stops, start)
    if close is None:
        return None, NO_MARKER
    answer = completion[:-1] if completion and completion[-1] in stops else completion
    generation = decode(base[start:])
    if list(rendered[start : len(base)]) == list(base[start:]):
        sent = decode(rendered[len(base) : close])  # the usual case: no id across the boundary
    else:
        text = decode(rendered[start:close])
        if not text.startswith(generation):
            return None, HISTORY  # not the assistant's answer that comes next
        sent = text[len(generation) :]
    ours, theirs = _plain(decode(answer)), _plain(sent)
    # Another answer than the one served falls back, a tail of it too (the model would see the head the client
    # left out) unless that head is reasoning, closed by its tag: what a template leaves out of an earlier answer.
    if ours != theirs and not (
        theirs and ours.endswith(theirs) and _REASONING_CLOSE.search(ours, 0, len(ours) - len(theirs))
    ):
        return None, ANSWER
    return [*prompt, *answer, *rendered[close:]], "continued"

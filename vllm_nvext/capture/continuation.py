"""A prefix that never drifts: a captured session's next prompt continues the ids its last turn was served
(`VLLM_NVEXT_CONTINUE_IDS=1`, docs/capture.md "Continuing the ids").

The pure part: `continued` splices the previous turn's prompt and completion ids with vLLM's own
rendering of the new request, or says why it does not, and names the texts the client may have got for
the answer (whether the client sent one of them back is vLLM's rendering's to say: capture/render_hook.py);
`Memory` keeps each session's last turns (per API-server process); `Continuation` is what one request
carries, in the context variable `TURN`, from the middleware's tap (capture/tap.py) to vLLM's renderer
(capture/render_hook.py).
"""

from __future__ import annotations

import contextvars
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

# Why a request was not continued (the log says it; the turn's `break` says where its prompt parts).
HISTORY, ANSWER, NO_MARKER, LENGTH = "history", "answer", "no_marker", "length"


Ids = Sequence[int]


class Served(Protocol):
    """A turn as the memory reads it when it ends: a finished one (`Kept`), or its tap (settled). `served()`:
    (prompt ids, choice 0's completion ids, whether it had n > 1 choices, vLLM's own rendering of its
    prompt where the prompt was continued, else None, how many messages vLLM rendered its prompt from, else
    None)."""

    def served(self) -> tuple[Ids | None, Ids | None, bool, Ids | None, int | None]: ...


@dataclass(slots=True)
class Kept:
    """A finished turn, compactly (`Served`)."""

    prompt: array[int]
    completion: array[int]
    several: bool
    rendered: array[int] | None = None
    messages: int | None = None

    def served(self) -> tuple[Ids | None, Ids | None, bool, Ids | None, int | None]:
        return self.prompt, self.completion, self.several, self.rendered, self.messages

    def size(self) -> int:
        return len(self.prompt) + len(self.completion) + len(self.rendered or ())


@dataclass(slots=True)
class Continuation:
    """One captured request's door to its session's last turns: newest first; `used` once vLLM rendered it."""

    previous: list[Served] = field(default_factory=list)
    used: bool = False
    outcome: str | None = None  # "continued", or why not (HISTORY, ANSWER, ...)
    rendered: list[int] | None = None  # vLLM's own rendering, where the prompt ids were continued
    messages: int | None = None  # how many messages vLLM rendered this request's prompt from


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
        prompt, completion, several, rendered, messages = tap.served()
        kept_prompt, kept_completion = _ids(prompt), _ids(completion)
        at = turns.index(tap)
        if kept_prompt is None or kept_completion is None:
            del turns[at]
            return
        kept = turns[at] = Kept(kept_prompt, kept_completion, several, _ids(rendered), messages)
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


def served_texts(text: str) -> tuple[str, ...]:
    """The texts a client may have got for an answer whose ids decode to `text`: `text`, and where it ends in
    U+FFFD, `text` without them (vLLM's incremental detokenizer holds back the bytes of a character not whole
    when the answer ends: one cut by `max_tokens`)."""
    held = text.rstrip("\ufffd")
    return (text,) if held == text else (text, held)


@dataclass(frozen=True, slots=True)
class Splice:
    """The ids a continued request gets, if the client sent the previous answer back as it was served: one of
    `texts` (`served_texts`), in the message `continued` found it in (which vLLM's rendering decides)."""

    ids: list[int]
    texts: tuple[str, ...]


def continued(
    prompt: Ids,
    completion: Ids,
    rendered: Ids,
    stops: Collection[int],
    decode: Callable[[Ids], str],
    previous_rendered: Ids | None = None,
) -> tuple[Splice | None, str]:
    """The ids vLLM gets for `rendered` (its own rendering of the new request), continuing the previous turn,
    whose prompt ids were `prompt` (vLLM's own rendering of them `previous_rendered`, where they were
    continued themselves) and whose answer was `completion`.

    (Splice, "continued") when the new history begins with what that turn was served: `rendered` repeats
    vLLM's rendering of its prompt up to the generation prompt (the ids after its last stop id), then the
    generation prompt, then an answer closed by a stop id. The ids are then the previous prompt + its
    completion (less a trailing stop id, which the template re-adds) + `rendered` from that closing stop id
    on; they stand only where the answer the client sent back renders, by vLLM's own template and tokenizer,
    to exactly the ids one of `Splice.texts` renders to (render_hook.renders_as_served): never a comparison
    of ours. (None, why) otherwise: vLLM's own rendering stands.
    """
    base = prompt if previous_rendered is None else previous_rendered
    start = _last(base, stops)
    if list(rendered[:start]) != list(base[:start]):  # start 0: a template that closes no message before
        return None, HISTORY  # an earlier message, the tools or the system prompt changed
    close = _first(rendered, stops, start)
    if close is None:
        return None, NO_MARKER
    answer = completion[:-1] if completion and completion[-1] in stops else completion
    if list(rendered[start : len(base)]) != list(base[start:]) and not decode(rendered[start:close]).startswith(
        decode(base[start:])  # an id across the boundary of the generation prompt and the answer
    ):
        return None, HISTORY  # not the assistant's answer that comes next
    return Splice([*prompt, *answer, *rendered[close:]], served_texts(decode(answer))), "continued"

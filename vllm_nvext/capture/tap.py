"""The capture tap: one per captured request, told what the answer carried on its way past, and at its
end the recorded turn handed to the sink (docs/capture.md).

Pure but for the sink's `submit` (which never blocks and never raises: capture/store.py). Fed the
decoded objects the response side already reads (a chat or completions body, a Responses object, the
chat answer behind /v1/messages) before anything is taken out of them for the client; a chat or
completions stream's body messages as vLLM sent them (`stream_bytes`), which it frames and decodes in
bulk (every STREAM_READ_BYTES, and at the end, after the client has the last byte), not chunk by chunk
on the way: the client's bytes take the stream's byte-level path meanwhile (docs/capture.md, Cost).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import _json
from ..outbound.sse import EventFramer, data_payload
from . import continuation
from .choice import TEXT, TOOL_CALL, Choice, delta_kind, message_kinds, response_logprobs, token_logprobs
from .keys import SessionKey, header_key, session_key, side_request
from .record import Turn

logger = logging.getLogger("vllm_nvext")

STREAM_READ_BYTES = 256 * 1024  # a stream's bytes held before they are read (bounds a long stream's memory)


class Sink(Protocol):
    def submit(self, turn: Any) -> None: ...


def _guarded(read: Callable[[Collector, Any], None]) -> Callable[[Collector, Any], None]:
    """A tap's reading of a decoded answer, never raising (the client's answer is vLLM's whatever the tap makes
    of it): after a failure, the turn holds what was read before it, incomplete (`Collector._break`)."""

    @functools.wraps(read)
    def guarded(self: Collector, obj: Any) -> None:
        if self.broken:
            return
        try:
            read(self, obj)
        except Exception:
            self._break()

    return guarded


class Collector:
    """What one captured request reports; `finish` hands its turn to the sink, once."""

    __slots__ = ("sink", "route", "key", "time", "request_id", "model", "prompt", "usage", "_choices", "_done",
                 "reported", "spans_known", "_held", "_held_bytes", "_framer", "joined", "continuation",
                 "broken")  # fmt: skip

    def __init__(self, sink: Sink, route: str, key: SessionKey, arrived: float | None = None) -> None:
        self.sink = sink
        self.route = route
        self.key = key
        self.time = time.time() if arrived is None else arrived
        self.request_id: str | None = None
        self.model: str | None = None
        self.prompt: list[int] | None = None
        self.usage: Any = None
        self._choices: dict[int, Choice] = {}
        self._done = False
        self.reported = False  # an answer was seen (an error is not a turn)
        self.spans_known = True  # False: the route reports no per-item ids (docs/capture.md)
        self._held: list[bytes] = []  # a stream's body messages not read yet (`stream_bytes`)
        self._held_bytes = 0
        self._framer: EventFramer | None = None
        self.joined: tuple[str, str | None] | None = None  # its session's key in continuation.MEMORY
        self.continuation: continuation.Continuation | None = None  # what vLLM's renderer did with it
        self.broken = False  # a chunk the tap failed on ended the recorded turn there (`_guarded`)

    @classmethod
    def of(
        cls,
        sink: Sink | None,
        route: str,
        headers: Any,
        data: Any,
        arrived: float,
        body_keys: bool = False,
        url_session: str | None = None,
    ) -> Collector | None:
        """The tap of one request (None: capture is off), keyed by its session (capture/keys.py): the URL's
        (`url_session`), else its ASGI headers', else its body's as read (`data`) where the operator lets body keys
        name sessions (`body_keys`). A side request (a compaction, ...) never joins its session's continuation."""
        if sink is None:
            return None
        key = header_key(headers, url_session)
        if key.session_id is None and body_keys:
            found = session_key((), data)
            key = key._replace(session_id=found.session_id, source=found.source)
        tap = cls(sink, route, key, arrived)
        memory = continuation.MEMORY
        joins = memory is not None and route in continuation.ROUTES and not side_request(key.request_kind)
        if memory is not None and joins and key.session_id is not None:
            # VLLM_NVEXT_CONTINUE_IDS: vLLM's renderer, in this request's context, reads the session's last turns.
            tap.joined = (key.session_id, key.agent_id)
            tap.continuation = memory.begin(tap.joined, tap)
            continuation.TURN.set(tap.continuation)
        return tap

    def _root(self, obj: dict[str, Any]) -> None:
        self.reported = True
        if self.request_id is None and isinstance(obj.get("id"), str):
            self.request_id = obj["id"]
        if self.model is None and isinstance(obj.get("model"), str):
            self.model = obj["model"]
        if obj.get("usage") is not None:
            self.usage = obj["usage"]

    def _choice(self, index: Any) -> Choice:
        index = index if isinstance(index, int) and not isinstance(index, bool) else 0
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = Choice()
        return state

    def _choice_prompt(self, state: Choice, choice: dict[str, Any]) -> None:
        """A completions choice's own prompt ids (the turn's are the first reported)."""
        prompt = choice.get("prompt_token_ids")
        if isinstance(prompt, list):
            if state.prompt is None:
                state.prompt = prompt
            if self.prompt is None:
                self.prompt = prompt

    def stream_bytes(self, body: bytes) -> None:
        """One body message of a chat or completions stream, as vLLM sent it: held, read in bulk. Never raises."""
        if self.broken:
            return
        self._held.append(body)
        self._held_bytes += len(body)
        if self._held_bytes >= STREAM_READ_BYTES:
            self._read_stream()

    def _read_stream(self) -> None:
        """`_read_held`, never raising: the answer's bytes are the client's whatever the tap makes of them."""
        try:
            self._read_held()
        except Exception:  # never the answer's failure: the turn ends where the tap stopped reading
            self._break()

    def _break(self) -> None:
        """The recorded turn ends here, incomplete: no finish reason, never continued (docs/capture.md)."""
        logger.exception("vllm-nvext could not read a captured answer; its turn ends here")
        self.broken = True
        self._held, self._held_bytes, self._framer = [], 0, None
        for state in self._choices.values():
            state.finish_reason = None
            state.withheld = state.withheld or not state.ids  # none read: not reported (null, never [])

    def _read_held(self) -> None:
        """Every complete `data:` event held so far, decoded and told to `chunk` in order (a partial one waits)."""
        held, self._held, self._held_bytes = self._held, [], 0
        if not held:
            return
        framer = self._framer
        if framer is None:
            framer = self._framer = EventFramer()
        for event in framer.feed(held[0] if len(held) == 1 else b"".join(held)):
            span = data_payload(event)  # single-line `data:` events: what the stream path decodes
            if span is None:
                continue
            try:
                obj = _json.loads(event[span[0] : span[1]])
            except (ValueError, RecursionError):
                continue  # not JSON ([DONE] among them), or too deep to decode: the client gets it as it came
            self.chunk(obj)
            if self.broken:
                return

    @_guarded
    def chunk(self, obj: Any) -> None:
        """One decoded chat or completions stream chunk, as vLLM sent it."""
        if not isinstance(obj, dict) or "error" in obj:
            return
        self._root(obj)
        choices = obj.get("choices")
        if self.prompt is None and isinstance(obj.get("prompt_token_ids"), list):
            self.prompt = obj["prompt_token_ids"]
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            state = self._choice(choice.get("index"))
            self._choice_prompt(state, choice)  # completions: per choice
            delta = choice.get("delta")
            kind, tool, call = delta_kind(delta, choice)
            if call is not None:
                known = state.tools.get(tool, (None, None))  # type: ignore[arg-type]
                function = call.get("function") if isinstance(call.get("function"), dict) else {}
                state.tools[tool] = (  # type: ignore[index]
                    call.get("id") if isinstance(call.get("id"), str) else known[0],
                    function.get("name") if isinstance(function.get("name"), str) else known[1],
                )
            if "token_ids" in choice:
                ids = choice["token_ids"]
                state.add(ids if isinstance(ids, list) else None, token_logprobs(choice), kind, tool)
            if isinstance(choice.get("finish_reason"), str):
                state.finish_reason = choice["finish_reason"]

    @_guarded
    def body(self, obj: Any) -> None:
        """A decoded unary chat or completions body, as vLLM sent it: one span per item it holds."""
        if not isinstance(obj, dict) or "error" in obj:
            return
        self._root(obj)
        if isinstance(obj.get("prompt_token_ids"), list):
            self.prompt = obj["prompt_token_ids"]
        choices = obj.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            state = self._choice(choice.get("index"))
            self._choice_prompt(state, choice)
            ids = choice.get("token_ids")
            message = choice.get("message")
            calls = message.get("tool_calls") if isinstance(message, dict) else None
            # A unary body says which items came out, not which ids made each: one span, of the one kind
            # when there is one kind of item (docs/capture.md, what is exact).
            kinds = message_kinds(message) if isinstance(message, dict) else ([TEXT] if "text" in choice else [])
            tool = 0 if kinds == [TOOL_CALL] else None
            if tool is not None and isinstance(calls, list) and len(calls) == 1 and isinstance(calls[0], dict):
                function = calls[0].get("function") if isinstance(calls[0].get("function"), dict) else {}
                state.tools[0] = (calls[0].get("id"), (function or {}).get("name"))
            state.add(ids if isinstance(ids, list) else None, token_logprobs(choice),
                      kinds[0] if len(kinds) == 1 else None, tool)  # fmt: skip
            if isinstance(choice.get("finish_reason"), str):
                state.finish_reason = choice["finish_reason"]
        if isinstance(choices, list) and any(
            isinstance(c, dict) and len(message_kinds(c.get("message"))) > 1 for c in choices
        ):
            self.spans_known = False

    @_guarded
    def response(self, obj: Any) -> None:
        """A Responses object with vLLM's `input_messages` / `output_messages` (the ids of each round)."""
        if not isinstance(obj, dict):
            return
        self._root(obj)
        self.spans_known = False  # the ids come per round, not per item
        inputs, outputs = obj.get("input_messages"), obj.get("output_messages")
        if isinstance(inputs, list) and inputs and isinstance(inputs[0], dict):
            tokens = inputs[0].get("tokens")
            self.prompt = tokens if isinstance(tokens, list) else None
        state = self._choice(0)
        if isinstance(outputs, list):
            state.logprobs = None
            for entry in outputs[::2]:  # completions at even positions (agent.responses.response_ids)
                tokens = entry.get("tokens") if isinstance(entry, dict) else None
                state.add(tokens if isinstance(tokens, list) else None, None, None, None)
            # The output texts' logprobs (asked by the client or VLLM_NVEXT_CAPTURE_LOGPROBS), one per id or none.
            logprobs = response_logprobs(obj)
            state.logprobs = logprobs if logprobs is not None and len(logprobs) == len(state.ids) else None
        else:
            state.withheld = True
        details = obj.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        state.finish_reason = reason if isinstance(reason, str) else obj.get("status")

    def served(self) -> tuple[list[int] | None, list[int] | None, bool, list[int] | None, int | None]:
        """What this turn was served so far (continuation.Served): a stream's held bytes read first."""
        self._read_stream()
        first = self._choices.get(0)
        ids = None if first is None or first.withheld or self.broken else first.ids  # a broken turn: never continued
        turn = self.continuation
        rendered, messages = (None, None) if turn is None else (turn.rendered, turn.messages)
        return self.prompt, ids, len(self._choices) > 1, rendered, messages

    def finish(self) -> None:
        """The turn, to the sink: once, and only for an answer that was seen."""
        self._read_stream()  # first: what the continuation memory settles and the turn are the whole stream
        if self.joined is not None and continuation.MEMORY is not None:
            continuation.TURN.set(None)
            continuation.MEMORY.settle(self.joined, self)
            self.joined = self.continuation = None  # the memory keeps the turn; nothing holds older ones
        if self._done or not self.reported:
            return
        self._done = True
        try:
            for turn in self.turns():
                self.sink.submit(turn)
        except Exception:  # the sink never raises; a turn that cannot be made is dropped, never the answer
            logger.exception("vllm-nvext could not record a captured turn")

    def fields(self, group: dict[int, Choice] | None = None, prompt: list[int] | None = None) -> dict[str, Any]:
        """The turn's fields as the read API writes them (capture/record.py's Turn), less what the store adds;
        `group`: of a completions batch, the choices that answer one prompt (`prompt`), else all of them."""
        choices = self._choices if group is None else group
        lead = 0 if group is None else min(group)
        first = choices.get(lead) or Choice()
        choice = first.fields()
        if not self.spans_known:
            choice["spans"] = None
        others = [{"index": i, **c.fields()} for i, c in sorted(choices.items()) if i != lead]
        if not self.spans_known:
            for other in others:
                other["spans"] = None
        key = self.key
        request_id = self.request_id
        return {
            "session_id": key.session_id if key.session_id is not None else request_id,
            "route": self.route,
            "request_id": request_id,
            "time": self.time,
            "model": self.model,
            "parent_id": key.parent_id,
            "agent_id": key.agent_id,
            "group_id": key.group_id,
            "session_source": key.source,
            "request_kind": key.request_kind,
            "prompt_token_ids": self.prompt if group is None else prompt,
            **choice,
            "usage": self.usage,
            "choices": others or None,
        }

    def turn(self) -> Turn:
        return Turn(**self.fields(), decode=getattr(self.sink, "decode", None))

    def turns(self) -> list[Turn]:
        """The turn, or of a /v1/completions batch of prompts one turn per prompt, each with the choices that
        answer it (docs/capture.md), in the order of their first choice."""
        groups: dict[tuple[int, ...] | None, dict[int, Choice]] = {}
        for index, state in sorted(self._choices.items()):
            key = None if state.prompt is None or state.prompt == self.prompt else tuple(state.prompt)
            groups.setdefault(key, {})[index] = state
        if len(groups) < 2:
            return [self.turn()]
        decode = getattr(self.sink, "decode", None)
        return [
            Turn(**self.fields(group, self.prompt if key is None else list(key)), decode=decode)
            for key, group in groups.items()
        ]

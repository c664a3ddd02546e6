"""A stream's splice: the bytes vLLM writes around every mid-stream delta, learned from one delta.

`stream.StreamReshaper` learns one from the delta that arms a stream and keeps it only if it
reproduces, byte for byte, what the byte-level path made of that delta; the `send` handed to vLLM
(`kernels.python_stream_send`, `_speedups.StreamSend`) then serves the deltas it fits. On the compiled
path `_speedups.learn_splice` learns and checks it, with `learn_splice` as its oracle
(tests/unit/test_stream_send.py). Nothing here knows ASGI.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

_FINISH_KEY = b'"finish_reason":'
_JSON_AT = len(b"data: ")  # where the chunk's JSON object starts
_CHUNK_END = len(b"}\n\n")  # the chunk object's closing brace and the event's end
_ID_BYTES = b"0123456789,"
_NVEXT_IDS = b',"nvext":{"completion_token_ids":'
_LIST_END = ord("]")
# A delta's text (one JSON string's bytes) a splice serves is one a decode and orjson's encode give back
# byte for byte: no raw byte below 0x20 (a line end neither), no raw quote, valid UTF-8, every backslash
# the start of one of the escapes orjson writes (`\"` `\\` `\b` `\f` `\n` `\r` `\t`, and `\u00xx` in lowercase
# for another byte below 0x20), read from the string's start. So a text whose last backslash starts no
# escape (the quote after it would be escaped) is refused; one ending in an escaped backslash is not.
# `_SUSPECT`: a byte that needs a closer look.
_SUSPECT = re.compile(rb'[\x00-\x1f"\\\x80-\xff]')
_KEPT = re.compile(rb'(?:[^\x00-\x1f"\\]|\\[\\"bfnrt]|\\u00(?:0[0-7bef]|1[0-9a-f]))*')
_QUOTED = re.compile(rb'[\x00-\x1f"\\]')  # none: only UTF-8 to check


def kept_text(event: bytes, start: int, end: int) -> bool:
    """`event[start:end]`, a JSON string's bytes, is a text a splice serves (a decode writes it back as it is)."""
    if _SUSPECT.search(event, start, end) is None:
        return True
    return _written_back(event, start, end, _QUOTED, _KEPT)


def _written_back(event: bytes, start: int, end: int, escaped: re.Pattern[bytes], kept: re.Pattern[bytes]) -> bool:
    """`event[start:end]` (where a suspect byte was found) is valid UTF-8 and, if `escaped` finds a byte
    that needs it, all of it is what `kept` matches: kept_text's and kept_json's common last steps."""
    if escaped.search(event, start, end) is not None and kept.fullmatch(event, start, end) is None:
        return False
    try:
        event[start:end].decode()
    except UnicodeDecodeError:
        return False
    return True


# The same for JSON's bytes from outside a string to outside a string (quotes structural or escaped).
_SUSPECT_JSON = re.compile(rb"[\x00-\x1f\\\x80-\xff]")
_ESCAPED = re.compile(rb"[\x00-\x1f\\]")  # none: only UTF-8 to check
_KEPT_JSON = re.compile(rb'(?:[^\x00-\x1f\\]|\\[\\"bfnrt]|\\u00(?:0[0-7bef]|1[0-9a-f]))*')


def kept_json(event: bytes, start: int, end: int) -> bool:
    """`event[start:end]`, JSON's bytes between two places outside a string, holds only strings a decode
    writes back as they are (no raw byte below 0x20, valid UTF-8, only the escapes orjson writes)."""
    if _SUSPECT_JSON.search(event, start, end) is None:
        return True
    return _written_back(event, start, end, _ESCAPED, _KEPT_JSON)


# Where the text of a delta starts: chat's delta content (or reasoning) and completions' text.
_TEXT_KEYS = (b'"delta":{"content":"', b'"delta":{"reasoning_content":"', b'"delta":{"reasoning":"', b'"text":"')


class Splice:
    """The bytes vLLM writes around every mid-stream delta of a stream, learned from one delta.

    A delta it serves is `prefix` + the text (one JSON string's bytes, one `kept_text` accepts) +
    `head` + the ids (`[digits and commas]`) + `tail`. Such a delta has the
    learned delta's structure with another text and other ids, so the general path would give it
    the bytes `render` gives (for the valid JSON vLLM writes). `StreamReshaper` arms one only
    after `render` reproduced, byte for byte, what the general path made of the delta it was
    learned from; `kernels.python_stream_send` and the compiled `_speedups.StreamSend` serve the
    same deltas with the same checks.
    """

    __slots__ = ("prefix", "head", "tail", "strip", "trio", "mid", "finish_head")

    def __init__(
        self, prefix: bytes, head: bytes, tail: bytes, mid: bytes, finish_head: bytes | None, strip: bool, trio: bool
    ) -> None:
        self.prefix = prefix
        self.head = head
        self.tail = tail
        # What follows the ids' place: null (strip), the tail up to the chunk's closing brace,
        # and the nvext key (trio); rendered as event[:start or end] + mid [+ ids + "}}\n\n"] (_splice_parts).
        self.mid = mid
        self.finish_head = finish_head  # the bytes before a finish reason (finish.finish_chunk); None: not known
        self.strip = strip  # vLLM's copy of the ids goes back to null
        self.trio = trio  # the ids go into the chunk's nvext, at the end of the chunk

    def locate(self, event: bytes) -> int:
        """Where the ids of a delta this splice serves start; -1 for any other event."""
        prefix, tail = self.prefix, self.tail
        if not (event.startswith(prefix) and event.endswith(tail)):
            return -1
        end = len(event) - len(tail)
        start = event.rfind(b"[")  # the tail holds none
        head = start - len(self.head)
        if (
            head < len(prefix)
            or not event.startswith(self.head, head)
            or not kept_text(event, len(prefix), head)
            or event[end - 1] != _LIST_END
            or event[start + 1 : end - 1].strip(_ID_BYTES)
        ):
            return -1
        return start

    def render(self, event: bytes, start: int) -> bytes:
        """The client's bytes for a delta whose ids start at `start` (see `locate`)."""
        end = len(event) - len(self.tail)
        if self.trio:
            return b"".join((event[:start] if self.strip else event[:end], self.mid, event[start:end], b"}}\n\n"))
        return event[:start] + self.mid if self.strip else event


# The parts of a `Splice`, as `learn_splice` returns them: prefix, head, tail, mid, finish_head.
SpliceParts = tuple[bytes, bytes, bytes, bytes, "bytes | None"]
# What learns the splice a delta teaches (`learn_splice`, or its compiled twin `_speedups.learn_splice`: the
# `learn_splice` of `kernels.Kernels`): (event, start, end, strip, trio, out) -> parts or None.
Learner = Callable[[bytes, int, int, bool, bool, bytes], "SpliceParts | None"]


class FinishArm(NamedTuple):
    """What serves choice 0's finish chunk by `finish.finish_chunk`'s bytes (`StreamReshaper.arm_parts`)."""

    head: bytes  # the armed splice's bytes before a finish reason (`Splice.finish_head`)
    root_end: int  # where `choices`' first element starts
    record: Callable[[bytes, int, int], bytes | None]  # `ChunkReshaper.finish_first_choice`: its nvext, or None


class SpliceArm(NamedTuple):
    """What the send handed to vLLM is armed with (`StreamReshaper.arm_parts`): a splice's parts as `Splice`
    holds them, what a served delta's ids are reported to, the root of a usage chunk that goes out as it
    came (b"": none does) and what serves choice 0's finish chunk (None: none is)."""

    prefix: bytes
    head: bytes
    tail: bytes
    mid: bytes
    strip: bool
    trio: bool
    on_ids: Callable[[bytes, int, int], None] | None
    usage_root: bytes
    finish: FinishArm | None


def learn_splice(event: bytes, start: int, end: int, strip: bool, trio: bool, out: bytes) -> SpliceParts | None:
    """The parts of the splice the delta `event` (ids at event[start:end]) teaches, only if that splice
    locates the delta's ids at `start` and renders `out` (what the byte-level path made of the delta) byte
    for byte; None: not armed. `_speedups.learn_splice` gives the same: tests/unit/test_stream_send.py."""
    splice = checked_splice(event, start, end, strip, trio, out)
    if splice is None:
        return None
    return splice.prefix, splice.head, splice.tail, splice.mid, splice.finish_head


def checked_splice(event: bytes, start: int, end: int, strip: bool, trio: bool, out: bytes) -> Splice | None:
    """`learn_splice` as the `Splice` the pure-Python path arms."""
    parts = _splice_parts(event, start, end, strip, trio)
    if parts is None:
        return None
    splice = Splice(*parts, strip, trio)
    if splice.locate(event) != start or splice.render(event, start) != out:
        return None
    return splice


def _splice_parts(event: bytes, start: int, end: int, strip: bool, trio: bool) -> SpliceParts | None:
    """A splice's parts for a delta whose ids sit at event[start:end]; None if its text is not found."""
    for key in _TEXT_KEYS:
        at = event.find(key, _JSON_AT, start)
        if at >= 0:
            break
    else:
        return None
    text = at + len(key)
    close = text  # the text's closing quote: the first quote not escaped
    while True:
        close = event.find(b'"', close, start)
        if close < 0:
            return None
        backslashes = close - text - len(event[text:close].rstrip(b"\\"))
        if backslashes % 2 == 0:
            break
        close += 1
    if b"[" in event[end:]:
        return None  # the ids are found as the last list of the event
    head, tail = event[close:start], event[end:]
    null = b"null" if strip else b""
    mid = null + tail[:-_CHUNK_END] + _NVEXT_IDS if trio else null + tail
    at = head.find(_FINISH_KEY)
    return event[:text], head, tail, mid, head[:at] if at >= 0 else None

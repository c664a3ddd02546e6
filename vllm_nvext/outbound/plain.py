"""The plain-chunk reader: whether an event is plain JSON orjson writes back, and where its values sit.

`plain_chunk` is the Python twin of `_speedups.plain_chunk` (csrc/plain_chunk.c), with the same signature
and the same answers (tests/unit/test_attack_shortcuts.py compares the two on generated chunks; the stream
and unary tests run `finish.first_chunk` and `unary.plain_body` on both against the general path's decode).

Plain: a `data: {...}\\n\\n` event whose JSON has no whitespace, strings of printable ASCII without escapes,
integers of at most 15 digits (no fraction, no exponent, no `-0`), `null`, `true`, `false`, no key twice in
an object, at most 64 keys in one, no value nested deeper than 16 levels, and a root `choices` (if any)
that is a list of objects. The answer: None, or (choices, root prompt ids, root nvext, index, ids, prompt
ids, finish reason), the first the number of choices (-1: no `choices`), each other the (start, end) in the
event of a value (-1, -1: absent), the last four in the first choice.

The C twin reads the grammar byte by byte; this one lets orjson do it: a plain event is one whose JSON
decodes and encodes back to its own bytes with only the bytes plain strings and integers allow, so what is
left to check by hand is what a round trip cannot see (numbers the grammar refuses, the nesting and key
limits, `choices`), and the values' places follow from the lengths of their encodings.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson

_EVENT, _EVENT_END = b"data: {", b"\n\n"
_JSON_AT = len(b"data: ")
# Every byte a plain event's JSON may hold: printable ASCII, without the backslash (no escapes).
_PRINTABLE = bytes(range(0x20, 0x7F)).replace(b"\\", b"")
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_SIXTEEN_DIGITS = b"0" * 16
_MAX_KEYS, _MAX_DEPTH = 64, 16
_ROOT_NAMES = ("choices", "prompt_token_ids", "nvext")
_CHOICE_NAMES = ("index", "token_ids", "prompt_token_ids", "finish_reason")
_NO_CHOICE = (-1,) * 8


def plain_chunk(event: bytes) -> tuple[int, ...] | None:
    """None, or the spans `outbound.finish.first_chunk` reads (see the module's doc); `_speedups.plain_chunk`'s
    twin."""
    if type(event) is not bytes:
        raise TypeError("plain_chunk: the event must be bytes")
    if len(event) < 10 or not event.startswith(_EVENT) or not event.endswith(_EVENT_END):
        return None
    text = event[_JSON_AT:-2]
    if text.translate(None, _PRINTABLE):
        return None  # a byte outside printable ASCII, or a backslash
    try:
        root = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    if type(root) is not dict or orjson.dumps(root) != text:
        return None  # whitespace, a key twice, a number orjson writes otherwise
    # Without its strings (every other piece between quotes, with no escapes), the JSON's keys are its colons,
    # and a number is refused for a fraction, an exponent (an `e` beyond those of true and false) or 16 digits.
    bare = b"".join(text.split(b'"')[::2])
    if (
        b"." in bare
        or b"E" in bare
        or bare.count(b"e") != bare.count(b"true") + bare.count(b"false")
        or _SIXTEEN_DIGITS in bare.translate(_DIGITS_TO_ZERO)
        or not _within_limits(root, bare)
    ):
        return None
    if "choices" not in root:
        return (-1, *_spans(root, _JSON_AT + 1, _ROOT_NAMES)[2:], *_NO_CHOICE)
    choices = root["choices"]
    if type(choices) is not list or any(type(c) is not dict for c in choices):
        return None
    spans = _spans(root, _JSON_AT + 1, _ROOT_NAMES)
    if not choices:
        return (0, *spans[2:], *_NO_CHOICE)
    return (len(choices), *spans[2:], *_spans(choices[0], spans[0] + 2, _CHOICE_NAMES))


def _within_limits(root: dict[str, Any], bare: bytes) -> bool:
    """No object with more than 64 keys, no value deeper than 16 levels. `bare`: the JSON without its strings,
    whose counts bound both (a key is a colon there), so the values are walked only when a bound is reached."""
    if bare.count(b":") <= _MAX_KEYS and bare.count(b"{") + bare.count(b"[") <= _MAX_DEPTH:
        return True
    return _walk(root, 1)


def _walk(value: Any, depth: int) -> bool:
    """The limits over `value`, whose members or elements sit at `depth` (the root's at 1)."""
    members: Iterable[Any]
    if type(value) is dict:
        if len(value) > _MAX_KEYS or (value and depth > _MAX_DEPTH):
            return False
        members = value.values()
    elif type(value) is list:
        if value and depth > _MAX_DEPTH:
            return False
        members = value
    else:
        return True
    return all(_walk(member, depth + 1) for member in members if type(member) is dict or type(member) is list)


def _spans(obj: dict[str, Any], at: int, names: tuple[str, ...]) -> list[int]:
    """[start, end] of each of `names`' values in the object whose first key starts at `at` (-1, -1: absent),
    from the lengths of the members' encodings up to the last one named (the object is its encoding, checked)."""
    spans = [-1] * (2 * len(names))
    left = 0
    for name in names:
        if name in obj:
            left += 1
    dumps = orjson.dumps
    for key, value in obj.items():
        if not left:
            break
        start = at + len(key) + 3  # "key":
        end = start + len(dumps(value))
        if key in names:
            i = 2 * names.index(key)
            spans[i], spans[i + 1] = start, end
            left -= 1
        at = end + 1  # past the comma
    return spans

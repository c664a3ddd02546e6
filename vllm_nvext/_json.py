"""JSON helpers that never silently alter a value.

orjson turns integers beyond 64 bits into floats; a body holding a long digit run is
decoded and encoded with the standard library instead, which keeps them exact.
"""

from __future__ import annotations

import json
import json.scanner
import re
from collections.abc import Callable
from typing import Any, NamedTuple

import orjson

# 19 digits reach past the signed 64-bit range; fractional digits merely take the exact path.
# Found by mapping every digit to "0" and searching for 19 zeros: two C passes, ~1 ns/byte,
# where a `\d{19}` regex costs ~12 ns/byte on digit-heavy bodies (ids, logprobs).
_DIGITS_TO_ZERO = bytes.maketrans(b"123456789", b"000000000")
_LONG_RUN = b"0" * 19


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def loads(data: bytes) -> Any:
    """Decode JSON; raises ValueError on anything that is not strict JSON."""
    if _LONG_RUN not in data.translate(_DIGITS_TO_ZERO):
        return orjson.loads(data)
    return json.loads(data, parse_constant=_reject_constant)


def dumps(obj: Any) -> bytes:
    """Encode compactly (the separators vLLM uses), keeping big integers exact."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


# --- Reading a request body exactly as vLLM does --------------------------------------------
# vLLM's routes take the body from starlette's `Request.json()`, which is `json.loads(bytes)`:
# the encoding is detected (UTF-8 with or without BOM, UTF-16, UTF-32), lone surrogates pass,
# `NaN`/`Infinity` and out-of-range numbers (`1e400` -> inf) are accepted, integers stay exact,
# the last of duplicate keys wins. orjson agrees with it wherever orjson succeeds, except that it
# turns integers beyond 64 bits into floats; both cases fall back to the standard library.


# Above this many bytes, `object_as_vllm` decodes with json: at most ~2x the body beside it.
LARGE_BODY = 1 << 20


def loads_as_vllm(data: bytes) -> Any:
    """Decode as vLLM's `json.loads(body)`; raises where that raises.

    ValueError (invalid JSON, undecodable bytes) or RecursionError (nesting deeper than the
    interpreter allows). vLLM reads the body deeper in the call stack than the middleware, so a
    body too deep here is too deep for vLLM too.
    """
    if _LONG_RUN not in data.translate(_DIGITS_TO_ZERO):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def object_as_vllm(data: bytes) -> dict[str, Any] | None:
    """The body as vLLM decodes it when that is a JSON object; None when vLLM refuses it with its own
    error (not JSON, nested too deep) or it is not an object."""
    try:
        # `loads_as_vllm`, inline (the request side's one decode per body): orjson, else the standard library;
        # a large body as vLLM decodes it, with json (orjson's parse holds ~12x a long string while it runs).
        if len(data) > LARGE_BODY or _LONG_RUN in data.translate(_DIGITS_TO_ZERO):
            decoded = json.loads(data)
        else:
            try:
                decoded = orjson.loads(data)
            except orjson.JSONDecodeError:
                decoded = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return decoded if type(decoded) is dict else None


# First bytes of the encodings `json.detect_encoding` tells from UTF-8: a BOM (EF, FE, FF) or a NUL.
NOT_UTF8_FIRST = (0, 0xEF, 0xFE, 0xFF)


def needs_decoding(data: bytes) -> bool:
    """True when the body is not plain UTF-8 text (a BOM, UTF-16 or UTF-32)."""
    if len(data) >= 2 and data[1] and data[0] not in NOT_UTF8_FIRST:
        # Shortcut: no BOM starts so and no NUL is among the first two bytes, so json.detect_encoding
        # says UTF-8: tests/unit/test_json.py::test_needs_decoding_is_json_detect_encoding.
        return False
    return json.detect_encoding(data[:4]) != "utf-8"


def text_of(data: bytes) -> str:
    """The text `json.loads(data)` parses (the BOM removed, lone surrogates kept)."""
    return data.decode(json.detect_encoding(data), "surrogatepass")


def encode_text(text: str) -> bytes:
    """UTF-8 bytes that `json.loads` decodes back to `text` exactly."""
    return text.encode("utf-8", "surrogatepass")


_WS = re.compile(r"[ \t\n\r]*")
# A string token, or a bracket outside strings: enough to find where any valid JSON value ends.
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_SCALAR = re.compile(r"[^,:\]}\s]+")


# The scanner json.loads itself uses (C), for the end of a nested value; NaN and Infinity as vLLM reads them.
# (typeshed types make_scanner's argument as its own class; CPython takes the decoder whose settings it reads)
_SCAN_ONCE: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.decoder.JSONDecoder())  # type: ignore[arg-type]


def _value_end(text: str, i: int) -> int:
    """End of the valid JSON value starting at `i` (no recursion, so any depth)."""
    first = text[i]
    if first == '"':
        match = _TOKEN.match(text, i)
        assert match is not None
        return match.end()
    if first not in "[{":
        match = _SCALAR.match(text, i)
        assert match is not None
        return match.end()
    # a string or bracket right inside is a nested value (a list of messages): no search for the close
    close = -1 if text[i + 1] in '"[{' else text.find("]" if first == "[" else "}", i + 1)
    if close > 0 and not any(text.find(c, i + 1, close) >= 0 for c in '"[{'):
        # flat: numbers and literals only (a list of ids), found at C speed; the bounded finds copy
        # nothing and stop at the first string or bracket of a nested value (a list of messages)
        return close + 1
    try:
        return int(_SCAN_ONCE(text, i)[1])  # nested: json's own C scanner finds its end
    except (RecursionError, StopIteration, ValueError):
        pass  # deeper than the C scanner goes: walk the tokens
    depth = 0
    for match in _TOKEN.finditer(text, i):
        token = match.group()
        if token in "[{":
            depth += 1
        elif token in "]}":
            depth -= 1
            if depth == 0:
                return match.end()
    raise ValueError("unterminated JSON value")


class Member(NamedTuple):
    """One `"key": value` of a JSON object in its text: `text[start:end]` is the member."""

    key: str
    start: int
    value_start: int
    end: int


_WS_CHARS = " \t\n\r"
_SCANSTRING: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]


def object_members(text: str, i: int) -> tuple[list[Member], int]:
    """The members of the valid JSON object starting at `text[i]` and the index after it.

    Whitespace is skipped by _WS only where there is some: compact JSON (what clients send) costs
    one character test per gap instead of a pattern match; the same positions either way.
    """
    assert text[i] == "{"
    members: list[Member] = []
    ws, ws_chars, scanstring, value_end = _WS.match, _WS_CHARS, _SCANSTRING, _value_end
    i += 1
    if text[i] in ws_chars:
        i = ws(text, i).end()  # type: ignore[union-attr]
    if text[i] == "}":
        return members, i + 1
    while True:
        key, colon = scanstring(text, i + 1)
        if text[colon] in ws_chars:
            colon = ws(text, colon).end()  # type: ignore[union-attr]
        value_start = colon + 1  # past the colon
        if text[value_start] in ws_chars:
            value_start = ws(text, value_start).end()  # type: ignore[union-attr]
        end = value_end(text, value_start)
        members.append(Member(key, i, value_start, end))
        i = end
        if text[i] in ws_chars:
            i = ws(text, i).end()  # type: ignore[union-attr]
        if text[i] == "}":
            return members, i + 1
        i += 1  # past the comma
        if text[i] in ws_chars:
            i = ws(text, i).end()  # type: ignore[union-attr]


def splice_root(body: bytes, drop: tuple[bytes, ...], extra: bytes) -> bytes:
    """The body (any JSON encoding `text_of` reads) with the root members named in `drop` (UTF-8) left out, every
    duplicate, and `extra` (members encoded and joined by commas) appended: `_speedups.splice_root`'s twin, which
    hands back None where this one decides (`inbound.rewrite.BodyRewrite.apply`)."""
    text = text_of(body)
    start = len(text) - len(text.lstrip(" \t\n\r"))
    names = frozenset(name.decode("utf-8", "surrogatepass") for name in drop)
    members, end = object_members(text, start)
    parts = [text[m.start : m.end] for m in members if m.key not in names]
    if extra:
        parts.append(extra.decode("utf-8", "surrogatepass"))
    return encode_text(f"{text[:start]}{{{','.join(parts)}}}{text[end:]}")


def splice_object(text: str, start: int, drop: frozenset[str], add: list[tuple[str, str]]) -> str:
    """Rewrite the object at `text[start]`: members named in `drop` go (every duplicate), the
    `add` members (key, encoded value) are appended; every other member keeps its exact text."""
    members, end = object_members(text, start)
    parts = [text[m.start : m.end] for m in members if m.key not in drop]
    parts += [f"{dumps_text(key)}:{value}" for key, value in add]
    return f"{text[:start]}{{{','.join(parts)}}}{text[end:]}"


# The encoder `json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))` builds
# on every call, built once (json.dumps is `JSONEncoder(...).encode(value)` for these arguments).
_ENCODE_TEXT: Callable[[Any], str] = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode


def dumps_text(value: Any) -> str:
    """JSON text for a value the middleware writes; ASCII, so `json.loads` reads it back exactly."""
    return _ENCODE_TEXT(value)

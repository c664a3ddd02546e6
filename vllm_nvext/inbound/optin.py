"""Which bodies the middleware has to read: a byte-level test that never decodes JSON.

A body opts in through a root key `nvext` or `return_token_ids`. vLLM decodes the JSON string
of a key, so either can be spelled with `\\uXXXX` escapes; a JSON string token that spells one
of them, anywhere, makes the middleware read the body. A body that is not plain UTF-8 (a BOM,
UTF-16, UTF-32: vLLM's `json.loads` reads those too) is always read.
"""

from __future__ import annotations

import functools
import re

from .. import _json


def _spelled(word: str) -> bytes:
    def char(c: str) -> str:
        hexes = "".join(f"[{d.lower()}{d.upper()}]" if d.isalpha() else d for d in f"{ord(c):04x}")
        return f"(?:{re.escape(c)}|\\\\u{hexes})"

    return ('"' + "".join(char(c) for c in word) + '"').encode()


_KEY_MARKERS = (b"nvext", b"return_token_ids", b"\\u")
_KEY_TOKEN = re.compile(_spelled("nvext") + b"|" + _spelled("return_token_ids"))
_LONGEST_KEY_TOKEN = 2 + 6 * len("return_token_ids")


def _mentions_key(data: bytes) -> bool:
    if (b"nvext" in data and b'"nvext"' in data) or b'"return_token_ids"' in data:
        return True  # a key's plain spelling (a match of _KEY_TOKEN): C scans instead of the pattern's
    return b"\\u" in data and _KEY_TOKEN.search(data) is not None  # any other spelling has an escape


def might_opt_in(body: bytes) -> bool:
    """False means the body cannot ask for anything the middleware does: it goes to vLLM as sent."""
    return _json.needs_decoding(body) or _mentions_key(body)


def opts_in_whole(body: bytes) -> bool:
    """`OptInScan().feed(body)` for a body that comes in one piece (no keys besides the opt-in ones).

    Every request to a token route runs it, so its common case enters no other function: the
    head test is `_json.needs_decoding`'s shortcut, the key test `_mentions_key`'s.
    """
    if len(body) >= 4 and (not body[1] or body[0] in _json.NOT_UTF8_FIRST) and _json.needs_decoding(body):
        return True
    if (b"nvext" in body and b'"nvext"' in body) or b'"return_token_ids"' in body:
        return True
    return b"\\u" in body and _KEY_TOKEN.search(body) is not None


@functools.cache
def _key_tokens(words: tuple[str, ...]) -> re.Pattern[bytes]:
    return re.compile(b"|".join(_spelled(word) for word in words))


class OptInScan:
    """The `might_opt_in` test over a body that arrives in pieces (keys split across pieces too).

    `also`: more keys whose mention makes the body one to read.
    """

    __slots__ = ("found", "_head", "_tail", "_also", "_keep")

    def __init__(self, also: tuple[str, ...] = ()) -> None:
        self.found = False
        self._head = b""
        self._tail = b""
        self._also = _key_tokens(also) if also else None
        # The bytes kept from one piece to the next: all but one of the longest key token's, escaped.
        self._keep = max((_LONGEST_KEY_TOKEN, *(2 + 6 * len(word) for word in also))) - 1

    def feed(self, chunk: bytes) -> bool:
        if self.found:
            return True
        if len(self._head) < 4:
            self._head += chunk[: 4 - len(self._head)]
            if len(self._head) == 4 and _json.needs_decoding(self._head):
                self.found = True
                return True
        window = self._tail + chunk
        if _mentions_key(window) or (self._also is not None and self._also.search(window) is not None):
            self.found = True
        self._tail = window[-self._keep :]
        return self.found

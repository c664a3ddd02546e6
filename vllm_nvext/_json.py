"""JSON helpers that never silently alter a value.

orjson turns integers beyond 64 bits into floats; a body holding a long digit run is
decoded and encoded with the standard library instead, which keeps them exact.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

# 19 digits reach past the signed 64-bit range; fractional digits merely take the exact path.
_LONG_DIGITS = re.compile(rb"\d{19}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def loads(data: bytes) -> Any:
    """Decode JSON; raises ValueError on anything that is not strict JSON."""
    if _LONG_DIGITS.search(data) is None:
        return orjson.loads(data)
    return json.loads(data, parse_constant=_reject_constant)


def dumps(obj: Any) -> bytes:
    """Encode compactly (the separators vLLM uses), keeping big integers exact."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()

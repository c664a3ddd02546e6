"""Facts about response shapes and id lists that the middleware, the client and parity share.

Standard library only: `vllm_nvext.client` promises to import nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def choice_logprobs(choice: dict[str, Any]) -> list[Any] | None:
    """The logprob of each generated token of one choice, or None when it carries none.

    Chat puts them in `logprobs.content[i].logprob`, completions in `logprobs.token_logprobs`
    (docs/protocol.md §1); the two shapes share no key, so the shape itself says which it is.
    """
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    content = lp.get("content")
    if isinstance(content, list):  # chat
        return [c.get("logprob") if isinstance(c, dict) else None for c in content]
    values = lp.get("token_logprobs")  # completions
    return list(values) if isinstance(values, list) else None


def first_mismatch(a: Sequence[Any], b: Sequence[Any]) -> int | None:
    """The first index where `a` and `b` differ (a length counts), or None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def first_difference(a: Sequence[Any] | None, b: Sequence[Any] | None) -> str | None:
    """None when equal, else where two id lists first differ: `index 3: 17 != 18`.

    When one list is a prefix of the other the missing side reads `<end>` and both lengths are
    given: `index 4: <end> != 18 (lengths 4 and 6)`.
    """
    if a is None or b is None:
        return None if a is None and b is None else f"{_brief(a)} != {_brief(b)}"
    i = first_mismatch(a, b)
    if i is None:
        return None
    x = a[i] if i < len(a) else "<end>"
    y = b[i] if i < len(b) else "<end>"
    if i < min(len(a), len(b)):
        return f"index {i}: {x} != {y}"
    return f"index {i}: {x} != {y} (lengths {len(a)} and {len(b)})"


def _brief(ids: Sequence[Any] | None) -> str:
    return "missing" if ids is None else f"{len(ids)} ids"

"""What the request side read of a body that opts in (`Request`), and what it keeps of a plain body's reading
(`Reading`): the types request.py makes and the request side's other modules (choices.py, nvext_map.py) and the
agent routes read, in a module of their own so that none of those imports request.py back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config import Mode
from ..protocol import Endpoint
from .fields import DecisionFields
from .plan import Plan
from .rewrite import BodyRewrite


@dataclass(slots=True, eq=False)
class Reading:
    """What `read_request` read from a body whose decision fields and `nvext` are plain values, kept
    per their values (`fields.reading_key`), with the plans made from it (`plan`)."""

    fields: DecisionFields
    nvext: dict[str, Any]
    # By (mode, hides_reasoning_ids): the plan, the rewrite that makes the body (the plan is then a
    # template without a body; None: vLLM gets the client's bytes) and its `splice_root` arguments.
    plans: dict[tuple[Mode, bool], tuple[Plan, BodyRewrite | None, tuple[tuple[bytes, ...], bytes]]] = field(
        default_factory=dict
    )


@dataclass(frozen=True)
class Request:
    """A token-endpoint body that opts in, read as vLLM reads it."""

    endpoint: Endpoint
    body: bytes
    data: dict[str, Any]
    fields: DecisionFields
    nvext: dict[str, Any]
    # Kept per value: the fields and nvext above are its own (no part of the request's value).
    reading: Reading | None = field(default=None, compare=False, repr=False)

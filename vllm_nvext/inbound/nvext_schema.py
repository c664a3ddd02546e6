"""Dynamo's `NvExt` request object and its nested objects, all `deny_unknown_fields` (docs/protocol.md §3).

`validate_nvext` refuses what Dynamo refuses, naming the field; `read_nvext` keeps the valid ones
made of plain values; `param_names` lists every field an error may name (the metrics' label values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

from .. import _json
from ..config import keep
from ..protocol import RequestError


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_uint(v: Any) -> bool:
    return _is_int(v) and v >= 0


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_uint_list(v: Any) -> bool:
    return isinstance(v, list) and all(_is_uint(x) for x in v)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_Check = tuple[Callable[[Any], bool], str]
_BOOL: _Check = (_is_bool, "a boolean")
_UINT: _Check = (_is_uint, "a non-negative integer")
_INT: _Check = (_is_int, "an integer")
_NUMBER: _Check = (_is_number, "a number")
_STR: _Check = (_is_str, "a string")
_STRS: _Check = (_is_str_list, "a list of strings")

NVEXT_OBJECTS: dict[str, dict[str, _Check]] = {
    "metadata_upload": {"url": _STR},
    "agent_hints": {
        "priority": _INT,
        "strict_priority": _UINT,
        "osl": _UINT,
        "speculative_prefill": _BOOL,
        "latency_sensitivity": _NUMBER,
    },
    "routing_constraints": {"required_taints": _STRS, "preferred_taints": _STRS},
    "router": {"ttft_target": _NUMBER, "itl_target": _NUMBER},
}
NVEXT_FIELDS: dict[str, _Check] = {
    "greed_sampling": _BOOL,
    "use_raw_prompt": _BOOL,
    "annotations": _STRS,
    "backend_instance_id": _UINT,
    "token_data": (_is_uint_list, "a list of non-negative integers"),
    "max_thinking_tokens": _UINT,
    "cache_salt": _STR,
    "extra_fields": _STRS,
    "prefill_worker_id": _UINT,
    "decode_worker_id": _UINT,
    "dp_rank": _UINT,
    "prefill_dp_rank": _UINT,
    "request_timestamp_ms": _NUMBER,
    **{name: ((lambda v: isinstance(v, dict)), "an object") for name in NVEXT_OBJECTS},
}


def validate_nvext(nvext: dict[str, Any]) -> None:
    _validate_object(nvext, NVEXT_FIELDS, "nvext")
    for name, fields in NVEXT_OBJECTS.items():
        value = nvext.get(name)
        if value is not None:
            _validate_object(value, fields, f"nvext.{name}")
    upload = nvext.get("metadata_upload")
    if upload is not None and not (upload.get("url") or "").strip():
        raise RequestError("`nvext.metadata_upload.url` must not be empty", "nvext.metadata_upload.url")


class KeptNvext(dict[str, Any]):
    """A valid `nvext` that `read_nvext` keeps and hands out again for the same value (the type is
    the mark: an object read anew is a plain dict). Never changed once kept."""

    __slots__ = ()


def read_nvext(nvext: dict[str, Any]) -> dict[str, Any]:
    """`nvext` once `validate_nvext` passed it (raises as it raises): one `KeptNvext` per value of
    plain members (what clients send: `extra_fields`, `greed_sampling`, `cache_salt`), else `nvext`.

    The kept reading equals `nvext` member for member, in order, with each value's type
    (tests/unit/test_request_fidelity.py::test_a_kept_nvext_plan_is_the_plan_made_anew);
    a refusal is never kept.
    """
    key = _plain_key(nvext)
    if key is not None:
        known = _READ.get(key)
        if known is not None:
            return known
    validate_nvext(nvext)
    if key is None:
        return nvext
    # Lists copied: the reading outlives the request whose body held them.
    reading = KeptNvext((name, list(v) if type(v) is list else v) for name, v in nvext.items())
    return keep(_READ, key, reading, _READ_MAX)  # made-up values cannot grow it


# `read_nvext`'s readings by (each member's name, type and value): values that are None, a bool, an
# int, a short string or a short list of short strings (a float is left out: -0.0 equals 0.0), so
# what is kept stays small whatever clients send.
_READ: dict[tuple[Any, ...], KeptNvext] = {}
_READ_MAX = 1024
_SCALARS = (type(None), bool, int, str)
KEY_STR_MAX = 64
KEY_LIST_MAX = 16  # also `fields.reading_key`'s bounds on `nvext`


def _plain_key(nvext: dict[str, Any]) -> tuple[Any, ...] | None:
    """`_READ`'s key for `nvext`; None when a member holds something else (an object, a float, ids)."""
    key: list[Any] = []
    for name, value in nvext.items():
        kind = type(value)
        if kind is list:
            if len(value) > KEY_LIST_MAX:
                return None
            for item in value:
                if type(item) is not str or len(item) > KEY_STR_MAX:
                    return None
            value = tuple(value)
        elif kind not in _SCALARS or (kind is str and len(value) > KEY_STR_MAX):
            return None
        key += (name, kind, value)
    return tuple(key)


def _validate_object(obj: dict[str, Any], fields: dict[str, _Check], where: str) -> None:
    for key, value in obj.items():
        spec = fields.get(key)
        if spec is None:
            expected = ", ".join(f"`{k}`" for k in fields)
            raise RequestError(f"invalid {where}: unknown field `{key}`, expected one of {expected}", f"{where}.{key}")
        check, kind = spec
        if value is not None and not check(value):
            raise RequestError(f"`{where}.{key}` must be {kind}, got {_describe(value, check)}", f"{where}.{key}")


def _describe(value: Any, check: Callable[[Any], bool]) -> str:
    """What is wrong with `value`: for a list, its first bad element and where it is."""
    if isinstance(value, list) and check in (_is_uint_list, _is_str_list):
        item = _is_uint if check is _is_uint_list else _is_str
        for i, element in enumerate(value):
            if not item(element):
                shown = (
                    _json.dumps_text(element) if isinstance(element, (bool, int, float, str)) else json_type(element)
                )
                return f"{shown} at index {i}"
    return json_type(value)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def param_names() -> frozenset[str]:
    """Every `nvext...` field name an error of `validate_nvext` can name."""
    names = {f"nvext.{name}" for name in NVEXT_FIELDS}
    names |= {f"nvext.{obj}.{name}" for obj, fields in NVEXT_OBJECTS.items() for name in fields}
    return frozenset(names)

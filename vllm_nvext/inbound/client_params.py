"""Pure: client values that reach further than the request, checked or trimmed before vLLM sees them.

- A request id (`X-Request-Id`, else the body's `request_id`) that a kv connector joins into a
  file path must be a plain name (docs/hidden-states.md).
- `remote_host` / `remote_port` in a client's `kv_transfer_params` steer a prefill/decode
  connector's outbound connection; the optional strip removes them (docs/scaling-out.md).
"""

from __future__ import annotations

import json
from typing import Any

from .. import _json

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128
_FORBIDDEN = ("/", "\\", "..")

# The keys vLLM's prefill/decode connectors dial, at the root of kv_transfer_params and under
# `prefill` / `decode` (docs/scaling-out.md).
REMOTE_ADDRESS_KEYS = frozenset({"remote_host", "remote_port"})
NESTED_STAGES = ("prefill", "decode")


def is_plain_name(request_id: str) -> bool:
    """No path separator, no `..`, no control character, at most MAX_REQUEST_ID characters."""
    return (
        len(request_id) <= MAX_REQUEST_ID
        and not any(part in request_id for part in _FORBIDDEN)
        and not any(c < " " or c == "\x7f" for c in request_id)
    )


def not_plain_message(name: str) -> str:
    return (
        f"`{name}` must be a plain name on this server, whose kv connector names files after request ids: "
        f"no `/`, `\\`, `..` or control characters, at most {MAX_REQUEST_ID} characters"
    )


def _without_remote_address(kv: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of kv_transfer_params without the remote address keys; None when it has none."""
    stripped = {k: v for k, v in kv.items() if k not in REMOTE_ADDRESS_KEYS}
    changed = len(stripped) != len(kv)
    for stage in NESTED_STAGES:
        nested = stripped.get(stage)
        if isinstance(nested, dict):
            inner = _without_remote_address(nested)
            if inner is not None:
                stripped[stage] = inner
                changed = True
    return stripped if changed else None


def strip_remote_address(body: bytes, data: Any) -> bytes | None:
    """`body` (decoded as `data`) without the remote address in its root kv_transfer_params; None if it has none.

    Only kv_transfer_params is re-encoded (exactly: NaN and big integers as vLLM's `json.loads`
    reads them back); every other member keeps its text.
    """
    kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
    stripped = _without_remote_address(kv) if isinstance(kv, dict) else None
    if stripped is None:
        return None
    text = _json.text_of(body)
    start = len(text) - len(text.lstrip(" \t\n\r"))
    encoded = json.dumps(stripped, ensure_ascii=True, separators=(",", ":"))
    key = "kv_transfer_params"
    return _json.encode_text(_json.splice_object(text, start, frozenset({key}), [(key, encoded)]))

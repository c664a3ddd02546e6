"""Pure: client values that reach further than the request, checked or trimmed before vLLM sees them.

- A request id (`X-Request-Id`, else the body's `request_id`) that a kv connector joins into a
  file path must be a plain name (docs/hidden-states.md).
- The address keys of a client's `kv_transfer_params` steer a kv connector's outbound connection;
  the optional strip removes them (docs/scaling-out.md).
- The mode header (`x-nvext-mode`) picks a request's mode where the server allows it.
"""

from __future__ import annotations

import json
from typing import Any

from .. import _json
from ..config import MODE_HEADER, Mode
from ..protocol import BODY_REQUEST_ID_PATHS, KV_PARAMS_PATHS, REQUEST_ID_PATHS, RequestError

REQUEST_ID_HEADER = "x-request-id"
MAX_REQUEST_ID = 128
_FORBIDDEN = ("/", "\\", "..")

# The keys of kv_transfer_params that say where vLLM's kv connectors connect, read from each supported
# release's connectors (tests/support/vllm_source.py walks their source), at the root of
# kv_transfer_params and under `prefill` / `decode` (docs/scaling-out.md). `disagg_spec` (LMCache:
# `receiver_host`, `receiver_init_port`, `receiver_alloc_port`) goes whole: LMCache reads all of it or none.
REMOTE_ADDRESS_KEYS = frozenset(
    {
        "remote_host",  # NIXL, MoRIIO
        "remote_port",  # NIXL
        "remote_hosts",  # MoRIIO
        "remote_handshake_port",  # MoRIIO
        "remote_notify_port",  # MoRIIO
        "remote_bootstrap_addr",  # Mooncake
        "disagg_spec",  # LMCache
    }
)
# The one root key whose mention makes a body one to read for the strip.
KV_TRANSFER_PARAMS = "kv_transfer_params"
NESTED_STAGES = ("prefill", "decode")


def checks_on(
    path: str, translated: bool, ids_name_files: bool, header_id: bytes | None, strip: bool
) -> tuple[bool, bool]:
    """(check the body's `request_id`, strip its kv_transfer_params' address keys) on `path`.

    `translated`: a route the middleware reads anyway (chat, completions, the agent routes);
    `ids_name_files`: the server's kv connector joins request ids into paths; `header_id`: the
    request's X-Request-Id (None: none), which vLLM takes before the body's `request_id` on most routes.
    """
    body_id = ids_name_files and (header_id is None or path in BODY_REQUEST_ID_PATHS)
    if not translated:
        return body_id and path in REQUEST_ID_PATHS, strip and path in KV_PARAMS_PATHS
    return body_id, strip


def keys_to_read(body_request_id: bool, strip: bool) -> tuple[str, ...]:
    """The root keys whose mention makes a body one to read for these checks."""
    return (("request_id",) if body_request_id else ()) + ((KV_TRANSFER_PARAMS,) if strip else ())


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


def checked_body(body: bytes, request_id: bool, strip: bool) -> bytes | RequestError:
    """A body read for these checks alone: the refusal of its `request_id` when that must be a plain name
    (`request_id`) and is not; else the body with the remote address stripped (`strip`), or as it came
    (the same object: also when vLLM refuses it with its own error)."""
    data = _json.object_as_vllm(body)
    if data is None:
        return body  # vLLM refuses it with its own error
    value = data.get("request_id") if request_id else None
    if isinstance(value, str) and not is_plain_name(value):
        return RequestError(not_plain_message("request_id"), "request_id")
    stripped = strip_remote_address(body, data) if strip else None
    return body if stripped is None else stripped


def request_mode(setting: Mode, allow_header: bool, values: list[bytes]) -> Mode:
    """The mode of a request that opts in: its mode header's where the server allows one, else the setting; an
    empty header counts as absent. Raises RequestError for a mode it does not know or two different ones."""
    if not allow_header:
        return setting
    chosen: set[Mode] = set()
    for value in values:
        text = value.decode("latin-1")
        if text.strip():
            try:
                chosen.add(Mode.parse(text))
            except ValueError:
                names = "|".join(m.value for m in Mode)
                message = f"header `{MODE_HEADER}`: invalid mode {text.strip()!r}: expected one of {names}"
                raise RequestError(message, MODE_HEADER) from None
    if len(chosen) > 1:
        names = ", ".join(sorted(m.value for m in chosen))
        raise RequestError(f"header `{MODE_HEADER}` is repeated with different modes ({names})", MODE_HEADER)
    return chosen.pop() if chosen else setting

"""Pure request side: validate a token-endpoint body and normalize both dialects into a Plan.

`return_token_ids` (vLLM) and `nvext.extra_fields` (Dynamo) fold into one nvext form; vLLM
then receives `return_token_ids: true` and no `nvext`. See PROTOCOL §1 and §3.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeGuard

from . import _json, _vllm_compat
from .config import Mode

logger = logging.getLogger("vllm_nvext")


class Endpoint(str, enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"


ENDPOINT_PATHS = {
    "/v1/chat/completions": Endpoint.CHAT,
    "/v1/completions": Endpoint.COMPLETIONS,
}

# Response selectors Dynamo understands (PROTOCOL §3); other strings are ignored, as Dynamo does.
COMPLETION_TOKEN_IDS = "completion_token_ids"
PROMPT_TOKEN_IDS = "prompt_token_ids"
ENGINE_DATA = "engine_data"
TIMING = "timing"
WORKER_ID = "worker_id"
STOP_REASON = "stop_reason"
DETAILED_FINISH_REASON = "detailed_finish_reason"
PROMPT_LOGPROBS = "prompt_logprobs"
ROUTED_EXPERTS = "routed_experts"
ID_SELECTORS = frozenset({COMPLETION_TOKEN_IDS, PROMPT_TOKEN_IDS})
# Selectors answered under `nvext` in every mode: vLLM has no place for them.
NVEXT_ONLY_SELECTORS = frozenset(
    {ENGINE_DATA, TIMING, STOP_REASON, DETAILED_FINISH_REASON, PROMPT_LOGPROBS, ROUTED_EXPERTS}
)
# Dynamo 1.6.1 refuses n > 1 (and a completions batch) only for the nvext-placed trio; every
# other selector is answered per choice. Selectors that describe one prompt are refused on a
# completions batch: Dynamo documents them as single-prompt (1.6.1 answers the last prompt's ids).
SINGLE_PROMPT_SELECTORS = (PROMPT_TOKEN_IDS, ENGINE_DATA, PROMPT_LOGPROBS)


class RequestError(Exception):
    """A request the middleware refuses; rendered in vLLM's error envelope."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


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

# Dynamo's NvExt and its nested objects, all `deny_unknown_fields` (PROTOCOL §3).
_OBJECTS: dict[str, dict[str, _Check]] = {
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
_NVEXT_FIELDS: dict[str, _Check] = {
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
    **{name: ((lambda v: isinstance(v, dict)), "an object") for name in _OBJECTS},
}


@dataclass(frozen=True, slots=True)
class Plan:
    """What to send upstream and how to reshape what comes back, for one request."""

    endpoint: Endpoint
    # The client gets vLLM's own placement of the ids (PROTOCOL §1).
    vllm_ids: bool
    # The PR #13588 trio under `nvext`: completion_token_ids, prompt_token_ids, kv_transfer_params.
    nvext_trio: bool
    # `nvext.prompt_token_ids` without the rest of the trio.
    nvext_prompt_ids: bool
    # Other selectors answered under `nvext` (NVEXT_ONLY_SELECTORS).
    selectors: frozenset[str]
    # The middleware turned `return_token_ids` on and the client must not see vLLM's copies.
    strip_vllm_ids: bool
    # Completions `echo` makes vLLM send prompt ids by itself: leave those alone.
    echo: bool
    # The client asked for logprobs (engine_data.completion_logprobs follows them).
    logprobs: bool
    # The rewritten upstream body; None keeps the client's bytes.
    body: bytes | None
    # Extra request headers for vLLM (e.g. the data-parallel rank).
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @property
    def reshapes_response(self) -> bool:
        return bool(self.nvext_trio or self.nvext_prompt_ids or self.selectors or self.strip_vllm_ids)


def might_opt_in(body: bytes) -> bool:
    """Cheap byte test: False means the body cannot ask for anything the middleware does.

    A JSON key can be spelled with escapes (`\\u0072eturn_token_ids`), so any `\\u` forces a parse.
    """
    return b"return_token_ids" in body or b"nvext" in body or b"\\u" in body


def plan_request(body: bytes, endpoint: Endpoint, mode: Mode) -> Plan | None:
    """Validate and normalize `body`; None means pass the request through untouched.

    Raises RequestError for a request that is well-formed JSON but wrong for either dialect.
    """
    try:
        data = _json.loads(body)
    except ValueError:
        return None  # not JSON: vLLM answers with its own error
    if not isinstance(data, dict):
        return None

    return_token_ids = data.get("return_token_ids")
    if return_token_ids is not None and not isinstance(return_token_ids, bool):
        raise RequestError(
            f"`return_token_ids` must be a boolean, got {_json_type(return_token_ids)}",
            "return_token_ids",
        )
    has_nvext_key = "nvext" in data
    nvext = data.get("nvext")
    if nvext is None:
        nvext = {}
    elif not isinstance(nvext, dict):
        raise RequestError(f"`nvext` must be an object, got {_json_type(nvext)}", "nvext")
    _validate_nvext(nvext)
    if not return_token_ids and not has_nvext_key:
        return None  # opts into nothing

    extra_fields = nvext.get("extra_fields") or []
    requested = set(extra_fields)
    nvext_ids = requested & ID_SELECTORS
    # PROTOCOL §3 / PR #13588: `return_token_ids: true` is an alias of the completion_token_ids selector.
    normalized = set(requested)
    if return_token_ids:
        normalized.add(COMPLETION_TOKEN_IDS)
    ids_requested = bool(normalized & ID_SELECTORS)

    if mode is Mode.AUTO:
        vllm_ids = bool(return_token_ids)
        nvext_placement = bool(nvext_ids)
    elif mode is Mode.VLLM:
        vllm_ids, nvext_placement = ids_requested, False
    elif mode is Mode.NVEXT:
        vllm_ids, nvext_placement = False, ids_requested
    else:
        vllm_ids = nvext_placement = ids_requested
    nvext_trio = nvext_placement and COMPLETION_TOKEN_IDS in normalized
    nvext_prompt_ids = nvext_placement and not nvext_trio and PROMPT_TOKEN_IDS in normalized
    selectors = frozenset(normalized & NVEXT_ONLY_SELECTORS)
    if PROMPT_LOGPROBS in selectors and data.get("prompt_logprobs") is None:
        selectors = selectors - {PROMPT_LOGPROBS}  # only answered when vLLM's prompt_logprobs is set

    if nvext_trio and _num_choices(data, endpoint) > 1:
        raise RequestError(
            f'`nvext.extra_fields=["{COMPLETION_TOKEN_IDS}"]` requires exactly one generated choice', "n"
        )
    if endpoint is Endpoint.COMPLETIONS and _num_prompts(data) > 1:
        asked = selectors | ({PROMPT_TOKEN_IDS} if nvext_prompt_ids else set())
        single_prompt = [s for s in SINGLE_PROMPT_SELECTORS if s in asked]
        if single_prompt:
            name = single_prompt[0]
            raise RequestError(f'`nvext.extra_fields=["{name}"]` requires a single prompt, got a batch', "prompt")

    # timing's ttft_ms is the first chunk carrying a token id: ask for ids to see them.
    needs_ids = vllm_ids or nvext_trio or nvext_prompt_ids or bool(selectors & {ENGINE_DATA, TIMING})
    upstream = dict(data)
    upstream.pop("nvext", None)
    if needs_ids:
        upstream["return_token_ids"] = True
    headers = _apply_nvext_fields(upstream, nvext, endpoint)
    strip = needs_ids and not vllm_ids
    echo = endpoint is Endpoint.COMPLETIONS and bool(data.get("echo"))
    logprobs = _logprobs_requested(data, endpoint)
    new_body = None if upstream == data else _json.dumps(upstream)
    return Plan(
        endpoint=endpoint,
        vllm_ids=vllm_ids,
        nvext_trio=nvext_trio,
        nvext_prompt_ids=nvext_prompt_ids,
        selectors=selectors,
        strip_vllm_ids=strip,
        echo=echo,
        logprobs=logprobs,
        body=new_body,
        headers=headers,
    )


def _validate_nvext(nvext: dict[str, Any]) -> None:
    _validate_object(nvext, _NVEXT_FIELDS, "nvext")
    for name, fields in _OBJECTS.items():
        value = nvext.get(name)
        if value is not None:
            _validate_object(value, fields, f"nvext.{name}")
    upload = nvext.get("metadata_upload")
    if upload is not None and not (upload.get("url") or "").strip():
        raise RequestError("`nvext.metadata_upload.url` must not be empty", "nvext.metadata_upload.url")


def _validate_object(obj: dict[str, Any], fields: dict[str, _Check], where: str) -> None:
    for key, value in obj.items():
        spec = fields.get(key)
        if spec is None:
            expected = ", ".join(f"`{k}`" for k in fields)
            raise RequestError(f"invalid {where}: unknown field `{key}`, expected one of {expected}", f"{where}.{key}")
        check, kind = spec
        if value is not None and not check(value):
            raise RequestError(f"`{where}.{key}` must be {kind}, got {_json_type(value)}", f"{where}.{key}")


def _apply_nvext_fields(
    upstream: dict[str, Any], nvext: dict[str, Any], endpoint: Endpoint
) -> tuple[tuple[bytes, bytes], ...]:
    """Map the nvext request fields vLLM has an equivalent for; routing-only ones are dropped."""
    if nvext.get("greed_sampling") is True:
        upstream["temperature"] = 0.0
    salt = nvext.get("cache_salt")
    if salt:  # an empty salt counts as absent, as in Dynamo
        upstream["cache_salt"] = salt  # nvext wins over a root cache_salt, as in Dynamo
    budget = nvext.get("max_thinking_tokens")
    if budget is not None and "thinking_token_budget" not in upstream:
        # A root thinking_token_budget wins, as in Dynamo.
        if _vllm_compat.has_thinking_token_budget():
            upstream["thinking_token_budget"] = budget
        else:
            logger.debug("nvext.max_thinking_tokens ignored: this vLLM has no thinking_token_budget")
    token_data = nvext.get("token_data")
    if token_data is not None:
        if not token_data:
            raise RequestError("`nvext.token_data` must not be empty", "nvext.token_data")
        if endpoint is Endpoint.COMPLETIONS:
            upstream["prompt"] = token_data
        else:
            _chat_from_token_ids(upstream, token_data)
    dp_rank = nvext.get("dp_rank")
    if dp_rank is not None:
        return ((b"x-data-parallel-rank", str(dp_rank).encode()),)
    return ()


def _chat_from_token_ids(upstream: dict[str, Any], token_data: list[int]) -> None:
    """Serve a chat request from pre-tokenized ids; the messages are the client's placeholder.

    vLLM's chat endpoint takes `kv_transfer_params.prompt_token_ids` as the prompt (the ids a
    disaggregated prefill stage hands to decode), so the answer stays a real chat completion.
    """
    if not _vllm_compat.chat_accepts_prompt_token_ids():
        raise RequestError(
            "`nvext.token_data` on /v1/chat/completions needs a vLLM whose chat endpoint accepts "
            "`kv_transfer_params.prompt_token_ids`; send it to /v1/completions instead",
            "nvext.token_data",
        )
    if upstream.get("echo") or _has_non_text_content(upstream.get("messages")):
        # vLLM would then render the messages and silently ignore the ids.
        raise RequestError(
            "`nvext.token_data` cannot be combined with `echo` or non-text message content", "nvext.token_data"
        )
    kv = upstream.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise RequestError("`kv_transfer_params` must be an object", "kv_transfer_params")
    upstream["kv_transfer_params"] = {**(kv or {}), "prompt_token_ids": token_data}


def _has_non_text_content(messages: Any) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not (isinstance(part, dict) and part.get("type") == "text") for part in content
        ):
            return True
    return False


def _num_choices(data: dict[str, Any], endpoint: Endpoint) -> int:
    n = data.get("n")
    choices = n if _is_int(n) and n > 0 else 1
    if endpoint is Endpoint.COMPLETIONS:
        choices *= _num_prompts(data)
    return choices


def _num_prompts(data: dict[str, Any]) -> int:
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        return len(prompt)  # a batch: a list of strings or of id lists
    return 1


def _logprobs_requested(data: dict[str, Any], endpoint: Endpoint) -> bool:
    lp = data.get("logprobs")
    if endpoint is Endpoint.CHAT:
        return lp is True
    return _is_int(lp) and lp >= 0


def _json_type(value: Any) -> str:
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


def error_body(message: str, param: str | None, status: int) -> bytes:
    """vLLM's error envelope (PROTOCOL §1)."""
    kind = {400: "BadRequestError", 413: "RequestEntityTooLarge"}.get(status, "BadRequestError")
    return _json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})

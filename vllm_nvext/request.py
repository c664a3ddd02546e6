"""Pure request side: validate a token-endpoint body and normalize both dialects into a Plan.

`return_token_ids` (vLLM) and `nvext.extra_fields` (Dynamo) fold into one nvext form; vLLM
then receives `return_token_ids: true` and no `nvext`. See docs/protocol.md §1 and §3.
"""

from __future__ import annotations

import enum
import logging
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeGuard

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

# Response selectors Dynamo understands (docs/protocol.md §3.2); other strings are ignored, as Dynamo does.
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


ECHO_TEXT_LOST = (
    "`echo` cannot be combined with token ids vllm-nvext turns on (nvext selectors, or an nvext-placing "
    "mode): vLLM then leaves the echoed prompt out of `text`. Send `return_token_ids: true` in vLLM "
    "placement (the answer stock vLLM gives), or leave out `echo`"
)


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

# Dynamo's NvExt and its nested objects, all `deny_unknown_fields` (docs/protocol.md §3.1).
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
    # The client gets vLLM's own placement of the ids (docs/protocol.md §1).
    vllm_ids: bool
    # The trio under `nvext` (docs/protocol.md §3.4): completion_token_ids, prompt_token_ids, kv_transfer_params.
    nvext_trio: bool
    # `nvext.prompt_token_ids` without the rest of the trio.
    nvext_prompt_ids: bool
    # Other selectors answered under `nvext` (NVEXT_ONLY_SELECTORS).
    selectors: frozenset[str]
    # The middleware turned `return_token_ids` on and the client must not see vLLM's copies.
    strip_vllm_ids: bool
    # A completions stream with `echo`: vLLM sends prompt ids by itself: leave those alone.
    echo: bool
    # The middleware turned `return_token_ids` on for a completions `echo`: vLLM then drops the
    # echoed prompt from `text`, which the response side does not restore (the server refuses it).
    echo_text_lost: bool
    # The client asked for logprobs (engine_data.completion_logprobs follows them).
    logprobs: bool
    # The rewritten upstream body; None keeps the client's bytes.
    body: bytes | None
    # Extra request headers for vLLM (e.g. the data-parallel rank).
    headers: tuple[tuple[bytes, bytes], ...] = ()
    # What the client asked in (`vllm`, `nvext` or `both`) and whether it streams: for the metrics.
    dialect: str = "vllm"
    stream: bool = False
    # One prompt and n == 1: every chunk is about choice 0.
    single_choice: bool = True
    # A one-choice stream with `timing` or `engine_data`: vLLM reports its per-request metrics and
    # cached tokens on the usage chunk right after the finish chunk, which waits for it.
    await_usage: bool = False

    @property
    def reshapes_response(self) -> bool:
        return bool(self.nvext_trio or self.nvext_prompt_ids or self.selectors or self.strip_vllm_ids)


# --- Which bodies the middleware has to read ----------------------------------------------
# A body opts in through a root key `nvext` or `return_token_ids`. vLLM decodes the JSON string
# of a key, so either can be spelled with `\uXXXX` escapes; a JSON string token that spells one
# of them, anywhere, makes the middleware read the body. A body that is not plain UTF-8 (a BOM,
# UTF-16, UTF-32: vLLM's `json.loads` reads those too) is always read.
def _spelled(word: str) -> bytes:
    def char(c: str) -> str:
        hexes = "".join(f"[{d.lower()}{d.upper()}]" if d.isalpha() else d for d in f"{ord(c):04x}")
        return f"(?:{re.escape(c)}|\\\\u{hexes})"

    return ('"' + "".join(char(c) for c in word) + '"').encode()


_KEY_MARKERS = (b"nvext", b"return_token_ids", b"\\u")
_KEY_TOKEN = re.compile(_spelled("nvext") + b"|" + _spelled("return_token_ids"))
_LONGEST_KEY_TOKEN = 2 + 6 * len("return_token_ids")


def _mentions_key(data: bytes) -> bool:
    if not any(marker in data for marker in _KEY_MARKERS):
        return False  # the common case: two or three C scans
    return _KEY_TOKEN.search(data) is not None


def might_opt_in(body: bytes) -> bool:
    """False means the body cannot ask for anything the middleware does: it goes to vLLM as sent."""
    return _json.needs_decoding(body) or _mentions_key(body)


class OptInScan:
    """The `might_opt_in` test over a body that arrives in pieces (keys split across pieces too)."""

    __slots__ = ("found", "_head", "_tail")

    def __init__(self) -> None:
        self.found = False
        self._head = b""
        self._tail = b""

    def feed(self, chunk: bytes) -> bool:
        if self.found:
            return True
        if len(self._head) < 4:
            self._head += chunk[: 4 - len(self._head)]
            if len(self._head) == 4 and _json.needs_decoding(self._head):
                self.found = True
                return True
        window = self._tail + chunk
        if _mentions_key(window):
            self.found = True
        self._tail = window[-(_LONGEST_KEY_TOKEN - 1) :]
        return self.found


# --- vLLM's reading of the fields the middleware decides on -----------------------------------
# The same pydantic annotations as vLLM 0.32's request models, so the same lax coercion
# (`"2"` and `2.0` are 2, `"true"` and `1` are true, `[72.0, 105.0]` is one prompt of ids).
# Inside a vLLM server the field definitions are taken from vLLM's own models instead. pydantic
# comes with vLLM; it is imported on the first request, so the CLI works without it.
_VLLM_MODELS = {
    Endpoint.COMPLETIONS: (
        ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
        ("vllm.entrypoints.openai.protocol", "CompletionRequest"),
    ),
    Endpoint.CHAT: (
        ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
        ("vllm.entrypoints.openai.protocol", "ChatCompletionRequest"),
    ),
}
_readers: dict[tuple[Endpoint, bool], Any] = {}


def replica_model(endpoint: Endpoint) -> Any:
    """The decision fields with vLLM 0.32's annotations and defaults (a pydantic model)."""
    reader = _readers.get((endpoint, False))
    if reader is not None:
        return reader
    from pydantic import BaseModel, ConfigDict, Field

    token_ids = list[Annotated[int, Field(ge=0)]]

    class CompletionFields(BaseModel):
        model_config = ConfigDict(extra="ignore")

        return_token_ids: bool | None = None
        n: int = 1
        prompt: token_ids | list[token_ids] | str | list[str] | None = None  # type: ignore[valid-type]
        prompt_embeds: bytes | list[bytes] | None = None
        echo: bool | None = False
        logprobs: int | None = None
        stream: bool | None = False
        prompt_logprobs: int | None = None
        kv_transfer_params: dict[str, Any] | None = None

    class ChatFields(BaseModel):
        model_config = ConfigDict(extra="ignore")

        return_token_ids: bool | None = None
        n: int | None = 1
        echo: bool = False
        logprobs: bool | None = False
        stream: bool | None = False
        prompt_logprobs: int | None = None
        kv_transfer_params: dict[str, Any] | None = None

    _readers[(Endpoint.COMPLETIONS, False)] = CompletionFields
    _readers[(Endpoint.CHAT, False)] = ChatFields
    return _readers[(endpoint, False)]


def vllm_request_model(endpoint: Endpoint) -> Any:
    """vLLM's own request model, when the running process has loaded vLLM's serving code."""
    for module_name, class_name in _VLLM_MODELS[endpoint]:
        model = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(model, type) and hasattr(model, "model_fields"):
            return model
    return None


def field_reader(endpoint: Endpoint) -> Any:
    """The model that reads the decision fields: vLLM's field definitions when loaded, else the replica."""
    reader = _readers.get((endpoint, True))
    if reader is not None:
        return reader
    replica = replica_model(endpoint)
    vllm_model = vllm_request_model(endpoint)
    if vllm_model is None:
        return replica
    from pydantic import ConfigDict, create_model

    fields: dict[str, Any] = {}
    for name, info in replica.model_fields.items():
        theirs = vllm_model.model_fields.get(name, info)
        fields[name] = (theirs.annotation, theirs)
    reader = create_model(f"{vllm_model.__name__}Fields", __config__=ConfigDict(extra="ignore"), **fields)
    _readers[(endpoint, True)] = reader
    return reader


def _read_fields(data: dict[str, Any], endpoint: Endpoint, names: Any = None) -> Any:
    reader = field_reader(endpoint)
    if names is not None:
        data = {k: data[k] for k in names if k in data}
    from pydantic import ValidationError

    try:
        return reader.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        name = str(error["loc"][0]) if error["loc"] else None
        raise RequestError(f"`{name}` is invalid for vLLM: {error['msg']}", name) from None


@dataclass(frozen=True, slots=True)
class Request:
    """A token-endpoint body that opts in, read as vLLM reads it."""

    endpoint: Endpoint
    body: bytes
    data: dict[str, Any]
    fields: Any  # the decision fields, as vLLM coerces them
    nvext: dict[str, Any]


def read_request(body: bytes, endpoint: Endpoint, *, scanned: bool = False) -> Request | None:
    """Read `body` as vLLM will; None when it opts into nothing (it then goes to vLLM as sent).

    `scanned`: the caller already found that `might_opt_in(body)` (an `OptInScan` over the body
    as it arrived), so the body is not scanned again.

    A body vLLM cannot decode (not JSON, nested deeper than Python allows) or that is not an
    object is None too: vLLM refuses it with its own error whatever it holds. Raises
    RequestError when a field the middleware decides on is invalid (vLLM refuses those too).
    """
    if not scanned and not might_opt_in(body):
        return None
    try:
        data = _json.loads_as_vllm(body)
    except (ValueError, RecursionError):
        return None  # vLLM answers with its own 400
    if not isinstance(data, dict):
        return None
    return_token_ids = _read_fields(data, endpoint, ("return_token_ids",)).return_token_ids
    if return_token_ids is not True and "nvext" not in data:
        return None  # opts into nothing
    fields = _read_fields(data, endpoint)
    nvext = data.get("nvext")
    if nvext is None:
        nvext = {}
    elif not isinstance(nvext, dict):
        raise RequestError(f"`nvext` must be an object, got {_json_type(nvext)}", "nvext")
    _validate_nvext(nvext)
    return Request(endpoint, body, data, fields, nvext)


def plan_request(body: bytes, endpoint: Endpoint, mode: Mode, *, dp_rank_header: bytes | None = None) -> Plan | None:
    """Validate and normalize `body`; None means pass the request through untouched.

    Raises RequestError for a request vLLM reads but either dialect refuses.
    """
    request = read_request(body, endpoint)
    return None if request is None else plan(request, mode, dp_rank_header=dp_rank_header)


def plan(request: Request, mode: Mode, *, dp_rank_header: bytes | None = None) -> Plan:
    """The Plan for a request that opts in. `dp_rank_header` is the client's first `X-data-parallel-rank`."""
    endpoint, data, fields, nvext = request.endpoint, request.data, request.fields, request.nvext
    return_token_ids = fields.return_token_ids is True
    requested = set(nvext.get("extra_fields") or [])
    nvext_ids = requested & ID_SELECTORS
    # docs/protocol.md §3.4: `return_token_ids: true` is an alias of the completion_token_ids selector.
    normalized = set(requested)
    if return_token_ids:
        normalized.add(COMPLETION_TOKEN_IDS)
    ids_requested = bool(normalized & ID_SELECTORS)

    if mode is Mode.AUTO:
        vllm_ids = return_token_ids
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
    if PROMPT_LOGPROBS in selectors and fields.prompt_logprobs is None:
        selectors = selectors - {PROMPT_LOGPROBS}  # only answered when vLLM's prompt_logprobs is set

    prompts = _num_prompts(fields) if endpoint is Endpoint.COMPLETIONS else 1
    n = fields.n if fields.n is not None and fields.n > 0 else 1
    if nvext_trio and n * prompts > 1:
        raise RequestError(
            f'`nvext.extra_fields=["{COMPLETION_TOKEN_IDS}"]` requires exactly one generated choice', "n"
        )
    if prompts > 1:
        asked = selectors | ({PROMPT_TOKEN_IDS} if nvext_prompt_ids else set())
        single_prompt = [s for s in SINGLE_PROMPT_SELECTORS if s in asked]
        if single_prompt:
            name = single_prompt[0]
            raise RequestError(f'`nvext.extra_fields=["{name}"]` requires a single prompt, got a batch', "prompt")

    # timing's ttft_ms is the first chunk carrying a token id: ask for ids to see them.
    needs_ids = vllm_ids or nvext_trio or nvext_prompt_ids or bool(selectors & {ENGINE_DATA, TIMING})
    rewrite = _Rewrite()
    if "nvext" in data:
        rewrite.drop("nvext")
    if needs_ids and not return_token_ids:
        rewrite.set("return_token_ids", "true")
    headers = _apply_nvext_fields(rewrite, request, dp_rank_header)
    echo = endpoint is Endpoint.COMPLETIONS and fields.echo is True
    return Plan(
        endpoint=endpoint,
        vllm_ids=vllm_ids,
        nvext_trio=nvext_trio,
        nvext_prompt_ids=nvext_prompt_ids,
        selectors=selectors,
        strip_vllm_ids=needs_ids and not vllm_ids,
        # vLLM sends prompt ids by itself only on completions streams with echo.
        echo=echo and fields.stream is True,
        # vLLM leaves the echoed prompt out of `text` whenever `return_token_ids` is on.
        echo_text_lost=echo and needs_ids and not return_token_ids,
        logprobs=_logprobs_requested(fields, endpoint),
        body=rewrite.apply(request.body),
        headers=headers,
        dialect=("both" if "nvext" in data else "vllm") if return_token_ids else "nvext",
        stream=fields.stream is True,
        single_choice=n * prompts == 1,
        await_usage=fields.stream is True and n * prompts == 1 and bool(selectors & {TIMING, ENGINE_DATA}),
    )


class _Rewrite:
    """Root members to drop or set; everything else reaches vLLM as the client wrote it."""

    __slots__ = ("dropped", "added", "kv_prompt_ids")

    def __init__(self) -> None:
        self.dropped: set[str] = set()
        self.added: dict[str, str] = {}
        self.kv_prompt_ids: list[int] | None = None

    def drop(self, key: str) -> None:
        self.dropped.add(key)

    def set(self, key: str, encoded: str) -> None:
        self.dropped.add(key)
        self.added[key] = encoded

    def apply(self, body: bytes) -> bytes | None:
        if not self.dropped and self.kv_prompt_ids is None:
            return None
        text = _json.text_of(body)
        start = len(text) - len(text.lstrip(" \t\n\r"))
        if self.kv_prompt_ids is not None:
            members, _ = _json.object_members(text, start)
            kv = [m for m in members if m.key == "kv_transfer_params"]
            ids = _json.dumps_text(self.kv_prompt_ids)
            if kv and text[kv[-1].value_start] == "{":  # the last duplicate is the one vLLM reads
                value = text[kv[-1].value_start : kv[-1].end]
                self.set(
                    "kv_transfer_params",
                    _json.splice_object(value, 0, frozenset({PROMPT_TOKEN_IDS}), [(PROMPT_TOKEN_IDS, ids)]),
                )
            else:
                self.set("kv_transfer_params", f'{{"{PROMPT_TOKEN_IDS}":{ids}}}')
        text = _json.splice_object(text, start, frozenset(self.dropped), list(self.added.items()))
        return _json.encode_text(text)


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
            raise RequestError(f"`{where}.{key}` must be {kind}, got {_describe(value, check)}", f"{where}.{key}")


def _apply_nvext_fields(
    rewrite: _Rewrite, request: Request, dp_rank_header: bytes | None
) -> tuple[tuple[bytes, bytes], ...]:
    """Map the nvext request fields vLLM has an equivalent for; routing-only ones are dropped."""
    nvext, data = request.nvext, request.data
    if nvext.get("greed_sampling") is True:
        rewrite.set("temperature", "0.0")
    salt = nvext.get("cache_salt")
    if salt:  # an empty salt counts as absent, as in Dynamo
        rewrite.set("cache_salt", _json.dumps_text(salt))  # nvext wins over a root cache_salt, as in Dynamo
    budget = nvext.get("max_thinking_tokens")
    if budget is not None and data.get("thinking_token_budget") is None:
        # A root thinking_token_budget wins, as in Dynamo.
        if _vllm_compat.has_thinking_token_budget():
            rewrite.set("thinking_token_budget", str(budget))
        else:
            logger.debug("nvext.max_thinking_tokens ignored: this vLLM has no thinking_token_budget")
    token_data = nvext.get("token_data")
    if token_data is not None:
        if not token_data:
            raise RequestError("`nvext.token_data` must not be empty", "nvext.token_data")
        if request.endpoint is Endpoint.COMPLETIONS:
            rewrite.set("prompt", _json.dumps_text(token_data))
        else:
            _chat_from_token_ids(rewrite, request, token_data)
    dp_rank = nvext.get("dp_rank")
    if dp_rank is None:
        return ()
    if dp_rank_header is not None:
        client_rank = _vllm_rank(dp_rank_header)
        if client_rank != dp_rank:
            raise RequestError(
                f"`nvext.dp_rank` ({dp_rank}) conflicts with the X-data-parallel-rank header "
                f"({dp_rank_header.decode('latin-1')!r}); send one of them, or the same rank in both",
                "nvext.dp_rank",
            )
        return ()  # the client's header already says the same rank
    return ((b"x-data-parallel-rank", str(dp_rank).encode()),)


def _vllm_rank(value: bytes) -> int | None:
    """The rank vLLM reads from an `X-data-parallel-rank` value (`int(...)`, else none)."""
    try:
        return int(value.decode("latin-1"))
    except ValueError:
        return None


def _chat_from_token_ids(rewrite: _Rewrite, request: Request, token_data: list[int]) -> None:
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
    if request.fields.echo or _has_non_text_content(request.data.get("messages")):
        # vLLM would then render the messages and silently ignore the ids.
        raise RequestError(
            "`nvext.token_data` cannot be combined with `echo` or non-text message content", "nvext.token_data"
        )
    rewrite.kv_prompt_ids = token_data


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


def _num_prompts(fields: Any) -> int:
    """How many prompts vLLM serves for a completions request (a batch is several)."""
    prompt, embeds = fields.prompt, fields.prompt_embeds
    count = 0
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        count += len(prompt)  # a list of strings or of id lists
    elif prompt is not None:
        count += 1
    if isinstance(embeds, list):
        count += len(embeds)
    elif embeds is not None:
        count += 1
    return max(count, 1)


def _logprobs_requested(fields: Any, endpoint: Endpoint) -> bool:
    lp = fields.logprobs
    if endpoint is Endpoint.CHAT:
        return lp is True
    return lp is not None and lp >= 0


def _describe(value: Any, check: Callable[[Any], bool]) -> str:
    """What is wrong with `value`: for a list, its first bad element and where it is."""
    if isinstance(value, list) and check in (_is_uint_list, _is_str_list):
        item = _is_uint if check is _is_uint_list else _is_str
        for i, element in enumerate(value):
            if not item(element):
                shown = (
                    _json.dumps_text(element) if isinstance(element, (bool, int, float, str)) else _json_type(element)
                )
                return f"{shown} at index {i}"
    return _json_type(value)


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
    """vLLM's error envelope (docs/protocol.md §9)."""
    kind = {400: "BadRequestError", 413: "RequestEntityTooLarge"}.get(status, "BadRequestError")
    return _json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})

"""vLLM's reading of the request fields the middleware decides on (pydantic, as vLLM coerces them).

The same pydantic annotations as vLLM 0.32's request models, so the same lax coercion
(`"2"` and `2.0` are 2, `"true"` and `1` are true, `[72.0, 105.0]` is one prompt of ids).
Inside a vLLM server the field definitions are taken from vLLM's own models instead. pydantic
comes with vLLM; it is imported on the first request, so the CLI works without it.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from dataclasses import dataclass
from typing import Annotated, Any

from ..config import keep
from ..protocol import Endpoint, RequestError
from .nvext_schema import KEY_LIST_MAX as _NVEXT_LIST_MAX
from .nvext_schema import KEY_STR_MAX as _NVEXT_STR_MAX

_VLLM_MODELS = {
    Endpoint.COMPLETIONS: (
        ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
        ("vllm.entrypoints.openai.protocol", "CompletionRequest"),
    ),
    Endpoint.CHAT: (
        ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
        ("vllm.entrypoints.openai.protocol", "ChatCompletionRequest"),
    ),
    Endpoint.CHAT_BATCH: (("vllm.entrypoints.openai.chat_completion.protocol", "BatchChatCompletionRequest"),),
}
_readers: dict[tuple[Endpoint, bool], Any] = {}


@dataclass(frozen=True, slots=True)
class DecisionFields:
    """The decision fields of one request with the types vLLM's request models coerce them to.

    Over both endpoints (vLLM 0.32's CompletionRequest and ChatCompletionRequest); a field the
    endpoint's model does not have holds the default here.
    """

    return_token_ids: bool | None = None
    n: int | None = 1  # completions: an int; chat: also None
    # Completions only: one prompt (ids or a text) or a batch of them; embeddings (base64 bytes).
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    prompt_embeds: bytes | list[bytes] | None = None
    echo: bool | None = False
    # Completions: a count of top logprobs (None: none); chat: a bool.
    logprobs: int | bool | None = None
    stream: bool | None = False
    prompt_logprobs: int | None = None
    kv_transfer_params: dict[str, Any] | None = None
    include_reasoning: bool = True  # chat only


# The fields read, over both endpoints: the replica models' fields (metrics names its refusal labels by them).
DECISION_FIELDS = frozenset(field.name for field in dataclasses.fields(DecisionFields))

# vLLM's /invocations tries its request models in this order and serves the body on the first that
# validates it (`get_generate_invocation_types`: chat, then completions), else answers its own 400.
INVOCATION_ORDER = (Endpoint.CHAT, Endpoint.COMPLETIONS)


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
        prompt: token_ids | list[token_ids] | str | list[str] | None = None
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
        include_reasoning: bool = True

    _readers[(Endpoint.COMPLETIONS, False)] = CompletionFields
    _readers[(Endpoint.CHAT, False)] = ChatFields
    _readers[(Endpoint.CHAT_BATCH, False)] = ChatFields  # vLLM's batch model has no `stream`: the replica's reads it
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
    for module_name, _ in _VLLM_MODELS[endpoint]:
        if module_name in sys.modules:
            break
    else:  # no vLLM serving code loaded (yet): the replica
        return _readers.get((endpoint, False)) or replica_model(endpoint)
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


def read_fields(data: dict[str, Any], endpoint: Endpoint, names: tuple[str, ...] | None = None) -> DecisionFields:
    """The decision fields of `data` (only `names` of them when given) as vLLM reads them; raises RequestError."""
    reader = field_reader(endpoint)
    if names is not None:
        data = {k: data[k] for k in names if k in data}
    key = _scalar_key(reader, data)
    if key is not None:
        known = _READ.get(key)
        if known is not None:
            return known
    try:
        fields = DecisionFields(**reader.model_validate(data).__dict__)
    except _validation_error() as exc:
        error = exc.errors(include_url=False)[0]
        name = str(error["loc"][0]) if error["loc"] else None
        raise RequestError(f"`{name}` is invalid for vLLM: {error['msg']}", name) from None
    if key is not None:
        keep(_READ, key, fields, _READ_MAX)  # made-up values cannot grow it
    return fields


# What `read_fields` read, by (reader, each of the reader's fields in the body with its type and
# value) for bodies whose decision fields are all scalars (what clients send: `stream: true`,
# `n: 1`, `return_token_ids: true`): the reader's fields are validated one by one, with no model
# validator, so the same fields and values read the same; a value that fails is never kept.
_READ: dict[tuple[Any, ...], DecisionFields] = {}
_READ_MAX = 4096
_SCALARS = (type(None), bool, int, str)
_KEY_STR_MAX = 64
_plain_fields: dict[Any, tuple[str, ...] | None] = {}


def _scalar_key(reader: Any, data: dict[str, Any]) -> tuple[Any, ...] | None:
    """`_READ`'s key for `data`; None when a field holds something else (a prompt of ids, an object)."""
    names = _plain_fields.get(reader, ())
    if names == ():
        names = _plain_fields[reader] = _field_names(reader)
    if names is None:
        return None
    key: list[Any] = [reader]
    for name in names:
        if name in data:
            value = data[name]
            kind = type(value)
            if kind not in _SCALARS or (kind is str and len(value) > _KEY_STR_MAX):
                return None
            key += (name, kind, value)
    return tuple(key)


def reading_key(data: dict[str, Any], endpoint: Endpoint) -> tuple[Any, ...] | None:
    """A key for all that `inbound.request.read_request` reads from the body `data` on `endpoint` (not
    the chat batch route): the reader, each of its fields in `data` and each member of `data`'s
    `nvext`, each with its type and value; None when one is not a plain value.

    One reading per body for the common case: bodies with the same key read the same (the decision
    fields as `_scalar_key`'s argue, `nvext` as `nvext_schema._plain_key`'s), and the key is made only
    of what those two keys are made of (tests/unit/test_request_fidelity.py::
    test_one_reading_per_body_is_the_two_readings).
    """
    reader = _readers.get((endpoint, True))
    if reader is None:
        reader = field_reader(endpoint)
    names = _plain_fields.get(reader, ())
    if names == ():
        names = _plain_fields[reader] = _field_names(reader)
    if names is None:
        return None
    key: list[Any] = [reader]
    for name in names:
        if name in data:
            value = data[name]
            kind = type(value)
            if kind not in _SCALARS or (kind is str and len(value) > _KEY_STR_MAX):
                return None
            key += (name, kind, value)
    nvext = data.get("nvext", key)  # `key`: no `nvext`
    if nvext is None:
        key.append(_NULL_NVEXT)
    elif nvext is not key:
        if type(nvext) is not dict:
            return None  # refused, or read anew
        key.append(_NVEXT)
        for name, value in nvext.items():
            kind = type(value)
            if kind is list:
                if len(value) > _NVEXT_LIST_MAX:
                    return None
                for item in value:
                    if type(item) is not str or len(item) > _NVEXT_STR_MAX:
                        return None
                value = tuple(value)
            elif kind not in _SCALARS or (kind is str and len(value) > _NVEXT_STR_MAX):
                return None
            key += (name, kind, value)
    return tuple(key)


# In a `reading_key`, after the fields: `nvext` is null, or the members of an `nvext` object follow.
_NULL_NVEXT, _NVEXT = object(), object()


def _field_names(reader: Any) -> tuple[str, ...] | None:
    """The reader's fields, each read from the body under its name alone; None when one reads another key."""
    fields = reader.model_fields
    if reader.model_config.get("populate_by_name") or any(
        info.alias is not None or info.validation_alias is not None for info in fields.values()
    ):
        return None
    return tuple(fields)


def _validation_error() -> Any:
    """pydantic's ValidationError (pydantic is imported on the first request)."""
    from pydantic import ValidationError

    return ValidationError


def _vllm_model_for_invocations(endpoint: Endpoint) -> Any:
    """vLLM's own request model for /invocations: loaded in a vLLM server, by `load_request_models` at the
    proxy's start-up; never imported here, on a request (None: the pinned rule)."""
    return vllm_request_model(endpoint)


def load_request_models() -> None:
    """What reading a request would otherwise import or build on first use (pydantic, the replicas, and
    vLLM's request models where vLLM is installed): for a server to call at start-up, before serving."""
    for endpoint, candidates in _VLLM_MODELS.items():
        replica_model(endpoint)
        for module_name, _ in candidates:
            try:
                importlib.import_module(module_name)
            except Exception:  # no vLLM here, or another layout: the next, else the pinned rule
                continue
            break
        field_reader(endpoint)


def _pinned_accepts(data: dict[str, Any], endpoint: Endpoint) -> bool:
    """Without vLLM: vLLM 0.32's chat model needs `messages`, a list of messages with a role."""
    from pydantic import ValidationError

    if endpoint is Endpoint.CHAT:
        messages = data.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            return False
    try:
        replica_model(endpoint).model_validate(data)
    except ValidationError:
        return False
    return True


def invocation_route(data: dict[str, Any]) -> Endpoint | None:
    """The route vLLM serves an /invocations body on, decided as vLLM decides it; None: neither (vLLM's 400).

    vLLM's own models validate the body in vLLM's order (docs/protocol.md §10); only /invocations
    bodies pay for the full validation.
    """
    from pydantic import ValidationError

    # `nvext` is no field of vLLM's (it never reaches vLLM): left out, so vLLM's "ignored fields"
    # warning is not logged for it.
    data = {k: v for k, v in data.items() if k != "nvext"}
    for endpoint in INVOCATION_ORDER:
        model = _vllm_model_for_invocations(endpoint)
        if model is None:
            if _pinned_accepts(data, endpoint):
                return endpoint
            continue
        try:
            model.model_validate(data)
        except ValidationError:
            continue  # vLLM tries the next model
        except Exception:
            return None  # vLLM's validator raised something else: vLLM answers it itself
        return endpoint
    return None

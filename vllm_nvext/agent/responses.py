"""Token ids on the routes agent harnesses speak: /v1/responses (Codex) and /v1/messages (Claude Code).

docs/protocol.md §11. On /v1/responses vLLM's own placement is `enable_response_messages`
(`input_messages` / `output_messages`, each entry with its `tokens`): the middleware turns it on
for a request that opts in, answers the nvext placement from it (a root `nvext` on the response
object, in a stream on the `response` of the event that ends it), and takes back out whatever
only it caused. What a body on either route opts into is read here (`opt_in`); /v1/messages' plan
and answer are in messages.py. Pure: `route.ResponsesSend`, the ASGI `send` that reshapes vLLM's answer, runs it.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from .. import _json, _vllm_compat
from ..config import Mode
from ..inbound.fields import DecisionFields
from ..inbound.nvext_schema import json_type, validate_nvext
from ..inbound.reading import Request
from ..inbound.request import BodyRewrite, apply_nvext_fields, placements
from ..outbound.sse import EventFramer
from ..protocol import (
    COMPLETION_TOKEN_IDS,
    ID_SELECTORS,
    NVEXT_ONLY_SELECTORS,
    PROMPT_TOKEN_IDS,
    Dialect,
    Endpoint,
    Placement,
    RequestError,
)
from .logprobs import STRIPPED_TOKENS, include_with_logprobs, strip_event, strip_response


class AgentRoute(str, enum.Enum):
    RESPONSES = "responses"
    MESSAGES = "messages"


# Read by the middleware next to protocol.ENDPOINT_PATHS (relative to vLLM's root path).
AGENT_PATHS = {"/v1/responses": AgentRoute.RESPONSES, "/v1/messages": AgentRoute.MESSAGES}

# The events that end a Responses stream; the one vLLM sends carries the whole response object.
TERMINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
_TERMINAL_TOKENS = tuple(f'"type":"{name}"'.encode() for name in TERMINAL_EVENTS)
_VLLM_MESSAGES = ("input_messages", "output_messages")
_LINE = re.compile(rb"[^\r\n]*(?:\r\n|\r|\n)")


def data_span(event: bytes) -> tuple[int, int] | None:
    """The span of the value of the one `data:` line of an event (vLLM writes `event:` first); else None."""
    span = None
    for line in _LINE.finditer(event):
        start = line.start()
        if event.startswith(b"data:", start):
            if span is not None:
                return None  # multi-line data: left as it came
            value = start + (6 if event[start + 5 : start + 6] == b" " else 5)
            span = (value, start + len(line.group().rstrip(b"\r\n")))
    return span


@dataclass(frozen=True, slots=True)
class ResponsesPlan:
    """What to send vLLM for one /v1/responses request that opts in, and how to reshape the answer."""

    # The client gets vLLM's own placement: `input_messages` / `output_messages` with `tokens`.
    vllm_placement: bool
    # Root `nvext` with completion_token_ids, prompt_token_ids (and kv_transfer_params when vLLM reports one).
    nvext_trio: bool
    # Root `nvext` with prompt_token_ids alone.
    nvext_prompt_ids: bool
    # The middleware turned `enable_response_messages` on: vLLM's copies go back to null.
    strip_messages: bool
    # The client sent a root `kv_transfer_params`: vLLM's stays at the root in every mode.
    kv_stays_at_root: bool
    stream: bool
    # The rewritten upstream body; None keeps the client's bytes.
    body: bytes | None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    dialect: Dialect = Dialect.VLLM
    capture: bool = False  # the operator captures it (docs/capture.md): the answer goes past the tap
    # The capture turned the output text's logprobs on (VLLM_NVEXT_CAPTURE_LOGPROBS): taken back out (logprobs.py).
    strip_logprobs: bool = False

    @property
    def reshapes(self) -> bool:
        return self.nvext_trio or self.nvext_prompt_ids or self.strip_messages or self.capture

    @property
    def asks_ids(self) -> bool:
        return self.vllm_placement or self.nvext_trio or self.nvext_prompt_ids


def root_flag(data: dict[str, Any], name: str) -> bool:
    """A root bool as vLLM reads it (pydantic's lax bool: "true", 1 and "yes" are true)."""
    if name not in data or data[name] is None:
        return False
    from pydantic import TypeAdapter, ValidationError

    try:
        return bool(TypeAdapter(bool).validate_python(data[name]))
    except ValidationError:
        raise RequestError(f"`{name}` is invalid for vLLM: Input should be a valid boolean", name) from None


def _read(body: bytes) -> dict[str, Any] | None:
    """The body as vLLM reads it, when it opts in; None passes it through untouched."""
    data = _json.object_as_vllm(body)
    if data is None:
        return None  # vLLM answers with its own 400
    if "nvext" not in data and not root_flag(data, "return_token_ids"):
        return None
    return data


@dataclass(frozen=True, slots=True)
class OptIn:
    """What a body on an agent route asks for, read in the server's or the header's mode."""

    data: dict[str, Any]
    nvext: dict[str, Any]
    return_token_ids: bool
    vllm_placement: bool
    nvext_trio: bool
    nvext_prompt_ids: bool

    @property
    def ids(self) -> bool:
        return self.vllm_placement or self.nvext_trio or self.nvext_prompt_ids

    @property
    def dialect(self) -> Dialect:
        return (Dialect.BOTH if "nvext" in self.data else Dialect.VLLM) if self.return_token_ids else Dialect.NVEXT

    def rewrite(self, body: bytes, dp_rank_header: bytes | None) -> tuple[BodyRewrite, tuple[tuple[bytes, bytes], ...]]:
        """vLLM reads neither `nvext` nor `return_token_ids` here: both go; nvext request fields become vLLM's."""
        rewrite = BodyRewrite()
        for key in ("nvext", "return_token_ids"):
            if key in self.data:
                rewrite.drop(key)
        request = Request(Endpoint.CHAT, body, self.data, DecisionFields(), self.nvext)
        return rewrite, apply_nvext_fields(rewrite, request, dp_rank_header)


def opt_in(body: bytes, mode: Mode, route: str) -> OptIn | None:
    data = _read(body)
    if data is None:
        return None
    return_token_ids = root_flag(data, "return_token_ids")
    nvext = data.get("nvext")
    if nvext is None:
        nvext = {}
    elif not isinstance(nvext, dict):
        raise RequestError(f"`nvext` must be an object, got {json_type(nvext)}", "nvext")
    validate_nvext(nvext)
    requested = set(nvext.get("extra_fields") or [])
    unanswered = sorted(requested & NVEXT_ONLY_SELECTORS)
    if unanswered:
        raise RequestError(
            f'`nvext.extra_fields=["{unanswered[0]}"]` is not answered on {route}; '
            f"its selectors there are {COMPLETION_TOKEN_IDS} and {PROMPT_TOKEN_IDS}",
            "nvext.extra_fields",
        )
    for name in ("token_data", "max_thinking_tokens"):
        # vLLM's Responses API takes `thinking_token_budget` from 0.34 on (the nvext field is sent as it).
        why = _vllm_compat.max_thinking_tokens_refusal(route) if name == "max_thinking_tokens" else ""
        if nvext.get(name) is not None and why is not None:
            raise RequestError(f"`nvext.{name}` is not supported on {route}{why}", f"nvext.{name}")
    normalized = requested | ({COMPLETION_TOKEN_IDS} if return_token_ids else set())
    ids_requested = bool(normalized & ID_SELECTORS)
    where = placements(mode, return_token_ids, bool(requested & ID_SELECTORS), ids_requested)
    nvext_placement = Placement.NVEXT in where
    nvext_trio = nvext_placement and COMPLETION_TOKEN_IDS in normalized
    return OptIn(data, nvext, return_token_ids, Placement.VLLM in where, nvext_trio, nvext_placement and not nvext_trio)


def plan_responses(
    body: bytes, mode: Mode, *, dp_rank_header: bytes | None = None, capture: bool = False, logprobs: bool = False
) -> ResponsesPlan | None:
    """The plan for a /v1/responses body; None means pass it through untouched.

    `capture`: captured, so `enable_response_messages` upstream (taken back out unless the client asked), and
    with `logprobs` (VLLM_NVEXT_CAPTURE_LOGPROBS) the output text's logprobs (likewise: logprobs.py).
    Raises RequestError for what vLLM reads but cannot be answered with ids.
    """
    opt = opt_in(body, mode, "/v1/responses")
    if opt is None:
        data = _json.object_as_vllm(body) if capture else None
        if data is None:
            return None
        opt = OptIn(data, {}, False, False, False, False)  # captured alone: nothing to answer
    data = opt.data
    if opt.ids and root_flag(data, "background"):
        # vLLM answers a background request at once, before anything is generated.
        raise RequestError("token ids on /v1/responses cannot be combined with `background`", "background")
    client_enabled = root_flag(data, "enable_response_messages")
    captured = capture and not root_flag(data, "background")  # vLLM answers a background request at once
    rewrite, headers = opt.rewrite(body, dp_rank_header)
    strip = (opt.nvext_trio or opt.nvext_prompt_ids or captured) and not opt.vllm_placement and not client_enabled
    if (opt.ids or captured) and not client_enabled:
        rewrite.set("enable_response_messages", "true")
    include = include_with_logprobs(data) if captured and logprobs else None
    if include is not None:
        rewrite.set("include", include)
    return ResponsesPlan(
        vllm_placement=opt.vllm_placement,
        nvext_trio=opt.nvext_trio,
        nvext_prompt_ids=opt.nvext_prompt_ids,
        strip_messages=strip,
        kv_stays_at_root=data.get("kv_transfer_params") is not None,
        stream=root_flag(data, "stream"),
        body=rewrite.apply(body),
        headers=headers,
        dialect=opt.dialect if opt.ids or opt.nvext or "nvext" in data else Dialect.NONE,
        capture=captured,
        strip_logprobs=include is not None,
    )


def rust_frontend_refusal(plan: ResponsesPlan, version: str) -> RequestError:
    """Ids asked on /v1/responses of vLLM's Rust frontend, which refuses `enable_response_messages`, where
    vLLM puts them (0.33's has no /v1/responses): a 400 naming the client's field, never an answer without ids."""
    field = "return_token_ids" if plan.dialect is Dialect.VLLM else "nvext.extra_fields"
    return RequestError(
        f"`{field}` cannot be answered on /v1/responses: the upstream is vLLM's Rust frontend (vllm-rs "
        f"{version}), which does not support enable_response_messages, where vLLM puts the ids; "
        "ask /v1/chat/completions for them",
        field,
    )


# --- the answer ----------------------------------------------------------------------------------


def _tokens(entry: Any) -> list[int] | None:
    tokens = entry.get("tokens") if isinstance(entry, dict) else None
    return tokens if isinstance(tokens, list) else None


def response_ids(response: dict[str, Any]) -> tuple[list[int] | None, list[int] | None]:
    """(completion ids, prompt ids) from vLLM's `output_messages` / `input_messages`; None: not reported.

    vLLM's first input entry holds the prompt; its output entries are the completion of each round,
    and from the second round on the round's prompt before it (completions at even positions).
    """
    inputs, outputs = response.get("input_messages"), response.get("output_messages")
    prompt = _tokens(inputs[0]) if isinstance(inputs, list) and inputs else None
    completion: list[int] | None = None
    if isinstance(outputs, list):
        completion = []
        for entry in outputs[::2]:
            tokens = _tokens(entry)
            if tokens is None:
                return None, prompt  # entries without ids (e.g. Harmony messages): not reported
            completion += tokens
    return completion, prompt


def reshape_response(response: dict[str, Any], plan: ResponsesPlan) -> bool:
    """Reshape one response object in place, as the plan says; False when nothing changed."""
    if not plan.reshapes:
        return False
    completion, prompt = response_ids(response)
    if plan.nvext_trio or plan.nvext_prompt_ids:
        nvext: dict[str, Any] = {}
        if plan.nvext_trio:
            nvext[COMPLETION_TOKEN_IDS] = completion
            kv = response.get("kv_transfer_params")
            if kv is not None:
                nvext["kv_transfer_params"] = kv
                if not plan.vllm_placement and not plan.kv_stays_at_root:
                    response["kv_transfer_params"] = None
        nvext[PROMPT_TOKEN_IDS] = prompt
        response["nvext"] = nvext
    if plan.strip_messages:
        for key in _VLLM_MESSAGES:
            if key in response:
                response[key] = None  # what vLLM writes without enable_response_messages
    if plan.strip_logprobs:
        strip_response(response)
    return True


def reshape_unary(body: bytes, plan: ResponsesPlan, tap: Any = None) -> bytes | None:
    """The client's bytes for a unary answer, or None to forward vLLM's. Raises ValueError on non-JSON."""
    obj = _json.loads(body)
    if not isinstance(obj, dict) or obj.get("object") != "response":
        return None
    if tap is not None:
        tap.response(obj)
    return _json.dumps(obj) if reshape_response(obj, plan) else None


class ResponsesStream:
    """A Responses stream: only the event that ends it is decoded and reshaped; the rest pass as sent."""

    __slots__ = ("plan", "_framer", "tap")

    def __init__(self, plan: ResponsesPlan, tap: Any = None) -> None:
        self.plan = plan
        self._framer = EventFramer()
        self.tap = tap  # the capture tap (`capture.tap.Collector.response`): told the final response object

    def feed(self, body: bytes) -> bytes:
        events = self._framer.feed(body)
        return b"".join(self._event(event) for event in events)

    def flush(self) -> bytes:
        return self._framer.flush()

    def _event(self, event: bytes) -> bytes:
        # Inside a JSON string every quote is escaped: these byte runs are the event's own type.
        if not any(token in event for token in _TERMINAL_TOKENS) and not (
            self.plan.strip_logprobs and any(token in event for token in STRIPPED_TOKENS)
        ):
            return event
        span = data_span(event)
        if span is None:
            return event
        start, end = span
        try:
            obj = _json.loads(event[start:end])
        except ValueError:
            return event
        response = obj.get("response") if isinstance(obj, dict) else None
        if obj.get("type") not in TERMINAL_EVENTS or not isinstance(response, dict):
            # Any other event changes only where the capture's logprobs are taken out of it.
            changed = self.plan.strip_logprobs and strip_event(obj)
            return event[:start] + _json.dumps(obj) + event[end:] if changed else event
        if self.tap is not None:
            self.tap.response(response)
        if not reshape_response(response, self.plan):
            return event
        return event[:start] + _json.dumps(obj) + event[end:]

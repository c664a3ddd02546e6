"""Pure request side: validate a token-endpoint body and normalize both dialects into a Plan.

`return_token_ids` (vLLM) and `nvext.extra_fields` (Dynamo) fold into one nvext form; vLLM
then receives `return_token_ids: true` and no `nvext`. See docs/protocol.md §1 and §3.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import _json
from ..config import Mode, keep
from ..protocol import (
    COMPLETION_TOKEN_IDS,
    ENGINE_DATA,
    ID_SELECTORS,
    NVEXT_ONLY_SELECTORS,
    PROMPT_LOGPROBS,
    PROMPT_TOKEN_IDS,
    TIMING,
    Dialect,
    Endpoint,
    Placement,
    RequestError,
)
from .choices import capture_logprobs, choices, conversations, echo_prompts, logprobs_requested
from .fields import DecisionFields, invocation_route, read_fields, reading_key
from .nvext_map import apply_nvext_fields as apply_nvext_fields  # re-exported: the agent routes map it too
from .nvext_schema import json_type, read_nvext
from .optin import might_opt_in
from .plan import Plan
from .reading import Reading, Request
from .rewrite import BodyRewrite as BodyRewrite  # re-exported: the agent routes rewrite bodies too
from .rewrite import SpliceRoot


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
    data = _json.object_as_vllm(body)
    if data is None:
        return None  # vLLM answers with its own 400
    if endpoint is Endpoint.INVOCATIONS:
        route = invocation_route(data)
        if route is None:
            return None  # vLLM's own 400: no request model of its takes the body
        endpoint = route
    key = None
    if endpoint is Endpoint.CHAT_BATCH:
        if not conversations(data.get("messages")):
            return None  # vLLM's own validation error: `messages` is not a list of conversations
    else:
        # One reading per body: plain decision fields and `nvext` read before are not read again.
        key = reading_key(data, endpoint)
        reading = _READINGS.get(key) if key is not None else None
        if reading is not None:
            request = _new(Request)  # with the members `Request(...)` sets
            vars(request).update(endpoint=endpoint, body=body, data=data, fields=reading.fields,
                                 nvext=reading.nvext, reading=reading)  # fmt: skip
            return request
    read = _read_anew(data, endpoint)
    if read is None:
        return None  # opts into nothing
    fields, nvext = read
    if key is None:
        return Request(endpoint, body, data, fields, nvext)
    # Plain: both readings are the kept ones (`fields.reading_key`'s rules are theirs).
    reading = keep(_READINGS, key, Reading(fields, nvext), _READINGS_MAX)  # made-up values cannot grow it
    return Request(endpoint, body, data, fields, nvext, reading)


def _read_anew(data: dict[str, Any], endpoint: Endpoint) -> tuple[DecisionFields, dict[str, Any]] | None:
    """The decision fields and `nvext` of `data` as read without a kept reading; None when it opts into
    nothing. Raises RequestError as `read_request` says."""
    if "nvext" not in data:
        # Shortcut: a literal `true` reads as true (vLLM's field is a bool), so only another value is
        # read alone first: tests/unit/test_request_fidelity.py::test_decision_matches_vllms_own_parse.
        if (
            data.get("return_token_ids") is not True
            and read_fields(data, endpoint, ("return_token_ids",)).return_token_ids is not True
        ):
            return None
        return read_fields(data, endpoint), {}
    # Shortcut: the nvext dialect opts in whatever return_token_ids says, so the fields are
    # read once; on an error return_token_ids is read alone first, as the opt-in test reads
    # it, so the same field is named:
    # tests/unit/test_request.py::test_nvext_dialect_names_the_field_the_two_reads_named.
    try:
        fields = read_fields(data, endpoint)
    except RequestError:
        read_fields(data, endpoint, ("return_token_ids",))
        raise
    nvext = data["nvext"]
    if nvext is None:
        nvext = {}
    elif not isinstance(nvext, dict):
        raise RequestError(f"`nvext` must be an object, got {json_type(nvext)}", "nvext")
    return fields, read_nvext(nvext)  # kept per value when plain


_new = object.__new__  # an instance whose members are then set without entering its __init__
# Readings by `fields.reading_key` (never the chat batch route's).
_READINGS: dict[tuple[Any, ...], Reading] = {}
_READINGS_MAX = 1024


def plan_request(body: bytes, endpoint: Endpoint, mode: Mode, *, dp_rank_header: bytes | None = None) -> Plan | None:
    """Validate and normalize `body`; None means pass the request through untouched.

    Raises RequestError for a request vLLM reads but either dialect refuses.
    """
    request = read_request(body, endpoint)
    return None if request is None else plan(request, mode, dp_rank_header=dp_rank_header)


_VLLM, _NVEXT, _BOTH = frozenset({Placement.VLLM}), frozenset({Placement.NVEXT}), frozenset(Placement)
_TIMED = frozenset({ENGINE_DATA, TIMING})  # selectors answered from vLLM's per-request metrics


def placements(mode: Mode, return_token_ids: bool, nvext_ids: bool, ids_requested: bool) -> frozenset[Placement]:
    """Where the ids go, by mode (docs/protocol.md §6): `auto` answers each dialect in its own
    placement, `vllm` / `nvext` put every request's ids in one, `both` in both; empty: nowhere."""
    if mode is Mode.AUTO:
        return (_BOTH if nvext_ids else _VLLM) if return_token_ids else (_NVEXT if nvext_ids else frozenset())
    if not ids_requested:
        return frozenset()
    return _VLLM if mode is Mode.VLLM else _NVEXT if mode is Mode.NVEXT else _BOTH


def plan(
    request: Request,
    mode: Mode,
    *,
    dp_rank_header: bytes | None = None,
    hides_reasoning_ids: bool = False,
    splice_root: SpliceRoot | None = None,
    capture: bool = False,
    logprobs: bool = False,
) -> Plan:
    """The Plan for a request that opts in. `dp_rank_header` is the client's first `X-data-parallel-rank`;
    `hides_reasoning_ids`: the server withholds the ids of chat requests with `include_reasoning: false`
    (`_vllm_compat.hides_reasoning_ids`); `splice_root`: the compiled splice that may rewrite the body
    (None: the Python path, as `Settings.pure_python` asks); `capture`: ids on for the capture tap, and with
    `logprobs` (VLLM_NVEXT_CAPTURE_LOGPROBS) the sampled tokens' logprobs too."""
    reading = request.reading
    if reading is None or capture:
        return _plan(request, mode, dp_rank_header, hides_reasoning_ids, splice_root, capture, logprobs)[0]
    # Past the body's own bytes (spliced anew each time), the plan follows from the reading (of the
    # fields and of `nvext`, on one endpoint), the mode and the server: one per reading, mode and server
    # (tests/unit/test_request_fidelity.py::test_a_kept_plan_is_the_plan_made_anew and
    # ::test_a_kept_nvext_plan_is_the_plan_made_anew).
    kept = reading.plans.get((mode, hides_reasoning_ids))
    if kept is None:
        made, rewrite = _plan(request, mode, dp_rank_header, hides_reasoning_ids, splice_root)
        if not any(reading.nvext.get(name) is not None for name in _PLANNED_FROM_MORE):
            # A template holds no body: the client's bytes are never kept.
            entry = (made, None) if made.body is None else (dataclasses.replace(made, body=None), rewrite)
            reading.plans[(mode, hides_reasoning_ids)] = (*entry, rewrite.splice_args())
        return made
    template, kept_rewrite, (names, added) = kept
    if kept_rewrite is None:
        return template  # vLLM gets the client's bytes: the same plan
    body = splice_root(request.body, names, added) if splice_root is not None else None
    if body is None:
        body = kept_rewrite.apply(request.body)
    made = _new(Plan)  # the template with this body
    members = vars(made)
    members.update(vars(template))
    members["body"] = body
    return made


# nvext members whose plan follows from more than the reading: the body's messages or
# `thinking_token_budget`, what this vLLM takes, the client's X-data-parallel-rank header.
_PLANNED_FROM_MORE = ("token_data", "max_thinking_tokens", "dp_rank")


def _asked(request: Request, mode: Mode) -> tuple[bool, bool, bool, frozenset[str]]:
    """What the request asks to be answered, in `mode`: (ids in vLLM's placement, the nvext trio, nvext prompt ids
    alone, the other nvext selectors answered)."""
    fields = request.fields
    return_token_ids = fields.return_token_ids is True
    requested = set(request.nvext.get("extra_fields") or [])
    # docs/protocol.md §3.4: `return_token_ids: true` is an alias of the completion_token_ids selector.
    normalized = (requested | {COMPLETION_TOKEN_IDS}) if return_token_ids else requested
    where = placements(mode, return_token_ids, bool(requested & ID_SELECTORS), bool(normalized & ID_SELECTORS))
    vllm_ids, nvext_placement = Placement.VLLM in where, Placement.NVEXT in where
    nvext_trio = nvext_placement and COMPLETION_TOKEN_IDS in normalized
    nvext_prompt_ids = nvext_placement and not nvext_trio and PROMPT_TOKEN_IDS in normalized
    selectors = frozenset(normalized & NVEXT_ONLY_SELECTORS)
    if PROMPT_LOGPROBS in selectors and fields.prompt_logprobs is None:
        selectors = selectors - {PROMPT_LOGPROBS}  # only answered when vLLM's prompt_logprobs is set
    return vllm_ids, nvext_trio, nvext_prompt_ids, selectors


def _plan(
    request: Request,
    mode: Mode,
    dp_rank_header: bytes | None,
    hides_reasoning_ids: bool,
    splice_root: SpliceRoot | None,
    capture: bool = False,
    logprobs: bool = False,
) -> tuple[Plan, BodyRewrite]:
    """The plan made anew, with the rewrite that made its body."""
    endpoint, data, fields = request.endpoint, request.data, request.fields
    return_token_ids = fields.return_token_ids is True
    vllm_ids, nvext_trio, nvext_prompt_ids, selectors = _asked(request, mode)
    prompts, n = choices(request, nvext_trio, selectors | ({PROMPT_TOKEN_IDS} if nvext_prompt_ids else set()))

    # timing's ttft_ms is the first chunk carrying a token id: ask for ids to see them.
    needs_ids = vllm_ids or nvext_trio or nvext_prompt_ids or bool(selectors & _TIMED) or capture
    turned_on = capture_logprobs(request, fields) if capture and logprobs else None  # for the capture tap alone
    rewrite, headers = _rewrite(request, needs_ids and not return_token_ids, dp_rank_header, turned_on)
    echo = endpoint is Endpoint.COMPLETIONS and fields.echo is True
    made = Plan(
        endpoint=endpoint,
        vllm_placement=vllm_ids,
        nvext_trio=nvext_trio,
        nvext_prompt_ids=nvext_prompt_ids,
        nvext_only_selectors=selectors,
        strip_vllm_ids=needs_ids and not vllm_ids,
        # vLLM sends prompt ids by itself only on completions streams with echo.
        vllm_sends_prompt_ids=echo and fields.stream is True,
        # vLLM leaves the echoed prompt out of `text` whenever `return_token_ids` is on.
        echo_prompts=echo_prompts(request) if echo and needs_ids and not return_token_ids else (),
        logprobs_requested=logprobs_requested(fields, endpoint),
        body=rewrite.apply(request.body, splice_root),
        headers=headers,
        dialect=(Dialect.BOTH if "nvext" in data else Dialect.VLLM) if return_token_ids else Dialect.NVEXT,
        stream=fields.stream is True,
        single_choice=n * prompts == 1,
        n=n,
        finish_waits_for_usage=fields.stream is True and n * prompts == 1 and bool(selectors & _TIMED),
        kv_stays_at_root=fields.kv_transfer_params is not None,
        error_params=tuple(rewrite.sources.items()),
        ids_withheld=hides_reasoning_ids and endpoint is Endpoint.CHAT and fields.include_reasoning is False,
        capture=capture,
        strip_logprobs=turned_on is not None,
    )
    return made, rewrite


def _rewrite(
    request: Request, turn_ids_on: bool, dp_rank_header: bytes | None, logprobs: str | None = None
) -> tuple[BodyRewrite, tuple[tuple[bytes, bytes], ...]]:
    """What vLLM receives in place of the client's body and headers: no `nvext`, `return_token_ids`
    turned on when the plan needs ids the client did not ask vLLM for, `logprobs` set to `logprobs` (the
    capture's, encoded) where given, the nvext fields mapped."""
    rewrite = BodyRewrite()
    if "nvext" in request.data:
        rewrite.drop("nvext")
    if turn_ids_on:
        rewrite.set("return_token_ids", "true")
    if logprobs is not None:
        rewrite.set("logprobs", logprobs)
    return rewrite, apply_nvext_fields(rewrite, request, dp_rank_header)

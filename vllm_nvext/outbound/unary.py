"""Pure unary side, bytes in and bytes out: one vLLM JSON body reshaped as a Plan says.

The bulk of a large body is logprobs, which most plans never read, and decoding them costs
about ten times their size in Python objects. So the values the plan does not read are cut
out of the bytes first (each replaced by a marker string), the small rest is decoded and
reshaped by `chunks.reshape_unary`, and the original bytes are put back where the markers
landed. Same bytes as decoding the whole body:
tests/unit/test_unary.py::test_cut_path_equals_decoding_the_whole_body.

A single-choice body under a plan that asks for the token-id trio and nothing else (`serves`)
is not decoded at all when its JSON is plain (`plain_body`, with the plain-chunk scanner
`plain_chunk` that the ASGI layer hands in): the general path then only sets vLLM's
copies of the ids back to null and appends `"nvext":{"completion_token_ids":...,"prompt_token_ids":...}`,
re-encoding every other value as vLLM wrote it. Any other single-choice body under such a plan is
decoded and reshaped in fewer steps (`reshape_single`). Same bytes: tests/unit/test_unary_plain.py.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from .. import _json
from ..inbound.plan import Plan
from ..protocol import ENGINE_DATA, PROMPT_LOGPROBS, Endpoint
from .chunks import reshape_unary
from .finish import Scanner
from .nvext_values import Clock

# A key vLLM writes right after the value that is cut, for each value that may be cut.
# A `,"key":` byte run is always a real key: inside a JSON string every quote is escaped.
_LOGPROBS = (b',"logprobs":', b',"finish_reason":')  # in each choice
_PROMPT_LOGPROBS = (b',"prompt_logprobs":', b',"prompt_token_ids":')  # root (chat) or choice
# Keys the reshaping reads or writes: a cut that would hide one of them is not made.
# tests/unit/test_unary.py::test_every_key_the_reshaping_reads_is_one_a_cut_never_hides keeps it complete.
READ_KEYS = (
    b'"token_ids":', b'"finish_reason":', b'"stop_reason":', b'"kv_transfer_params":', b'"routed_experts":',
    b'"choices":', b'"usage":', b'"metrics":', b'"nvext":', b'"prompt_logprobs":', b'"prompt_token_ids":',
    b'"index":', b'"text":',
)  # fmt: skip
# A marker is a JSON string no body can hold by chance: a NUL and a fresh random tag per body.
_MARKER = b'"\\u0000vllm-nvext-%s:'
# Below this size decoding everything is cheap enough; cutting would only add passes.
MIN_CUT_BYTES = 64 * 1024


def _cuttable(plan: Plan) -> list[tuple[bytes, bytes]]:
    keys = []
    if not (ENGINE_DATA in plan.nvext_only_selectors and plan.logprobs_requested):
        keys.append(_LOGPROBS)
    if PROMPT_LOGPROBS not in plan.nvext_only_selectors and ENGINE_DATA not in plan.nvext_only_selectors:
        keys.append(_PROMPT_LOGPROBS)
    return keys


def _cut_spans(body: bytes, plan: Plan) -> list[tuple[int, int]]:
    spans: list[tuple[int, int]] = []
    for key, next_key in _cuttable(plan):
        pos = body.find(key)
        while pos >= 0:
            start = pos + len(key)
            end = body.find(next_key, start)
            if end < 0:
                break
            value = body[start:end]
            if value != b"null" and not any(k in value for k in READ_KEYS):
                spans.append((start, end))
            pos = body.find(key, end)
    spans.sort()
    return spans


# The scanner reads an event: a body is scanned as `data: <body>\n\n`, and cut from that event.
_EVENT, _EVENT_END = b"data: ", b"\n\n"
_FRAME, _BODY_END = len(_EVENT), -len(b"}\n\n")
# A plain body holds no escaped quote, so this byte run is always a key (a string followed by a colon).
_KV = b'"kv_transfer_params":'
_KV_VALUE = len(_KV)
_LIST = ord("[")


def serves(plan: Plan) -> bool:
    """The plan changes a single-choice body only as `plain_body` does: the trio, nothing else asked."""
    return plan.nvext_trio and not plan.nvext_only_selectors and not plan.echo_prompts and not plan.strip_logprobs


def plain_body(body: bytes, plan: Plan, scan: Scanner) -> bytes | None:
    """The general path's bytes for a plain single-choice body under a plan `serves` accepts; None: decode it.

    Plain (the scanner's word): every value one orjson writes as vLLM did, no key twice, so the bytes
    the general path keeps are the body's own. Refused: another number of choices than one (n > 1), a
    root `nvext` (the general path replaces it where it stands), a `kv_transfer_params` that is not null
    (the general path may move it into nvext).
    """
    event = _EVENT + body + _EVENT_END
    spans = scan(event)
    if spans is None:
        return None
    choices, root_prompt, root_prompt_end, nvext, _, _, _, ids, ids_end, prompt, prompt_end, _, _ = spans
    if choices != 1 or nvext >= 0:
        return None
    at = body.find(_KV)
    while at >= 0:
        if not body.startswith(b"null", at + _KV_VALUE):
            return None
        at = body.find(_KV, at + _KV_VALUE)
    completions = plan.endpoint is Endpoint.COMPLETIONS
    if not completions:
        prompt, prompt_end = root_prompt, root_prompt_end  # chat: the prompt's ids are the root's
    ids_value = event[ids:ids_end] if ids >= 0 else b"null"
    # not a list (or no key): "not reported" (moves.reported_ids)
    tail = b',"nvext":{"completion_token_ids":' + (ids_value if ids_value[0] == _LIST else b"null")
    prompt_value = event[prompt:prompt_end] if prompt >= 0 else b"null"
    held = prompt_value != b"null"
    tail += b',"prompt_token_ids":' + prompt_value + b"}}" if held else b"}}"
    strip_ids = plan.strip_vllm_ids and ids >= 0  # null stays null
    strip_prompt = plan.strip_vllm_ids and held and not (completions and plan.vllm_sends_prompt_ids)
    if strip_ids and strip_prompt:
        a, a_end, b, b_end = (ids, ids_end, prompt, prompt_end) if ids < prompt else (prompt, prompt_end, ids, ids_end)
        return b"".join((event[_FRAME:a], b"null", event[a_end:b], b"null", event[b_end:_BODY_END], tail))
    if strip_ids or strip_prompt:
        a, a_end = (ids, ids_end) if strip_ids else (prompt, prompt_end)
        return b"".join((event[_FRAME:a], b"null", event[a_end:_BODY_END], tail))
    return event[_FRAME:_BODY_END] + tail


def reshape_single(obj: Any, plan: Plan) -> bool | None:
    """`chunks.reshape_unary(obj, ...)` for a decoded body with one choice under a plan `serves` accepts, in
    fewer steps; None (nothing done) for any other body. Same bytes: tests/unit/test_unary_plain.py, whose
    oracle runs `chunks.reshape_unary` itself."""
    choices = obj.get("choices") if type(obj) is dict else None
    if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
        return None
    choice = choices[0]
    completions = plan.endpoint is Endpoint.COMPLETIONS
    owner = choice if completions else obj  # of the prompt's ids
    prompt = owner.get("prompt_token_ids")
    ids = choice.get("token_ids")
    nv: dict[str, Any] = {"completion_token_ids": ids if isinstance(ids, list) else None}
    kv = obj.get("kv_transfer_params")
    if kv is not None:  # moves.take_kv
        nv["kv_transfer_params"] = kv
        if not plan.vllm_placement and not plan.kv_stays_at_root:
            obj["kv_transfer_params"] = None
    if prompt is not None:
        nv["prompt_token_ids"] = prompt
    if plan.strip_vllm_ids:  # moves.strip_vllm_ids
        if ids is not None:
            choice["token_ids"] = None
        if prompt is not None and not (completions and plan.vllm_sends_prompt_ids):
            owner["prompt_token_ids"] = None
    obj["nvext"] = nv
    return True


def reshape_unary_body(body: bytes, plan: Plan, clock: Clock, scan: Scanner | None = None) -> bytes | None:
    """The client's bytes for one unary body, or None to forward it as vLLM sent it.

    `scan`: the plain-chunk scanner (`plain_chunk`, either twin; the ASGI layer hands in the compiled one,
    `kernels.Kernels.scans_plain`) that lets a plain body skip its decode (`plain_body`); None: decode it.
    Raises ValueError when the body is not JSON.
    """
    if scan is not None and serves(plan):
        new = plain_body(body, plan, scan)
        if new is not None:
            return new
    spans = _cut_spans(body, plan) if len(body) >= MIN_CUT_BYTES else []
    if not spans:
        obj = _json.loads(body)
        reshaped = reshape_single(obj, plan) if serves(plan) else None
        if reshaped is None:
            reshaped = reshape_unary(obj, plan, clock)
        return _json.dumps(obj) if reshaped else None
    tag = secrets.token_hex(8).encode()
    marker = _MARKER % tag
    parts: list[bytes] = []
    last = 0
    for i, (start, end) in enumerate(spans):
        parts += (body[last:start], marker, str(i).encode(), b'"')
        last = end
    parts.append(body[last:])
    skeleton = b"".join(parts)
    del parts
    obj = _json.loads(skeleton)
    del skeleton
    if not reshape_unary(obj, plan, clock):
        return None
    out = _json.dumps(obj)
    del obj
    # The cut values go back as views of the body: the new body is the only copy made of them.
    view = memoryview(body)
    pieces: list[bytes | memoryview] = []
    last = 0
    for m in re.finditer(re.escape(marker) + rb'([0-9]+)"', out):
        start, end = spans[int(m.group(1))]
        pieces += (out[last : m.start()], view[start:end])
        last = m.end()
    pieces.append(out[last:])
    return b"".join(pieces)

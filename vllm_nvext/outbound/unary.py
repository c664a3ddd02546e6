"""Pure unary side, bytes in and bytes out: one vLLM JSON body reshaped as a Plan says.

The bulk of a large body is logprobs, which most plans never read, and decoding them costs
about ten times their size in Python objects. So the values the plan does not read are cut
out of the bytes first (each replaced by a marker string), the small rest is decoded and
reshaped by `response.reshape_unary`, and the original bytes are put back where the markers
landed. Same bytes as decoding the whole body:
tests/unit/test_unary.py::test_cut_path_equals_decoding_the_whole_body.
"""

from __future__ import annotations

import re
import secrets

from .. import _json
from ..plan import Plan
from ..protocol import ENGINE_DATA, PROMPT_LOGPROBS
from .chunks import reshape_unary
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
    if not (ENGINE_DATA in plan.selectors and plan.logprobs):
        keys.append(_LOGPROBS)
    if PROMPT_LOGPROBS not in plan.selectors and ENGINE_DATA not in plan.selectors:
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


def reshape_unary_body(body: bytes, plan: Plan, clock: Clock) -> bytes | None:
    """The client's bytes for one unary body, or None to forward it as vLLM sent it.

    Raises ValueError when the body is not JSON.
    """
    spans = _cut_spans(body, plan) if len(body) >= MIN_CUT_BYTES else []
    if not spans:
        obj = _json.loads(body)
        return _json.dumps(obj) if reshape_unary(obj, plan, clock) else None
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

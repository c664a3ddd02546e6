"""The byte-level finish chunk of a single-choice stream: the general path's bytes without decoding it.

`stream.StreamReshaper` hands it the finish chunk of an armed stream (`splice.Splice`) whose plan
asks for the token-id trio and nothing else on the finish chunk (`serves`): the general path
(`chunks.ChunkReshaper`) then only sets vLLM's copy of the ids back to null (`strip`) and adds
`"nvext":{"completion_token_ids":...,"prompt_token_ids":...}` at the end of the chunk, and
re-encodes every other value as vLLM wrote it. So the chunk is served only when every byte it
keeps is one orjson writes the same way: the delta's learned prefix and a text of the splice's
kind (`splice.kept_text`), then only `null`, plain ASCII strings and small integers under keys
the general path leaves alone, and a list of small non-negative ids. Anything else is decoded.
Same bytes: tests/unit/test_stream_layouts.py, test_stream.py and test_stream_send.py. On the
stream send handed to vLLM serves it itself (`kernels.Kernels.stream_send`, either twin), with the
`finish_ids` of its own kind and `chunks.ChunkReshaper.finish_first_choice` (`splice.FinishArm`).

`first_chunk` serves, with the compiled scanner (`_speedups.plain_chunk`, the `plain_chunk` of the
kernels `stream.StreamReshaper` runs), a decoded chunk's
general-path bytes without the decode: a chunk of choice 0 that does not finish it (the role
chunk with vLLM's prompt ids, the delta that arms the splice, which is learned from these bytes, every
chunk of a stream no splice serves) whose JSON is plain
(every value one orjson writes as vLLM does, no key twice), so vLLM's copies of the ids go back
to null in place and `"nvext":{"completion_token_ids":...}` goes at its end; the chunk's prompt ids
are kept as vLLM wrote them (plain: the bytes their decode encodes back to) for `finish_chunk`.

`reshape_single` is the general path's reshape of a decoded single-choice chunk under such a
plan in fewer steps (the first chunk, and every chunk of a stream no splice serves).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..inbound.plan import Plan
from ..protocol import Endpoint
from .chunks import ChunkReshaper
from .moves import strip_vllm_ids, take_kv
from .splice import kept_text

# A key the general path neither reads nor writes here (choice level or root), with a value
# orjson writes as vLLM does: null, a string of printable ASCII without escapes, a small integer.
_KEPT_KEY = (
    rb',"(?:(?!(?:token_ids|finish_reason|choices|nvext)")[a-z_]+":null'
    rb'|(?!(?:token_ids|finish_reason|choices|nvext|prompt_token_ids|kv_transfer_params|index)")[a-z_]+":'
    rb'(?:"[ !#-\[\]-~]*"|0|-?[1-9][0-9]{0,14}))'
)
_ID = rb"(?:0|[1-9][0-9]{0,14})"
# From the finish reason to the end of the event: group 1 the ids, group 2 what follows them.
_FINISH_TAIL = re.compile(
    rb'"finish_reason":"[a-z_]+"(?:' + _KEPT_KEY + rb')*,"token_ids":(\[(?:' + _ID + rb"(?:," + _ID + rb")*)?\])"
    rb"((?:" + _KEPT_KEY + rb")*\}\](?:" + _KEPT_KEY + rb")*\}\n\n)\Z"
)
_FIRST_CHOICE = b'{"index":0,'
# A key of the finish tail (its values hold no quote, so every `"name":` there is a key).
_TAIL_KEY = re.compile(rb'"([a-z_]+)":')
# Keys the general path moves or nulls on a finish chunk when they hold a value: not before the text either.
_MOVED = (b'"kv_transfer_params":', b'"prompt_token_ids":')
_MAX_KEYS = 64  # a tail with more keys is refused (the compiled twin keeps as many)


def _key_twice(event: bytes, tail: int) -> bool:
    """A key of the tail from `tail` on is written twice in it or also before it (a decode keeps the last
    value at the first key's place; anywhere before counts, a stricter check than per object)."""
    keys = _TAIL_KEY.findall(event, tail)
    if len(set(keys)) != len(keys) or len(keys) > _MAX_KEYS:
        return True
    return any(event.find(b'"' + key + b'":', 0, tail) >= 0 for key in keys)


_LIST = ord("[")
_CHUNK_END = len(b"}\n\n")


def serves(plan: Plan) -> bool:
    """The plan's finish chunk changes only as `finish_chunk` changes it (the trio, nothing else asked)."""
    return (
        plan.nvext_trio
        and plan.single_choice
        and not plan.nvext_only_selectors
        and not plan.echo_prompts
        and not plan.strip_logprobs  # the capture's logprobs: taken out by the general path alone
        and not plan.finish_waits_for_usage
        and not plan.stream_ids_absent  # vllm-rs: its keys are deleted, by the general path alone
        and not plan.stream_prompt_ids_absent
    )


def finishes(prefix: bytes) -> bool:
    """A splice with this prefix may serve finish chunks: it holds no value the finish moves (`_MOVED`)."""
    for key in _MOVED:
        at = prefix.find(key)  # a key's quotes are never a string's
        if at >= 0 and not prefix.startswith(b"null", at + len(key)):
            return False
    return True


def finish_ids(event: bytes, prefix: bytes, finish_head: bytes, root_end: int) -> tuple[int, int] | None:
    """Where the ids of the finish chunk `event` of choice 0 sit, when `finish_chunk` serves it; None: decode it.

    `prefix`: the armed splice's bytes up to a delta's text; `finish_head`: its bytes from the
    text's closing quote to `"finish_reason":`; `root_end`: where `choices`' first element starts.
    `_speedups.finish_ids` is its compiled twin (the compiled send's): tests/unit/test_stream_finish.py.
    """
    text = len(prefix)
    close = event.find(b'"', text)  # the first quote: the text's end unless escaped (then kept_text refuses)
    if (
        close < 0
        or not event.startswith(prefix)
        or not event.startswith(_FIRST_CHOICE, root_end)
        or not event.startswith(finish_head, close)
        or not kept_text(event, text, close)  # refuses a text whose last backslash escapes that quote
    ):
        return None
    m = _FINISH_TAIL.match(event, close + len(finish_head))
    if m is None or _key_twice(event, m.start()):
        return None
    return m.span(1)


def finish_chunk(
    event: bytes, prefix: bytes, finish_head: bytes, root_end: int, strip: bool, chunks: ChunkReshaper
) -> bytes | None:
    """The client's bytes for the finish chunk `event` of choice 0, or None (nothing recorded) to decode it
    (`finish_ids`, under a splice whose prefix `finishes`)."""
    span = finish_ids(event, prefix, finish_head, root_end) if finishes(prefix) else None
    if span is None:
        return None
    start, end = span
    nvext = chunks.finish_first_choice(event, start, end)
    if nvext is None:
        return None
    kept = event[:start] + b"null" + event[end:-_CHUNK_END] if strip else event[:-_CHUNK_END]
    return kept + b',"nvext":' + nvext + b"}\n\n"


def reshape_single(chunks: ChunkReshaper, obj: Any) -> bool | None:
    """`chunks.reshape(obj)` for a decoded chunk with one choice under a plan `serves` accepts, in fewer
    steps (no first-token time: such a plan asks for no `timing`); None (nothing done) for any other chunk.
    Same bytes: the stream tests above, whose general path (`decoding.DecodingStreamReshaper`) runs
    `ChunkReshaper.reshape` itself."""
    choices = obj.get("choices") if type(obj) is dict else None
    if type(choices) is not list or len(choices) != 1 or type(choices[0]) is not dict:
        return None
    choice = choices[0]
    plan = chunks.plan
    if chunks.prompt_ids is None:
        owner = choice if plan.endpoint is Endpoint.COMPLETIONS else obj
        chunks.prompt_ids = owner.get("prompt_token_ids")
    delta = choice.get("token_ids")
    ids = delta if isinstance(delta, list) else None if "token_ids" in choice or plan.ids_withheld else []
    nv: dict[str, Any] = {"completion_token_ids": ids}
    if chunks.record_choice(choice.get("index"), ids is None, choice.get("finish_reason") is not None):
        kv = take_kv(obj, plan)
        if kv is not None:
            nv["kv_transfer_params"] = kv
        if chunks.prompt_ids is not None:
            nv["prompt_token_ids"] = chunks.prompt_ids
    if plan.strip_vllm_ids:
        strip_vllm_ids(obj, choices, plan)
    obj["nvext"] = nv
    return True


# `finish_ids` and its compiled twin `_speedups.finish_ids` (`kernels.Kernels.finish_ids`).
FinishIds = Callable[[bytes, bytes, bytes, int], "tuple[int, int] | None"]

# `_speedups.plain_chunk`: None, or (choices, root prompt ids, root nvext, index, ids, prompt ids, finish
# reason), the first the number of choices (-1: no `choices`), each other the (start, end) of a value (-1, -1).
Scanner = Callable[[bytes], "tuple[int, ...] | None"]


def first_chunk(event: bytes, plan: Plan, chunks: ChunkReshaper, scan: Scanner) -> tuple[bytes, int, int] | None:
    """The client's bytes for a plain chunk of choice 0 that does not finish it, and where its listed ids sit
    (-1, -1: it lists none), for the splice a delta teaches (`stream.StreamReshaper`); None (nothing recorded):
    decode it."""
    spans = scan(event)
    if spans is None:
        return None
    choices, root_prompt, root_end, nvext, _, index, index_end, ids, ids_end, prompt, prompt_end, fin, fin_end = spans
    if choices != 1 or nvext >= 0 or event[index:index_end] != b"0" or event[fin:fin_end] not in (b"", b"null"):
        return None
    completions = plan.endpoint is Endpoint.COMPLETIONS
    if not completions:
        prompt, prompt_end = root_prompt, root_end
    delta = event[ids:ids_end] if ids >= 0 else b"null" if plan.ids_withheld else b"[]"
    prompt_value = event[prompt:prompt_end]
    if (delta[0] != _LIST and delta != b"null") or (prompt_value[:1] not in (b"[", b"") and prompt_value != b"null"):
        return None  # another value where the general path reads ids: decoded
    if prompt_value[:1] == b"[":
        chunks.keep_prompt_json(prompt_value)  # plain: the bytes its decode encodes to (finish_first_choice)
    if delta == b"null":  # (listed ids are recorded only for engine_data or timing, which `serves` excludes)
        chunks.withhold_ids()
    strip_ids = plan.strip_vllm_ids and ids >= 0 and delta != b"null"
    strip_prompt = plan.strip_vllm_ids and prompt >= 0 and prompt_value != b"null"
    if strip_prompt and completions and plan.vllm_sends_prompt_ids:
        strip_prompt = False
    tail = b',"nvext":{"completion_token_ids":' + delta + b"}}\n\n"
    if delta[0] != _LIST:
        ids = ids_end = -1  # no ids listed here (null)
    if strip_ids and strip_prompt:
        a, a_end, b, b_end = (ids, ids_end, prompt, prompt_end) if ids < prompt else (prompt, prompt_end, ids, ids_end)
        return b"".join((event[:a], b"null", event[a_end:b], b"null", event[b_end:-_CHUNK_END], tail)), ids, ids_end
    if strip_ids or strip_prompt:
        a, a_end = (ids, ids_end) if strip_ids else (prompt, prompt_end)
        return b"".join((event[:a], b"null", event[a_end:-_CHUNK_END], tail)), ids, ids_end
    return event[:-_CHUNK_END] + tail, ids, ids_end

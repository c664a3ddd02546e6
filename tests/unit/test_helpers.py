"""The e2e tests' stream comparison, on streams recorded from real vLLM: it ignores chunking, nothing else.

vLLM merges the outputs of several engine steps into one chunk when its API server lags, so
`stream_digest` must be the same however a stream is chunked, and must differ whenever
anything a client reads differs.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.helpers import CHAT, COMPLETIONS, assert_stream_consistent, content_events, stream_digest
from tests.recorded import Recording, recordings

# Finish data is the merged chunk's own, as in vLLM: the last step's.
_LATEST = ("finish_reason", "stop_reason")


def _merge(a: Any, b: Any, key: str = "") -> Any:
    """`b` appended to `a` the way vLLM merges two steps' deltas into one chunk."""
    if key in _LATEST:
        return b
    if a is None or key == "index":
        return b if a is None else a
    if b is None:
        return a
    if isinstance(a, dict):
        return {k: _merge(a.get(k), b.get(k), k) for k in {**a, **b}}
    if isinstance(a, (str, list)):
        return a + b
    return a


def merge_chunks(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    # A chunk's fixed fields; what only the later chunk carries (0.33's kv_transfer_params) is kept.
    merged = {**b, **{k: v for k, v in a.items() if v is not None or k not in b}}
    merged["choices"] = [_merge(a["choices"][0], b["choices"][0])]
    return merged


def coalesced(events: list[dict[str, Any]], start: int, count: int) -> list[dict[str, Any]]:
    """`events` with content chunks start..start+count merged into one (the inputs are not changed)."""
    merged = events[start]
    for event in events[start + 1 : start + count]:
        merged = merge_chunks(merged, event)
    return [*events[:start], merged, *events[start + count :]]


def _single_choice_streams() -> dict[str, Recording]:
    return {
        name: rec
        for name, rec in recordings().items()
        if rec.stream and rec.status == 200 and all(len(e.get("choices") or [0]) == 1 for e in rec.events())
        and {c["index"] for e in rec.events() for c in e["choices"]} == {0}
    }  # fmt: skip


STREAMS = list(_single_choice_streams().values())
STREAM_NAMES = list(_single_choice_streams())


def _path(rec: Recording) -> str:
    return CHAT if rec.path.endswith("chat/completions") else COMPLETIONS


def _usage(events: list[dict[str, Any]]) -> bool:
    return any(not e["choices"] for e in events)


@pytest.mark.parametrize("rec", STREAMS, ids=STREAM_NAMES)
def test_recorded_vllm_streams_are_self_consistent(rec):
    events = rec.events()
    assert_stream_consistent(_path(rec), events, usage=_usage(events))


@pytest.mark.parametrize("rec", STREAMS, ids=STREAM_NAMES)
def test_digest_is_the_same_however_vllm_coalesces_the_chunks(rec):
    events = rec.events()
    content = len(content_events(events))
    expected = stream_digest(events)
    # Neighbours merged at the start (role chunk, first delta), the end (finish chunk) and throughout.
    starts = {*range(min(4, content - 1)), *range(max(0, content - 4), content - 1), *range(0, content - 1, 7)}
    variants = [coalesced(events, i, 2) for i in sorted(starts)]
    variants += [coalesced(events, 1, content - 1), coalesced(events, 0, content)]  # all tokens in one chunk
    for variant in variants:
        assert stream_digest(variant) == expected
        assert_stream_consistent(_path(rec), variant, usage=_usage(events))


def _first_with(events: list[dict[str, Any]], test) -> dict[str, Any]:
    return next(e for e in content_events(events) if test(e))


def _drop_an_id(events):
    _first_with(events, lambda e: e["choices"][0].get("token_ids"))["choices"][0]["token_ids"].pop()


def _alter_text(events):
    choice = _first_with(
        events, lambda e: e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content")
    )
    if "text" in choice["choices"][0]:
        choice["choices"][0]["text"] += "x"
    else:
        choice["choices"][0]["delta"]["content"] += "x"


def _add_a_key(events):
    content_events(events)[-1]["nvext"] = {"completion_token_ids": []}


def _repeat_prompt_ids(events):
    first, last = content_events(events)[0], content_events(events)[-1]
    if "prompt_token_ids" in first:
        last["prompt_token_ids"] = first["prompt_token_ids"]
    else:
        last["choices"][0]["prompt_token_ids"] = first["choices"][0]["prompt_token_ids"]


def _change_finish(events):
    content_events(events)[-1]["choices"][0]["finish_reason"] = "abort"


def _change_model(events):
    content_events(events)[0]["model"] = "other"


def _change_usage(events):
    events[-1]["usage"]["completion_tokens"] += 1


MUTATIONS = [_drop_an_id, _alter_text, _add_a_key, _repeat_prompt_ids, _change_finish, _change_model, _change_usage]


def _applies(rec, mutate) -> bool:
    """A mutation a recording can show: usage changes need a usage chunk, id changes need ids."""
    events = rec.events()
    if mutate is _change_usage:
        return bool(_usage(events))
    if mutate in (_drop_an_id, _repeat_prompt_ids):
        return any(c.get("token_ids") for e in events for c in e["choices"])
    return True


MUTATION_CASES = [
    pytest.param(rec, mutate, id=f"{name}-{mutate.__name__.strip('_')}")
    for rec, name in zip(STREAMS, STREAM_NAMES, strict=True)
    for mutate in MUTATIONS
    if _applies(rec, mutate)
]


@pytest.mark.parametrize(("rec", "mutate"), MUTATION_CASES)
def test_digest_sees_every_change_a_client_would_see(rec, mutate):
    events = rec.events()
    changed = copy.deepcopy(events)
    mutate(changed)
    assert stream_digest(changed) != stream_digest(events)

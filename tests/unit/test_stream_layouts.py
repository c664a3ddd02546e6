"""The byte-level stream path gives the general path's bytes on every vLLM layout.

The general path decodes each event, reshapes the chunk and encodes it again; the byte-level
path keeps vLLM's bytes for mid-stream deltas. Both must give the client the same bytes for the
recorded streams of vLLM 0.32 and 0.33 (tests/recorded.py) as they came, and for the layouts
hypothesis derives from them: null-valued keys added before or after the choice's `token_ids`
or at the root, after `choices` (what 0.33 did) or before it, and whatever else a layout might
do (non-null values, keys the middleware reads or writes, empty/null/huge ids, tricky text, two
choices in one chunk), which must fall back to the general path.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recorded import VLLM_VERSIONS, Recording, recordings
from vllm_nvext import Mode
from vllm_nvext.inbound.plan import for_upstream
from vllm_nvext.inbound.request import Plan, plan_request
from vllm_nvext.outbound.decoding import DecodingStreamReshaper
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.outbound.stream import StreamReshaper
from vllm_nvext.protocol import RequestError

# n=2 and echo streams refuse every nvext selector; wall-clock `timing` differs between runs.
STREAMS = sorted(
    n for n, r in recordings().items() if r.stream and r.status == 200 and "n2" not in n and "echo" not in n
)
SELECTORS = ["completion_token_ids", "prompt_token_ids", "engine_data", "stop_reason", "detailed_finish_reason"]
MODES = [Mode.NVEXT, Mode.BOTH, Mode.AUTO, Mode.VLLM]
# Keys a layout may add: new ones, and ones the middleware reads or writes.
KEYS = ["weight_versions", "kv_transfer_params", "routed_experts", "x_y", "nvext", "token_ids", "finish_reason",
        "prompt_token_ids", "stop_reason", "logprobs"]  # fmt: skip
VALUES: st.SearchStrategy[Any] = st.sampled_from([None, None, None, None, 0, "", "null", {}, [], {"a": None}, True])


def _plan(rec: Recording, mode: Mode, selectors: list[str]):
    request = {**rec.request, "nvext": {"extra_fields": selectors}}
    try:
        return plan_request(json.dumps(request).encode(), rec.endpoint, mode)
    except RequestError:
        return None


def _events(body: bytes) -> list[bytes]:
    return [block + b"\n\n" for block in body.split(b"\n\n") if block]


def _both_paths(plan, events: list[bytes]) -> tuple[bytes, bytes, StreamReshaper]:
    fast, general = StreamReshaper(plan, Clock()), DecodingStreamReshaper(plan, Clock())
    got = b"".join(fast.feed(e) for e in events) + fast.flush()
    want = b"".join(general.feed(e) for e in events) + general.flush()
    return got, want, fast


def _first_difference(got: bytes, want: bytes) -> str:
    for a, b in zip(_events(got), _events(want), strict=False):
        if a != b:
            return f"\n byte-level: {a!r}\n general:    {b!r}"
    return f"\n lengths {len(got)} != {len(want)}"


# Every recorded stream with each plan the middleware accepts for it (a refused one has no stream).
RECORDED_CASES = [
    pytest.param(name, mode, selectors, id=f"{name}-{mode.value}-{'+'.join(selectors)}")
    for name in STREAMS
    for mode in MODES
    for selectors in (["completion_token_ids"], ["completion_token_ids", "engine_data"])
    if _plan(recordings()[name], mode, selectors) is not None
]


@pytest.mark.parametrize(("name", "mode", "selectors"), RECORDED_CASES)
def test_recorded_stream_gives_the_general_paths_bytes(name, mode, selectors):
    rec = recordings()[name]
    plan = _plan(rec, mode, selectors)
    got, want, _ = _both_paths(plan, _events(rec.body))
    assert got == want, f"{name}: the client would get other bytes than the general path gives" + _first_difference(
        got, want
    )


# The layouts whose mid-stream deltas the byte-level tiers read (`delta.tail_match`, `ids_between`). vllm-rs (0.33-rust,
# 0.34-rust) leaves out a delta's `"finish_reason":null`, which they anchor on: its splice is armed from a delta read
# as a first chunk is (`finish.first_chunk`), its root from the scanned first chunk (`delta.scanned_root`).
RUST = tuple(v for v in VLLM_VERSIONS if v.endswith("-rust"))
SPLICED = tuple(v for v in VLLM_VERSIONS if v not in RUST)


@pytest.mark.parametrize("vllm", SPLICED)
@pytest.mark.parametrize("name", ["chat_stream_ids_long", "completions_stream_ids_long"])
def test_byte_level_path_serves_every_mid_stream_delta_of_both_layouts(name, vllm, json_decodes):
    rec = recordings()[name if vllm == "0.32" else f"vllm-{vllm}/{name}"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    decodes_before = len(json_decodes)
    reshaper = StreamReshaper(plan, Clock())
    out = b"".join(reshaper.feed(e) for e in _events(rec.body))
    decoded = json_decodes[decodes_before:]
    deltas = [e for e in rec.events() if e["choices"] and e["choices"][0]["finish_reason"] is None]
    assert len(decoded) <= 3, (
        f"vLLM {vllm}: {len(decoded)} events decoded, only the first, the delta that arms the splice and the finish"
        " chunk may be"
    )
    assert reshaper.splice is not None, f"vLLM {vllm}: no splice armed"
    assert len(deltas) > 2 and out.count(b'"nvext":{"completion_token_ids":') >= len(deltas)


@pytest.mark.parametrize("vllm", RUST)
@pytest.mark.parametrize("name", ["chat_stream_ids_long", "completions_stream_ids_long"])
def test_vllm_rs_deltas_arm_the_splice_with_every_id_in_nvext(name, vllm, json_decodes):
    """vllm-rs's recorded stream (no `"finish_reason":null` on a delta): the splice is armed from its first delta,
    every delta carries its ids in `nvext` as the general path writes them, and only the first, arming and finish
    chunks are decoded."""
    rec = recordings()[f"vllm-{vllm}/{name}"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = _events(rec.body)
    decodes_before = len(json_decodes)
    reshaper = StreamReshaper(plan, Clock())
    got = b"".join(reshaper.feed(e) for e in events) + reshaper.flush()
    decoded = len(json_decodes) - decodes_before
    general = DecodingStreamReshaper(plan, Clock())
    want = b"".join(general.feed(e) for e in events) + general.flush()
    deltas = [e for e in rec.events() if e["choices"] and e["choices"][0].get("finish_reason") is None]
    assert got == want, _first_difference(got, want)
    assert reshaper.splice is not None, "no splice armed"
    assert decoded <= 3, f"{decoded} events decoded: only the first, the delta that arms and the finish chunk may be"
    assert len(deltas) > 2 and got.count(b'"nvext":{"completion_token_ids":') >= len(deltas)


@pytest.mark.parametrize("root", [b'"x":{"choices":[{"index":0}]},', b'"x":[{"choices":[{"index":1,"a":null}]}],'])
@pytest.mark.parametrize("name", ["chat_stream_ids_long", "completions_stream_ids_long"])
def test_a_vllm_rs_root_value_holding_choices_of_its_own_is_read_as_the_general_path_reads_it(name, root, kernels):
    # The root of a chunk without a finish reason is where the scanner finds choice 0 (delta.scanned_root), never a
    # `"choices":[{"index":` inside a root value before it: the client gets the general path's bytes on every delta.
    rec = recordings()[f"vllm-0.34-rust/{name}"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = [e.replace(b'"choices":[', root + b'"choices":[', 1) if e.startswith(b"data: {") else e
              for e in _events(rec.body)]  # fmt: skip
    reshaper = StreamReshaper(plan, Clock(), kernels)
    got = b"".join(reshaper.feed(e) for e in events) + reshaper.flush()
    general = DecodingStreamReshaper(plan, Clock())
    want = b"".join(general.feed(e) for e in events) + general.flush()
    assert got == want, f"{kernels.impl}: " + _first_difference(got, want)
    assert reshaper.root.endswith(b'"model":"tiny",' + root + b'"choices":['), reshaper.root


@pytest.mark.parametrize("vllm", RUST)
@pytest.mark.parametrize("name", ["chat_stream_ids_long", "completions_stream_ids_long"])
def test_vllm_rs_deltas_whose_ids_are_deleted_take_the_general_path(name, vllm):
    """Behind `vllm-nvext proxy`, a stream whose ids the client gets without vLLM's copies has vllm-rs's keys deleted
    (`plan.for_upstream`), by the general path alone: no splice, every id in `nvext`."""
    rec = recordings()[f"vllm-{vllm}/{name}"]
    plan = for_upstream(_plan(rec, Mode.NVEXT, ["completion_token_ids"]), vllm.replace("-rust", ".0"))
    got, want, reshaper = _both_paths(plan, _events(rec.body))
    deltas = [e for e in rec.events() if e["choices"] and e["choices"][0].get("finish_reason") is None]
    assert plan.stream_ids_absent and got == want, _first_difference(got, want)
    assert reshaper.splice is None
    assert len(deltas) > 2 and got.count(b'"nvext":{"completion_token_ids":') >= len(deltas)
    assert b'"token_ids"' not in got.replace(b'"completion_token_ids"', b""), "vLLM's copies reached the client"


@pytest.mark.parametrize("vllm", VLLM_VERSIONS)
@pytest.mark.parametrize("value", [[1, 2], [], 0, None])
def test_a_root_key_before_choices_on_a_delta_is_treated_as_the_general_path_treats_it(vllm, value):
    # docs/protocol.md §3.4: vLLM's prompt ids go back to null in nvext placement, wherever they sit.
    rec = recordings()["chat_stream_ids_long" if vllm == "0.32" else f"vllm-{vllm}/chat_stream_ids_long"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = []
    for raw in _events(rec.body):
        if raw.startswith(b"data: {") and b'"finish_reason":null' in raw and b'"token_ids":[' in raw:
            raw = raw.replace(b'"choices":[', b'"prompt_token_ids":' + orjson.dumps(value) + b',"choices":[', 1)
        events.append(raw)
    got, want, _ = _both_paths(plan, events)
    assert got == want, "a delta with prompt ids before `choices` differs from the general path" + _first_difference(
        got, want
    )
    if value is not None and value != 0:
        assert b'"prompt_token_ids":' + orjson.dumps(value) not in got, "vLLM's prompt ids reached the client"


USAGE_TAILS = [
    b'"usage":{"prompt_tokens":3,"total_tokens":5,"completion_tokens":2}}',
    b'"usage":null,"choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}',
    b'"error":{"message":"`temperature` bad","type":"BadRequestError","param":"temperature","code":400}}',
    b'"usage":{"prompt_tokens":3}',  # not JSON
]


@pytest.mark.parametrize("vllm", VLLM_VERSIONS)
@pytest.mark.parametrize("nvext", [{}, {"greed_sampling": True}])
@pytest.mark.parametrize("tail", USAGE_TAILS)
def test_a_chunk_with_empty_choices_is_sent_as_the_general_path_sends_it(vllm, nvext, tail):
    # the usage chunk goes out as vLLM wrote it; a later `choices`, or an error the plan renames, does not
    rec = recordings()["chat_stream_ids" if vllm == "0.32" else f"vllm-{vllm}/chat_stream_ids"]
    request = {**rec.request, "nvext": {"extra_fields": ["completion_token_ids"], **nvext}}
    plan = plan_request(json.dumps(request).encode(), rec.endpoint, Mode.NVEXT)
    assert plan is not None and bool(plan.error_params) == bool(nvext)
    events = _events(rec.body)
    root = events[1][: events[1].index(b'"choices":[') + len(b'"choices":[')]
    usage = root + b"]," + tail + b"\n\n"
    events.insert(len(events) - 1, usage)
    got, want, _ = _both_paths(plan, events)
    assert got == want, _first_difference(got, want)
    if tail in (USAGE_TAILS[0], USAGE_TAILS[3]) or (tail == USAGE_TAILS[2] and not nvext):
        assert usage in got, "the usage chunk reached the client changed"


# --- layouts derived from the recordings ----------------------------------------------------


@st.composite
def layouts(draw: st.DrawFn) -> dict[str, Any]:
    """What a vLLM version writes around every delta: keys added before/after the ids, at the root."""

    nulls_only = draw(st.booleans())  # half the layouts are ones the byte-level path must serve

    def keys() -> list[tuple[str, Any]]:
        names = draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True))
        return [(name, None if nulls_only else draw(VALUES)) for name in names]

    return {"before_ids": keys(), "after_ids": keys(), "root_before": keys(), "root": keys()}


IDS: st.SearchStrategy[list[int] | None] = st.one_of(
    st.lists(st.integers(0, 300_000), min_size=1, max_size=6),
    st.just([]),
    st.none(),
    st.lists(st.integers(2**63, 2**70), min_size=1, max_size=2),  # beyond orjson's 64 bits
)
TEXT = st.text(alphabet=st.sampled_from(['"', "\\", ",", ":", "}", "]", "{", "\n", "a", "é", "\u2028", "\x00"]))


def _insert(obj: dict[str, Any], after: str | None, items: list[tuple[str, Any]]) -> dict[str, Any]:
    """obj with items inserted after key `after` (at the end when None); existing keys are moved."""
    items = [(k, v) for k, v in items if k != after]
    base = [(k, v) for k, v in obj.items() if k not in dict(items)]
    if after is None or after not in obj:
        return dict(base + items)
    cut = [k for k, _ in base].index(after) + 1
    return dict(base[:cut] + items + base[cut:])


def _relayout(event: dict[str, Any], layout: dict[str, Any], draw: st.DrawFn) -> dict[str, Any]:
    choices = event.get("choices")
    if not choices:
        return event
    choice = dict(choices[0])
    if draw(st.integers(0, 9)) == 0:
        choice["token_ids"] = draw(IDS)
    if draw(st.integers(0, 9)) == 0 and isinstance(choice.get("delta"), dict):
        choice["delta"] = {**choice["delta"], "content": draw(TEXT)}
    if draw(st.integers(0, 9)) == 0 and "text" in choice:
        choice["text"] = draw(TEXT)
    choice = _insert(choice, "finish_reason", layout["before_ids"])
    choice = _insert(choice, "token_ids", layout["after_ids"])
    new_choices = [choice]
    if draw(st.integers(0, 19)) == 0:
        new_choices.append({**choice, "index": choice.get("index", 0) + 1})  # two choices in one chunk
    # root_before: after `model`, the last root key vLLM writes before `choices`
    relaid = _insert({**event, "choices": new_choices}, "model", layout["root_before"])
    return _insert(relaid, None, layout["root"])


def draw_relaid_stream(data: Any) -> tuple[str, Plan, list[bytes]] | None:
    """From hypothesis' `st.data()`: a recorded stream (its first 40 events: long streams add nothing
    new beyond), a mode and selectors drawn, its events laid out another way; None when the plan
    refuses the selectors."""
    name = data.draw(st.sampled_from(STREAMS), label="recording")
    rec = recordings()[name]
    mode = data.draw(st.sampled_from(MODES), label="mode")
    selectors = data.draw(st.lists(st.sampled_from(SELECTORS), min_size=1, max_size=3, unique=True), label="selectors")
    plan = _plan(rec, mode, selectors)
    if plan is None:
        return None
    layout = data.draw(layouts(), label="layout")
    events = []
    for raw in _events(rec.body)[:40]:
        if not raw.startswith(b"data: {"):
            events.append(raw)
            continue
        event = _relayout(orjson.loads(raw[6:]), layout, data.draw)
        try:
            payload = orjson.dumps(event)
        except TypeError:  # ids beyond 64 bits: encoded as the general path would (exactly)
            payload = json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()
        events.append(b"data: " + payload + b"\n\n")
    return f"{name} {mode.value} {selectors} {layout}", plan, events


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_byte_level_path_gives_the_general_paths_bytes(data):
    case = draw_relaid_stream(data)
    if case is None:
        return
    label, plan, events = case
    got, want, _ = _both_paths(plan, events)
    assert got == want, label + _first_difference(got, want)

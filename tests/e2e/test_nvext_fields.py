"""End to end: every nvext selector and request field a Dynamo client uses, on real vLLM."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import (
    BASE,
    CHAT,
    COMPLETIONS,
    assert_stream_consistent,
    final_event,
    greedy,
    logprob_values,
    nvext,
    nvext_stream_ids,
    post,
    strip_volatile,
)

pytestmark = pytest.mark.e2e


def raw_ids(raw_client, path: str, body: dict) -> tuple[list[int], list[int], dict]:
    """(prompt ids, completion ids, whole answer) of stock vLLM's unary answer with ids."""
    got = post(raw_client, path, {**body, "return_token_ids": True})
    choice = got["choices"][0]
    prompt = got["prompt_token_ids"] if path == CHAT else choice["prompt_token_ids"]
    return prompt, choice["token_ids"], got


LOGPROBS = {CHAT: {"logprobs": True}, COMPLETIONS: {"logprobs": 1}}


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_engine_data_unary_has_ids_and_aligned_logprobs(translated, raw, path):
    body = greedy(path, **LOGPROBS[path])
    prompt, ids, raw_body = raw_ids(raw, path, body)
    got = post(translated, path, {**body, **nvext("engine_data")})
    engine = got["nvext"]["engine_data"]
    assert engine["completion_token_ids"] == ids and engine["prompt_token_ids"] == prompt
    assert engine["finished"] is True
    assert engine["completion_logprobs"] == logprob_values(path, raw_body["choices"][0])
    assert len(engine["completion_logprobs"]) == len(engine["completion_token_ids"])
    # logprobs were the client's own: they stay where vLLM put them; the ids were ours: nulled
    assert got["choices"][0]["logprobs"] == raw_body["choices"][0]["logprobs"]
    assert got["choices"][0]["token_ids"] is None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_engine_data_stream_equals_concatenated_deltas(translated, raw, path):
    body = greedy(path, stream=True, **LOGPROBS[path])
    _, ids, _ = raw_ids(raw, path, greedy(path, **LOGPROBS[path]))
    events = post(translated, path, {**body, **nvext("completion_token_ids", "engine_data")})
    assert_stream_consistent(path, events, usage=False)
    streamed = nvext_stream_ids(events)
    engine = final_event(events)["nvext"]["engine_data"]
    assert engine["completion_token_ids"] == streamed == ids
    assert len(engine["completion_logprobs"]) == len(ids)
    assert sum("engine_data" in e.get("nvext", {}) for e in events) == 1, "engine_data on the final chunk only"


def test_engine_data_without_logprobs_has_none(translated):
    got = post(translated, CHAT, {**greedy(CHAT), **nvext("engine_data")})
    assert "completion_logprobs" not in got["nvext"]["engine_data"]
    assert got["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_prompt_token_ids_selector_alone(translated, raw, stream):
    prompt, _, _ = raw_ids(raw, CHAT, greedy(CHAT))
    got = post(translated, CHAT, {**greedy(CHAT, stream=stream), **nvext("prompt_token_ids")})
    events = got if stream else [got]
    carrying = [e for e in events if "nvext" in e]
    assert len(carrying) == 1 and carrying[0]["nvext"] == {"prompt_token_ids": prompt}
    assert carrying[0]["choices"][0]["finish_reason"] is not None


def test_timing_is_measured_by_the_middleware(translated):
    before = int(time.time() * 1000)
    events = post(translated, CHAT, {**greedy(CHAT, stream=True), **nvext("timing")})
    timing = final_event(events)["nvext"]["timing"]
    assert before - 1000 <= timing["request_received_ms"] <= int(time.time() * 1000)
    assert isinstance(timing["request_received_ms"], int)
    assert 0 < timing["ttft_ms"] <= timing["total_time_ms"]
    unary = post(translated, CHAT, {**greedy(CHAT), **nvext("timing")})
    assert unary["nvext"]["timing"]["total_time_ms"] > 0 and "ttft_ms" not in unary["nvext"]["timing"]


@pytest.mark.parametrize(
    ("extra", "finish", "stop_reason", "detailed"),
    [
        ({}, "length", None, "length"),
        ({"logit_bias": {"258": 100}}, "stop", None, "stop"),  # <|im_end|>, the EOS: "stop", as Dynamo
        ({"stop_token_ids": [], "logit_bias": {"65": 100}, "stop": ["b"]}, "stop", "b", "stop"),
    ],
    ids=["length", "eos", "stop-string"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_stop_reason_and_detailed_finish_reason(translated, extra, finish, stop_reason, detailed, stream):
    body = {**greedy(COMPLETIONS, stream=stream, **extra), **nvext("stop_reason", "detailed_finish_reason")}
    got = post(translated, COMPLETIONS, body)
    event = final_event(got) if stream else got
    assert event["choices"][0]["finish_reason"] == finish
    assert event["nvext"].get("detailed_finish_reason") == detailed
    assert event["nvext"].get("stop_reason") == stop_reason


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_prompt_logprobs_move_under_nvext(translated, raw, path):
    body = greedy(path, prompt_logprobs=1)
    expected = post(raw, path, body)
    got = post(translated, path, {**body, **nvext("prompt_logprobs")})
    owner_raw = expected if path == CHAT else expected["choices"][0]
    owner_got = got if path == CHAT else got["choices"][0]
    assert owner_raw["prompt_logprobs"] and owner_raw["prompt_logprobs"][0] is None
    assert got["nvext"]["prompt_logprobs"] == owner_raw["prompt_logprobs"]
    assert owner_got["prompt_logprobs"] is None


# --- request fields -----------------------------------------------------------------------


def test_token_data_on_completions_is_the_prompt(translated):
    ids = [84, 111, 107, 101, 110, 115]
    got = post(
        translated,
        COMPLETIONS,
        {**greedy(COMPLETIONS, prompt="placeholder"), **nvext("completion_token_ids", token_data=ids)},
    )
    assert got["nvext"]["prompt_token_ids"] == ids


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_token_data_on_chat_matches_the_same_prompt_sent_as_text(translated, raw, stream):
    prompt, ids, raw_body = raw_ids(raw, CHAT, greedy(CHAT, logprobs=True))
    placeholder = {"messages": [{"role": "user", "content": "(token_data)"}]}
    body = {**greedy(CHAT, stream=stream, logprobs=True), **placeholder}
    got = post(translated, CHAT, {**body, **nvext("completion_token_ids", "engine_data", token_data=prompt)})
    if stream:
        assert all(e["object"] == "chat.completion.chunk" for e in got)
        final = final_event(got)["nvext"]
        streamed = nvext_stream_ids(got)
        assert streamed == ids and final["prompt_token_ids"] == prompt
        assert final["engine_data"]["completion_token_ids"] == ids
        assert len(final["engine_data"]["completion_logprobs"]) == len(ids)
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in got if e["choices"])
        assert text == raw_body["choices"][0]["message"]["content"]
    else:
        assert got["object"] == "chat.completion"
        assert got["nvext"]["prompt_token_ids"] == prompt and got["nvext"]["completion_token_ids"] == ids
        assert got["choices"][0]["message"]["content"] == raw_body["choices"][0]["message"]["content"]
        assert got["choices"][0]["logprobs"] == raw_body["choices"][0]["logprobs"]


def test_token_in_chat_equals_token_in_completions(translated):
    ids = [257, 84, 82, 68, 81, 198, 39, 68, 75, 75, 78, 258, 198, 257, 64]
    chat = post(translated, CHAT, {**greedy(CHAT), **nvext("completion_token_ids", token_data=ids)})
    comp = post(translated, COMPLETIONS, {**greedy(COMPLETIONS), **nvext("completion_token_ids", token_data=ids)})
    assert chat["nvext"]["prompt_token_ids"] == comp["nvext"]["prompt_token_ids"] == ids
    assert chat["nvext"]["completion_token_ids"] == comp["nvext"]["completion_token_ids"]


def test_greed_sampling_gives_the_greedy_ids(translated, raw):
    _, greedy_ids, _ = raw_ids(raw, COMPLETIONS, greedy(COMPLETIONS, max_tokens=12))
    body = {**BASE[COMPLETIONS], "max_tokens": 12, "temperature": 1.5, "seed": 3}
    got = post(translated, COMPLETIONS, {**body, **nvext("completion_token_ids", greed_sampling=True)})
    assert got["nvext"]["completion_token_ids"] == greedy_ids
    sampled = post(translated, COMPLETIONS, {**body, **nvext("completion_token_ids")})
    assert sampled["nvext"]["completion_token_ids"] != greedy_ids, "without greed_sampling the sampler is used"


def test_routing_and_tuning_fields_are_accepted_without_changing_the_answer(translated, raw):
    fields = {
        "cache_salt": "tenant-a",
        "annotations": ["request_id:1"],
        "backend_instance_id": 7,
        "prefill_worker_id": 1,
        "decode_worker_id": 2,
        "prefill_dp_rank": 0,
        "agent_hints": {"priority": 1, "osl": 16, "latency_sensitivity": 0.5},
        "request_timestamp_ms": 1700000000000,
        "routing_constraints": {"required_taints": []},
        "router": {"ttft_target": 100},
        "metadata_upload": {"url": "http://127.0.0.1:9/unused"},
        "use_raw_prompt": False,
    }
    _, ids, _ = raw_ids(raw, CHAT, greedy(CHAT))
    got = post(translated, CHAT, {**greedy(CHAT), **nvext("completion_token_ids", **fields)})
    assert got["nvext"]["completion_token_ids"] == ids


def test_max_thinking_tokens_becomes_vllms_thinking_token_budget(translated):
    resp = translated.post(CHAT, json={**greedy(CHAT), **nvext("completion_token_ids", max_thinking_tokens=32)})
    # The tiny model has no reasoning parser, so vLLM itself refuses the budget it was handed.
    assert resp.status_code == 400 and "thinking_token_budget" in resp.json()["error"]["message"]


def test_dp_rank_becomes_vllms_data_parallel_rank_header(translated):
    ok = post(translated, CHAT, {**greedy(CHAT), **nvext("completion_token_ids", dp_rank=0)})
    assert ok["nvext"]["completion_token_ids"]
    bad = translated.post(CHAT, json={**greedy(CHAT), **nvext("completion_token_ids", dp_rank=5)})
    assert bad.status_code == 400, "vLLM validates the rank it was handed: the mapping is real"


@pytest.mark.parametrize(
    ("nv", "param"),
    [
        ({"not_a_field": 1}, "nvext.not_a_field"),
        ({"greed_sampling": 1}, "nvext.greed_sampling"),
        ({"token_data": ["a"]}, "nvext.token_data"),
        ({"max_thinking_tokens": -1}, "nvext.max_thinking_tokens"),
        ({"agent_hints": {"priority": "urgent"}}, "nvext.agent_hints.priority"),
        ({"annotations": "x"}, "nvext.annotations"),
    ],
)
def test_unknown_or_mistyped_nvext_keys_are_400s(translated, nv, param):
    resp = translated.post(CHAT, json={**greedy(CHAT), "nvext": nv})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and param.rsplit(".", 1)[-1] in error["message"]
    assert strip_volatile(post(translated, CHAT, greedy(CHAT)))["choices"], "the next good request is answered"


def test_unknown_extra_fields_strings_are_ignored(translated, raw):
    got = post(translated, CHAT, {**greedy(CHAT), **nvext("worker_id", "nonsense")})
    assert "nvext" not in got
    assert json.dumps(strip_volatile(got)) == json.dumps(strip_volatile(post(raw, CHAT, greedy(CHAT))))

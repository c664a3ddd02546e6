"""The nvext objects vllm-nvext writes have Dynamo 1.6.1's shape (live: tests/e2e/test_dynamo_conformance.py)."""

from __future__ import annotations

import json

import pytest

from vllm_nvext.config import Mode
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.outbound.chunks import ChunkReshaper, reshape_unary
from vllm_nvext.outbound.nvext_values import Clock, detailed_finish_reason, kv_cache_hit, timing
from vllm_nvext.protocol import Endpoint
from vllm_nvext.tools.dynamo_conformance import SIX


def _plan(endpoint: Endpoint, selectors: list[str], **extra):
    body = {"model": "tiny", "max_tokens": 3, "nvext": {"extra_fields": selectors}, **extra}
    body.update({"messages": [{"role": "user", "content": "x"}]} if endpoint is Endpoint.CHAT else {"prompt": "x"})
    plan = plan_request(json.dumps(body).encode(), endpoint, Mode.NVEXT)
    assert plan is not None
    return plan


def _completion(choices: list[dict], **root) -> dict:
    return {"id": "cmpl-1", "object": "text_completion", "choices": choices, **root}


def _choice(index: int, ids: list[int], finish: str | None = "length", stop_reason=None, **extra) -> dict:
    return {"index": index, "text": "abc", "finish_reason": finish, "stop_reason": stop_reason,
            "prompt_token_ids": [1, 2], "token_ids": ids, **extra}  # fmt: skip


def test_unary_keys_follow_dynamo_order_with_cached_tokens_and_vllm_metrics():
    plan = _plan(Endpoint.COMPLETIONS, list(SIX), logprobs=1)
    usage = {"prompt_tokens": 2, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 0}}
    metrics = {"queue_time_ms": 0.25, "time_to_first_token_ms": 12.5, "generation_time_ms": 3.0}
    choice = _choice(0, [7, 8, 9], "stop", stop_reason="b", logprobs={"token_logprobs": [-0.5, -1.0, -1.5]})
    obj = _completion([choice], usage=usage, metrics=metrics)
    assert reshape_unary(obj, plan, Clock())
    nv = obj["nvext"]
    assert list(nv) == ["completion_token_ids", "timing", "engine_data", "stop_reason", "detailed_finish_reason",
                        "prompt_token_ids"]  # fmt: skip
    assert list(nv["timing"]) == ["request_received_ms", "prefill_wait_time_ms", "prefill_time_ms", "ttft_ms",
                                  "total_time_ms"]  # fmt: skip
    assert nv["timing"]["ttft_ms"] == 12.75 and nv["timing"]["prefill_time_ms"] == 12.5
    assert nv["engine_data"] == {
        "prompt_token_ids": [1, 2],
        "kv_cache_hit": {"prompt_tokens": 2, "reused_tokens": 0},
        "completion_token_ids": [7, 8, 9],
        "finished": True,
        "completion_logprobs": [-0.5, -1.0, -1.5],
    }
    assert list(nv["engine_data"]) == ["prompt_token_ids", "kv_cache_hit", "completion_token_ids", "finished",
                                       "completion_logprobs"]  # fmt: skip
    assert nv["stop_reason"] == "b" and nv["detailed_finish_reason"] == "stop"


def test_nothing_is_invented_when_vllm_reports_no_metrics_or_cached_tokens():
    plan = _plan(Endpoint.COMPLETIONS, ["engine_data", "timing"])
    obj = _completion([_choice(0, [7])], usage={"prompt_tokens": 2, "completion_tokens": 1})
    reshape_unary(obj, plan, Clock())
    assert "kv_cache_hit" not in obj["nvext"]["engine_data"]
    assert list(obj["nvext"]["timing"]) == ["request_received_ms", "total_time_ms"]
    assert kv_cache_hit(None, {"prompt_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}) == {
        "prompt_tokens": 4,
        "reused_tokens": 2,
    }
    assert kv_cache_hit(None, {"prompt_tokens_details": {"cached_tokens": 2}}) is None
    assert list(timing(Clock(), 5.0)) == ["request_received_ms", "ttft_ms", "total_time_ms"]


def test_unary_with_several_choices_describes_the_last_one_without_kv_cache_hit():
    plan = _plan(Endpoint.COMPLETIONS, ["engine_data", "stop_reason"], n=2)
    usage = {"prompt_tokens": 2, "prompt_tokens_details": {"cached_tokens": 0}}
    obj = _completion([_choice(0, [5, 6], "stop", stop_reason=6), _choice(1, [7, 8])], usage=usage)
    reshape_unary(obj, plan, Clock())
    assert obj["nvext"] == {
        "engine_data": {"prompt_token_ids": [1, 2], "completion_token_ids": [7, 8], "finished": True}
    }
    assert [c["token_ids"] for c in obj["choices"]] == [None, None]


@pytest.mark.parametrize(
    ("finish", "expected"),
    [("stop", "stop"), ("length", "length"), ("abort", "cancelled"), (None, None)],
)
def test_detailed_finish_reason_is_what_dynamo_reports_in_front_of_vllm(finish, expected):
    # An EOS and a stop string or token alike read `stop`: vLLM's worker reports them so.
    assert detailed_finish_reason(finish) == expected


def _stream(plan, chunks: list[dict]) -> list[dict]:
    reshaper = ChunkReshaper(plan, Clock())
    for chunk in chunks:
        reshaper.reshape(chunk)
    return chunks


def test_each_choice_of_a_stream_gets_its_own_finish_nvext():
    plan = _plan(Endpoint.COMPLETIONS, ["engine_data", "timing", "detailed_finish_reason"], n=2, stream=True)
    chunks = [
        _completion([_choice(0, [1], None)]),
        _completion([_choice(1, [4], None)]),
        _completion([_choice(0, [2], None)]),
        _completion([_choice(1, [5], "stop", stop_reason=5)]),
        _completion([_choice(0, [3], "length")]),
        _completion([], usage={"prompt_tokens": 2}),
    ]
    out = _stream(plan, chunks)
    assert [("nvext" in c) for c in out] == [False, False, False, True, True, False]
    first, second = out[3]["nvext"], out[4]["nvext"]
    assert list(first) == ["timing", "engine_data", "detailed_finish_reason"]
    assert first["engine_data"]["completion_token_ids"] == [4, 5]
    assert second["engine_data"]["completion_token_ids"] == [1, 2, 3]
    assert first["detailed_finish_reason"] == "stop" and second["detailed_finish_reason"] == "length"
    assert list(first["timing"]) == ["request_received_ms", "ttft_ms", "total_time_ms"]


def test_trio_stream_finish_chunk_order_and_error_events_pass_without_nvext():
    plan = _plan(Endpoint.COMPLETIONS, ["completion_token_ids", "engine_data"], stream=True)
    chunks = [
        _completion([_choice(0, [1, 2], None)]),
        _completion([_choice(0, [3], "length")], kv_transfer_params={"k": 1}),
        {"error": {"message": "boom", "type": "InternalServerError", "code": 500}},
    ]
    out = _stream(plan, chunks)
    assert out[0]["nvext"] == {"completion_token_ids": [1, 2]}
    assert list(out[1]["nvext"]) == ["engine_data", "completion_token_ids", "kv_transfer_params", "prompt_token_ids"]
    assert out[1]["nvext"]["engine_data"]["kv_transfer_params"] == {"k": 1}
    assert out[1]["kv_transfer_params"] is None
    assert "nvext" not in out[2]

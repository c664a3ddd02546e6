"""Unary reshaping, bytes in and bytes out: the cut path gives the bytes of decoding everything."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from tests.recorded import recordings
from vllm_nvext import _json
from vllm_nvext.config import Mode
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.outbound import unary
from vllm_nvext.outbound.chunks import reshape_unary
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.protocol import RequestError

UNARY = sorted(n for n, r in recordings().items() if not r.stream and r.status == 200)
SELECTOR_SETS = [
    [],
    ["completion_token_ids"],
    ["prompt_token_ids"],
    ["engine_data"],
    ["prompt_logprobs"],
    ["engine_data", "prompt_logprobs", "completion_token_ids"],
    ["timing", "stop_reason", "detailed_finish_reason", "routed_experts"],
]


class _FrozenClock(Clock):
    """The same wall-clock readings for both paths, so timing compares too."""

    def __init__(self) -> None:
        super().__init__()
        self.received_ms = 1_700_000_000_000

    def elapsed_ms(self) -> float:
        return 12.5


def _plans(rec):
    base = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    for mode in (Mode.NVEXT, Mode.BOTH, Mode.VLLM, Mode.AUTO):
        for selectors in SELECTOR_SETS:
            for vllm_ids in (False, True):
                request = {**base, "nvext": {"extra_fields": selectors}}
                if vllm_ids:
                    request["return_token_ids"] = True
                try:
                    plan = plan_request(json.dumps(request).encode(), rec.endpoint, mode)
                except RequestError:
                    continue  # e.g. a selector that needs one choice on an n=2 recording
                if plan is not None:
                    yield plan


def _general(body: bytes, plan) -> bytes | None:
    obj = _json.loads(body)
    return _json.dumps(obj) if reshape_unary(obj, plan, _FrozenClock()) else None


def _big(body: bytes, factor: int) -> bytes:
    """A recorded body grown like a long generation: its logprob entries repeated."""
    obj = json.loads(body)
    for choice in obj["choices"]:
        lp = choice.get("logprobs")
        if isinstance(lp, dict) and isinstance(lp.get("content"), list):
            lp["content"] = lp["content"] * factor
        elif isinstance(lp, dict):
            for key, value in lp.items():
                if isinstance(value, list):
                    lp[key] = value * factor
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@pytest.mark.parametrize("name", UNARY)
def test_cut_path_equals_decoding_the_whole_body(name, monkeypatch):
    monkeypatch.setattr(unary, "MIN_CUT_BYTES", 0)  # recorded bodies are small: cut them anyway
    rec = recordings()[name]
    checked = 0
    for plan in _plans(rec):
        assert unary.reshape_unary_body(rec.body, plan, _FrozenClock()) == _general(rec.body, plan)
        checked += 1
    assert checked


@pytest.mark.parametrize("name", [n for n in UNARY if "logprobs" in n and "prompt_logprobs" not in n])
def test_large_logprobs_body_is_reshaped_in_a_few_times_its_size(name):
    rec = recordings()[name]
    body = _big(rec.body, 4000)
    assert len(body) > 1_000_000
    request = {**rec.request, "nvext": {"extra_fields": ["completion_token_ids", "timing"]}}
    request.pop("return_token_ids", None)
    plan = plan_request(json.dumps(request).encode(), rec.endpoint, Mode.NVEXT)
    assert plan is not None
    expected = _general(body, plan)
    tracemalloc.start()
    got = unary.reshape_unary_body(body, plan, _FrozenClock())
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == expected
    # Decoding the whole body holds ~10x its size in objects; the cut path holds its output
    # and a small skeleton (allocation counts, not time: deterministic).
    assert peak < 3 * len(body), f"peak {peak / len(body):.1f}x the body"


def test_text_that_looks_like_a_marker_is_kept(monkeypatch):
    monkeypatch.setattr(unary, "MIN_CUT_BYTES", 0)
    rec = recordings()["chat_unary_ids_logprobs"]
    obj = json.loads(rec.body)
    obj["choices"][0]["message"]["content"] = "\u0000vllm-nvext-0000000000000000:0"
    body = json.dumps(obj, separators=(",", ":")).encode()
    for plan in _plans(rec):
        assert unary.reshape_unary_body(body, plan, _FrozenClock()) == _general(body, plan)


def test_not_json_raises_value_error():
    rec = recordings()["chat_unary_ids"]
    plan = next(iter(_plans(rec)))
    with pytest.raises(ValueError):
        unary.reshape_unary_body(b"not json", plan, _FrozenClock())


# Keys outbound/chunks.py touches that are not vLLM's body keys: inside the nvext object it writes, or
# inside a read value (usage, error) that a cut never splits.
_NOT_BODY_KEYS = {
    "completion_token_ids", "engine_data", "timing", "ttft_ms", "total_time_ms", "prefill_wait_time_ms",
    "prefill_time_ms", "kv_cache_hit", "finished", "detailed_finish_reason", "completion_logprobs",
    "prompt_tokens_details", "prompt_tokens", "cached_tokens", "error", "param", "message",
}  # fmt: skip


def test_every_key_the_reshaping_reads_is_one_a_cut_never_hides():
    import ast
    from pathlib import Path

    from vllm_nvext.outbound import chunks as response

    keys = set()
    for node in ast.walk(ast.parse(Path(response.__file__).read_text())):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", None) == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            keys.add(node.args[0].value)
    body_keys = {k for k in keys if isinstance(k, str)} - _NOT_BODY_KEYS
    guarded = {k.decode().strip('":') for k in unary.READ_KEYS}
    assert body_keys <= guarded, f"outbound/chunks.py reads keys a cut could hide: {sorted(body_keys - guarded)}"

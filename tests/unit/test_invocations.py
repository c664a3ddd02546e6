"""/invocations is read as the route vLLM serves the body on: its chat model first, then its completions
model (docs/protocol.md §10), with vLLM's own models when vLLM is there and a pinned rule without it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from vllm_nvext import Mode
from vllm_nvext.inbound import fields as _fields
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.protocol import Endpoint, RequestError

TRIO = {"extra_fields": ["completion_token_ids"]}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "a"}]}
# (body, the route vLLM 0.32 serves it on: its own models decide, in its order)
BODIES: list[tuple[dict[str, Any], Endpoint | None]] = [
    (CHAT, Endpoint.CHAT),
    ({"model": "tiny", "prompt": "a"}, Endpoint.COMPLETIONS),
    # `messages` that vLLM's chat model refuses: served as completions (the case)
    ({"model": "tiny", "messages": "junk", "prompt": ["Hello", "World wide"]}, Endpoint.COMPLETIONS),
    ({"model": "tiny", "messages": [{"content": "no role"}], "prompt": "a"}, Endpoint.COMPLETIONS),
    # a valid chat body that also carries completions' fields: chat, as vLLM serves it
    ({**CHAT, "prompt": "Hello", "logprobs": True}, Endpoint.CHAT),
    # chat's `logprobs` is a boolean: 2 fails the chat model, completions takes it
    ({**CHAT, "prompt": "Hello", "logprobs": 2}, Endpoint.COMPLETIONS),
    # neither model takes it: vLLM's own 400
    ({"model": "tiny", "messages": "junk", "prompt": {"not": "a prompt"}}, None),
]


@pytest.mark.parametrize(("body", "route"), BODIES)
def test_the_route_is_the_one_vllms_models_pick(body, route):
    assert _fields.invocation_route(body) is route
    plan = plan_request(json.dumps({**body, "nvext": {"extra_fields": ["timing"]}}).encode(),
                        Endpoint.INVOCATIONS, Mode.AUTO)  # fmt: skip
    if route is None:
        assert plan is None, "passed through: vLLM answers with its own 400"
    else:
        assert plan is not None and plan.endpoint is route


def test_a_completions_batch_behind_junk_messages_gets_the_batch_refusal():
    body = {"model": "tiny", "messages": "junk", "prompt": ["Hello", "World wide"], "nvext": TRIO}
    with pytest.raises(RequestError) as refused:
        plan_request(json.dumps(body).encode(), Endpoint.INVOCATIONS, Mode.AUTO)
    assert refused.value.param == "prompt", "the same 400 /v1/completions gives a batch with the trio"
    ok = plan_request(json.dumps({**body, "nvext": {"extra_fields": ["timing"]}}).encode(),
                      Endpoint.INVOCATIONS, Mode.AUTO)  # fmt: skip
    assert ok is None or ok.endpoint is Endpoint.COMPLETIONS


def test_a_chat_body_with_prompt_and_logprobs_is_served_as_chat():
    body = {**CHAT, "prompt": "Hello", "logprobs": True, "nvext": TRIO}
    plan = plan_request(json.dumps(body).encode(), Endpoint.INVOCATIONS, Mode.AUTO)
    assert plan is not None and plan.endpoint is Endpoint.CHAT and plan.nvext_trio and plan.logprobs_requested


@pytest.mark.parametrize(("body", "route"), BODIES)
def test_without_vllm_the_pinned_rule_picks_the_same_route(monkeypatch, body, route):
    monkeypatch.setattr(_fields, "_vllm_model_for_invocations", lambda endpoint: None)
    assert _fields.invocation_route(body) is route


def test_vllms_models_are_imported_at_start_up_never_on_a_request(monkeypatch, tmp_path):
    """Outside a vLLM server, a request only looks vLLM's models up (nothing loaded: the pinned rule);
    `load_request_models`, which the proxy runs at start-up before serving, imports them."""
    import sys

    (tmp_path / "nvext_start_up_models.py").write_text(
        "from pydantic import BaseModel\n\nclass ChatCompletionRequest(BaseModel):\n    messages: list\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_fields, "_VLLM_MODELS", {Endpoint.CHAT: (("nvext_start_up_models", "ChatCompletionRequest"),)})
    monkeypatch.setattr(_fields, "_readers", {})
    assert _fields._vllm_model_for_invocations(Endpoint.CHAT) is None, "no vLLM loaded: the pinned rule"
    assert "nvext_start_up_models" not in sys.modules, "a request imports nothing"
    _fields.load_request_models()
    model = _fields._vllm_model_for_invocations(Endpoint.CHAT)
    assert model is sys.modules["nvext_start_up_models"].ChatCompletionRequest
    del sys.modules["nvext_start_up_models"]


def test_a_validator_that_raises_something_else_leaves_the_body_to_vllm(monkeypatch):
    class Raising:
        model_fields: dict[str, Any] = {}

        @staticmethod
        def model_validate(data: Any) -> None:
            raise TypeError("not a validation error")

    monkeypatch.setattr(_fields, "_vllm_model_for_invocations", lambda endpoint: Raising)
    assert _fields.invocation_route(CHAT) is None

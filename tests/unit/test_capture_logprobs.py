"""VLLM_NVEXT_CAPTURE_LOGPROBS (docs/capture.md, Logprobs): a captured request that asked for no logprobs asks vLLM
for the sampled tokens', the client gets its answer without them (as vLLM writes it when not asked), and the turn
records one per id. Over answers recorded from vLLM 0.32 (tests/fixtures: the `*_logprobs` recordings, and on
/v1/responses the same request recorded with and without `include: ["message.output_text.logprobs"]`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import COMPLETIONS, sse_events, without_agent_volatile
from tests.recorded import recording
from tests.unit.asgi import Upstream, call
from tests.unit.test_capture_tap import JSON, _app, _turns, _without_ids
from tests.unit.test_responses_api import _events, _rec
from vllm_nvext.capture.choice import token_logprobs
from vllm_nvext.capture.requests import plan_for_capture
from vllm_nvext.config import ENV_CAPTURE_LOGPROBS, ConfigError, Mode, Settings
from vllm_nvext.protocol import Endpoint

CASES = ["chat_unary_ids_logprobs", "chat_stream_ids_logprobs", "completions_unary_ids_logprobs",
         "completions_stream_ids_logprobs"]  # fmt: skip
ASKED = ("return_token_ids", "logprobs", "top_logprobs")
SESSION = (JSON, (b"x-nvext-session-id", b"lp"))


def _without_logprobs(obj: dict[str, Any]) -> dict[str, Any]:
    """A chunk or body as vLLM writes it without logprobs: each choice's `logprobs` null."""
    return {**obj, "choices": [{**c, "logprobs": None} for c in obj.get("choices") or []]}


async def _captured(name: str, tmp_path: Path, request: dict[str, Any], **settings: Any) -> tuple[Any, Any, Upstream]:
    rec = recording(name)
    upstream = Upstream(content_type=rec.content_type, body=rec.body, cuts=(7, 200))
    app = _app(upstream, tmp_path, **settings)
    result = await call(app, rec.path, json.dumps(request).encode(), headers=SESSION)
    assert result.status == 200
    return app, result, upstream


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
@pytest.mark.parametrize("name", CASES)
async def test_a_client_that_asks_for_none_gets_stock_answers_and_the_turn_one_logprob_per_id(name, pure, tmp_path):
    rec = recording(name)
    request = {k: v for k, v in rec.request.items() if k not in ASKED}  # the client asks for nothing
    app, result, upstream = await _captured(name, tmp_path, request, capture_logprobs=True, pure_python=pure)
    sent_up = json.loads(upstream.received or b"")
    assert sent_up["logprobs"] == (0 if rec.path == COMPLETIONS else True)
    assert "top_logprobs" not in sent_up, "vLLM's default: the sampled token's logprob alone"
    if rec.stream:
        sent = rec.events()
        assert sse_events(result.body) == [_without_logprobs(_without_ids(e)) for e in sent]
        logprobs = [v for e in sent for c in e["choices"] if c["index"] == 0 for v in token_logprobs(c) or []]
    else:
        sent = rec.json()
        assert json.loads(result.body) == _without_logprobs(_without_ids(sent)), "stock's `logprobs: null`"
        assert result.header(b"content-length") == str(len(result.body)).encode()
        logprobs = token_logprobs(sent["choices"][0]) or []
    (turn,) = _turns(app)
    record = turn.to_json()
    assert record["logprobs"] == logprobs and len(logprobs) == len(record["completion_token_ids"]) > 0


@pytest.mark.parametrize("name", CASES)
async def test_a_client_that_asked_for_logprobs_gets_them_as_vllm_sent_them(name, tmp_path):
    rec = recording(name)
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}  # its own logprobs, top ones too
    app, result, upstream = await _captured(name, tmp_path, request, capture_logprobs=True)
    sent_up = json.loads(upstream.received or b"")
    assert (sent_up.get("logprobs"), sent_up.get("top_logprobs")) == (request["logprobs"], request.get("top_logprobs"))
    expected = [_without_ids(e) for e in rec.events()] if rec.stream else _without_ids(rec.json())
    assert (sse_events(result.body) if rec.stream else json.loads(result.body)) == expected, "its logprobs kept"
    (turn,) = _turns(app)
    assert len(turn.to_json()["logprobs"]) == len(turn.to_json()["completion_token_ids"])


def _logprobs_sent(body: dict[str, Any], endpoint: Endpoint, on: bool = True) -> Any:
    """What `logprobs` vLLM gets for a captured request that opts into nothing."""
    _, plan = plan_for_capture(json.dumps(body).encode(), endpoint, Mode.AUTO, False, on)
    assert plan is not None
    return json.loads(plan.body or b"{}").get("logprobs", "absent"), plan.strip_logprobs


@pytest.mark.parametrize(
    ("body", "endpoint", "why"),
    [
        ({"messages": [], "top_logprobs": 5}, Endpoint.CHAT, "top_logprobs sizes what the engine computes"),
        ({"messages": [], "top_logprobs": -7}, Endpoint.CHAT, "an invalid top_logprobs fails only with logprobs on"),
        ({"messages": [], "logprob_token_ids": [1]}, Endpoint.CHAT, "refused by vLLM without logprobs"),
        ({"prompt": "a", "use_beam_search": True}, Endpoint.COMPLETIONS, "beam search answers logprobs otherwise"),
        ({"prompt": "a", "echo": True}, Endpoint.COMPLETIONS, "echo's logprobs cover the prompt"),
        ({"prompt": "a", "logprobs": -1}, Endpoint.COMPLETIONS, "the client's own logprobs"),
    ],
)
def test_a_request_vllm_would_read_otherwise_gets_no_logprobs_turned_on(body, endpoint, why):
    assert _logprobs_sent(body, endpoint) == (body.get("logprobs", "absent"), False), why


def test_logprobs_are_turned_on_only_with_the_setting():
    assert _logprobs_sent({"messages": []}, Endpoint.CHAT) == (True, True)
    assert _logprobs_sent({"messages": [], "logprobs": False}, Endpoint.CHAT) == (True, True), "false: asked none"
    assert _logprobs_sent({"prompt": "a"}, Endpoint.COMPLETIONS) == (0, True)
    assert _logprobs_sent({"messages": []}, Endpoint.CHAT, on=False) == ("absent", False)


def test_the_setting_needs_capture_and_is_refused_without_it():
    with pytest.raises(ConfigError, match=ENV_CAPTURE_LOGPROBS):
        Settings.from_env({ENV_CAPTURE_LOGPROBS: "1"})
    with pytest.raises(ConfigError, match=ENV_CAPTURE_LOGPROBS):
        Settings.from_env({ENV_CAPTURE_LOGPROBS: "maybe", "VLLM_NVEXT_CAPTURE": "sqlite:////tmp/x.sqlite3"})


# --- /v1/responses ----------------------------------------------------------------------------------------
# The same request recorded with `include: ["message.output_text.logprobs"]` (what the capture sends) and without
# (what the client gets from stock vLLM), both with enable_response_messages (the capture's ids).

# Two recordings' per-request values (their item ids too: recorded apart).
_VOLATILE = frozenset({"id", "item_id", "created_at", "completed_at"})


def _stable(obj: Any) -> Any:
    return without_agent_volatile(obj, _VOLATILE)


def _stock(final: dict[str, Any]) -> dict[str, Any]:
    return {**final, "input_messages": None, "output_messages": None}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_responses_client_gets_stock_events_and_a_whole_turn_has_one_logprob_per_id(stream, tmp_path):
    kind = "stream" if stream else "unary"
    request, body, content_type = _rec(f"responses_{kind}_logprobs")
    _, without, _ = _rec(f"responses_{kind}_logprobs_messages")
    client = {k: v for k, v in request.items() if k not in ("include", "enable_response_messages")}
    upstream = Upstream(content_type=content_type, body=body, cuts=(5, 300))
    app = _app(upstream, tmp_path, capture_logprobs=True)
    result = await call(app, "/v1/responses", json.dumps(client).encode(), headers=SESSION)
    sent_up = json.loads(upstream.received or b"")
    assert sent_up["include"] == ["message.output_text.logprobs"] and sent_up["enable_response_messages"] is True
    if stream:
        stock = _events(without)
        got = _events(result.body)
        assert _stable(got[:-1]) == _stable(stock[:-1]), "every event as stock vLLM writes it without logprobs"
        assert _stable(got[-1]["response"]) == _stable(_stock(stock[-1]["response"]))
    else:
        assert _stable(json.loads(result.body)) == _stable(_stock(json.loads(without)))
    assert b'"logprob":' not in result.body
    (turn,) = _turns(app)
    record = turn.to_json()
    final = _events(body)[-1]["response"] if stream else json.loads(body)
    texts = [lp["logprob"] for item in final["output"] for part in item["content"] for lp in part["logprobs"]]
    if len(texts) == len(record["completion_token_ids"]):
        assert record["logprobs"] == texts, "one per id"
    else:  # vLLM 0.32's stream leaves out the logprobs of tokens that made no text yet: not one per id
        assert stream and record["logprobs"] is None, "null, never a list that does not align"

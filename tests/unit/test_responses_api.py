"""Token ids on /v1/responses and /v1/messages (docs/protocol.md §11), on bytes recorded from vLLM 0.32.

tests/fixtures/agent-apis/ holds vLLM 0.32's answers (scripts/record_fixtures.py --set agent):
each Responses request with and without `enable_response_messages`, and the same conversation on
chat with `return_token_ids`, whose ids the Responses ids must equal.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import without_agent_volatile
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings
from vllm_nvext import _json as nvjson
from vllm_nvext.agent.messages import plan_messages
from vllm_nvext.agent.responses import (
    ResponsesPlan,
    ResponsesStream,
    plan_responses,
    reshape_response,
    reshape_unary,
    response_ids,
)
from vllm_nvext.agent.route import ResponsesSend

AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "agent-apis"
RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
NVEXT_IDS = {"extra_fields": ["completion_token_ids"]}


@cache
def _index() -> dict[str, Any]:
    return json.loads((AGENT / "index.json").read_text())["cases"]


def _rec(name: str) -> tuple[dict[str, Any], bytes, str]:
    case = _index()[name]
    return case["request"], (AGENT / case["file"]).read_bytes(), case["content_type"]


def _chat_ids() -> tuple[list[int], list[int]]:
    chat = json.loads(_rec("chat_unary_ids_same_conversation")[1])
    return chat["choices"][0]["token_ids"], chat["prompt_token_ids"]


def _app(name: str, **settings: Any) -> tuple[NvextMiddleware, Upstream]:
    _, body, content_type = _rec(name)
    upstream = Upstream(content_type=content_type, body=body, cuts=(5, 300, 1000))
    return NvextMiddleware(upstream, settings=Settings(**settings)), upstream


def _request(name: str, **extra: Any) -> bytes:
    request = {k: v for k, v in _rec(name)[0].items() if k != "enable_response_messages"}
    return json.dumps({**request, **extra}).encode()


def _events(body: bytes) -> list[dict[str, Any]]:
    """The events of a Responses stream: `event: <type>` and one `data:` line each, the type repeated inside."""
    out = []
    for block in body.split(b"\n\n")[:-1]:
        name, data = block.split(b"\n")
        event = json.loads(data.removeprefix(b"data: "))
        assert name == b"event: " + event["type"].encode()
        out.append(event)
    return out


# --- /v1/responses, unary -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "headers"),
    [
        ({"nvext": NVEXT_IDS}, ()),
        ({"return_token_ids": True}, ((b"x-nvext-mode", b"nvext"),)),
    ],
)
async def test_unary_nvext_placement_has_chat_ids_and_hides_what_the_middleware_turned_on(extra, headers):
    app, upstream = _app("responses_unary_messages")
    request = _request("responses_unary_messages", **extra)
    result = await call(app, RESPONSES, request, headers=((b"content-type", b"application/json"), *headers))
    sent = json.loads(upstream.received or b"")
    assert sent["enable_response_messages"] is True and "nvext" not in sent and "return_token_ids" not in sent
    got = json.loads(result.body)
    completion, prompt = _chat_ids()
    assert got["nvext"] == {"completion_token_ids": completion, "prompt_token_ids": prompt}
    assert got["input_messages"] is None and got["output_messages"] is None
    plain = json.loads(_rec("responses_unary_plain")[1])
    assert without_agent_volatile({k: v for k, v in got.items() if k != "nvext"}) == without_agent_volatile(plain)
    assert result.header(b"content-length") == str(len(result.body)).encode()


async def test_unary_vllm_placement_is_vllms_own_response_messages():
    app, upstream = _app("responses_unary_messages")
    result = await call(app, RESPONSES, _request("responses_unary_messages", return_token_ids=True))
    got = json.loads(result.body)
    completion, prompt = _chat_ids()
    assert "nvext" not in got
    assert got["input_messages"][0]["tokens"] == prompt and got["output_messages"][0]["tokens"] == completion
    assert result.body == _rec("responses_unary_messages")[1]  # vLLM's bytes, untouched


async def test_both_placements_in_mode_both():
    app, _ = _app("responses_unary_messages", mode=Mode.BOTH)
    result = await call(app, RESPONSES, _request("responses_unary_messages", nvext=NVEXT_IDS))
    got = json.loads(result.body)
    completion, prompt = _chat_ids()
    assert got["nvext"]["completion_token_ids"] == completion == got["output_messages"][0]["tokens"]
    assert got["nvext"]["prompt_token_ids"] == prompt == got["input_messages"][0]["tokens"]


async def test_client_that_asked_for_response_messages_keeps_them_with_nvext():
    app, upstream = _app("responses_unary_messages")
    request = _request("responses_unary_messages", enable_response_messages=True, nvext=NVEXT_IDS)
    got = json.loads((await call(app, RESPONSES, request)).body)
    assert got["output_messages"][0]["tokens"] == got["nvext"]["completion_token_ids"] == _chat_ids()[0]


async def test_prompt_ids_selector_alone():
    app, _ = _app("responses_unary_messages")
    request = _request("responses_unary_messages", nvext={"extra_fields": ["prompt_token_ids"]})
    got = json.loads((await call(app, RESPONSES, request)).body)
    assert got["nvext"] == {"prompt_token_ids": _chat_ids()[1]} and got["output_messages"] is None


@pytest.mark.parametrize("mode", list(Mode))
async def test_opt_out_is_byte_identical(mode):
    request, body, _ = _rec("responses_unary_plain")
    app, upstream = _app("responses_unary_plain", mode=mode)
    sent = json.dumps(request).encode()
    result = await call(app, RESPONSES, sent, request_cuts=(4,))
    assert upstream.received == sent and result.body == body


async def test_return_token_ids_false_opts_out():
    app, upstream = _app("responses_unary_plain")
    sent = _request("responses_unary_plain", return_token_ids="false")
    result = await call(app, RESPONSES, sent)
    assert upstream.received == sent and result.body == _rec("responses_unary_plain")[1]


# --- /v1/responses, streamed ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["responses_stream_messages", "responses_stream_messages_long"])
async def test_stream_terminal_event_carries_nvext_everything_else_is_vllms(name):
    app, _ = _app(name)
    result = await call(app, RESPONSES, _request(name, nvext=NVEXT_IDS))
    got, stock = _events(result.body), _events(_rec(name)[1])
    assert got[:-1] == stock[:-1] and len(got) == len(stock)
    final = got[-1]
    assert final["type"] == "response.completed"
    ids = stock[-1]["response"]["output_messages"][0]["tokens"]
    assert final["response"]["nvext"] == {
        "completion_token_ids": ids,
        "prompt_token_ids": stock[-1]["response"]["input_messages"][0]["tokens"],
    }
    assert final["response"]["output_messages"] is None and final["response"]["input_messages"] is None
    assert not any("nvext" in e.get("response", {}) for e in got[:-1])
    # the ids are every generated token: as many as vLLM counts
    assert len(ids) == final["response"]["usage"]["output_tokens"]


async def test_stream_ids_equal_chat_ids():
    app, _ = _app("responses_stream_messages")
    result = await call(app, RESPONSES, _request("responses_stream_messages", nvext=NVEXT_IDS))
    completion, prompt = _chat_ids()
    assert _events(result.body)[-1]["response"]["nvext"] == {
        "completion_token_ids": completion,
        "prompt_token_ids": prompt,
    }


def test_stream_output_does_not_depend_on_how_the_bytes_are_split():
    _, body, _ = _rec("responses_stream_messages")
    plan = plan_responses(_request("responses_stream_messages", nvext=NVEXT_IDS), Mode.AUTO)
    assert plan is not None
    whole = ResponsesStream(plan)
    expected = whole.feed(body) + whole.flush()
    for step in (1, 7, 64):
        split = ResponsesStream(plan)
        out = b"".join(split.feed(body[i : i + step]) for i in range(0, len(body), step)) + split.flush()
        assert out == expected


async def test_stream_opt_out_is_byte_identical():
    request, body, _ = _rec("responses_stream_plain")
    app, upstream = _app("responses_stream_plain")
    result = await call(app, RESPONSES, json.dumps(request).encode())
    assert result.body == body


# --- the answer's edge cases --------------------------------------------------------------------


def _plan(**extra: Any) -> ResponsesPlan:
    plan = plan_responses(json.dumps({"input": "x", **extra}).encode(), Mode.AUTO)
    assert plan is not None
    return plan


def test_ids_not_reported_are_null_never_invented():
    # Harmony models write messages without `tokens`; a failed response has no messages at all.
    assert response_ids({"input_messages": [{"role": "user"}], "output_messages": [{"role": "x"}]}) == (None, None)
    assert response_ids({"input_messages": None, "output_messages": None}) == (None, None)
    obj: dict[str, Any] = {"object": "response", "input_messages": None, "output_messages": None}
    assert reshape_response(obj, _plan(nvext=NVEXT_IDS))
    assert obj["nvext"] == {"completion_token_ids": None, "prompt_token_ids": None}


def test_every_round_is_in_the_ids_and_no_prompt_in_between():
    # vLLM's multi-round layout: first the prompt; then each round's completion, later rounds' prompts between.
    response = {
        "input_messages": [{"tokens": [1, 2]}],
        "output_messages": [{"tokens": [3, 4]}, {"tokens": [1, 2, 3, 4, 9]}, {"tokens": [5]}],
    }
    assert response_ids(response) == ([3, 4, 5], [1, 2])
    assert response_ids({"input_messages": [], "output_messages": []}) == ([], None)


def test_kv_transfer_params_move_under_nvext_unless_the_client_sent_some():
    obj: dict[str, Any] = {"kv_transfer_params": {"k": 1}, "input_messages": [], "output_messages": []}
    reshape_response(obj, _plan(nvext=NVEXT_IDS))
    assert obj["kv_transfer_params"] is None and obj["nvext"]["kv_transfer_params"] == {"k": 1}
    obj = {"kv_transfer_params": {"k": 1}, "input_messages": [], "output_messages": []}
    reshape_response(obj, _plan(nvext=NVEXT_IDS, kv_transfer_params={"do_remote_decode": True}))
    assert obj["kv_transfer_params"] == {"k": 1} == obj["nvext"]["kv_transfer_params"]


def test_a_body_that_is_not_a_response_is_left_alone():
    plan = _plan(nvext=NVEXT_IDS)
    assert reshape_unary(b'{"object": "list"}', plan) is None
    assert not reshape_response({}, _plan(nvext={"cache_salt": "s"}))
    stream = ResponsesStream(plan)
    odd = b'event: response.completed\ndata: {"type":"response.completed","response":1}\n\n'
    not_json = b'event: response.completed\ndata: {"type":"response.completed",\n\n'
    comment = b': "type":"response.completed"\n\n'
    assert stream.feed(odd + not_json + comment) == odd + not_json + comment


async def test_errors_and_non_json_answers_pass_untouched():
    plan = _plan(nvext=NVEXT_IDS)
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    error = ResponsesSend(plan, send)
    await error({"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]})
    await error({"type": "http.response.body", "body": b'{"error": {}}', "more_body": False})
    assert sent[-1]["body"] == b'{"error": {}}'
    broken = ResponsesSend(plan, send)
    await broken({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await broken({"type": "http.response.body", "body": b"not json", "more_body": False})
    assert sent[-1]["body"] == b"not json"
    await broken({"type": "http.response.trailers"})
    assert sent[-1] == {"type": "http.response.trailers"}


# --- what /v1/responses refuses ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"nvext": {"extra_fields": ["completion_token_ids"], "token_data": [1, 2]}}, "nvext.token_data"),
        ({"nvext": {"max_thinking_tokens": 5}}, "nvext.max_thinking_tokens"),
        ({"nvext": {"extra_fields": ["timing"]}}, "nvext.extra_fields"),
        ({"nvext": {"bogus": 1}}, "nvext.bogus"),
        ({"nvext": [1]}, "nvext"),
        ({"return_token_ids": True, "background": True}, "background"),
        ({"return_token_ids": "maybe"}, "return_token_ids"),
    ],
)
async def test_refusals_name_the_field(extra, param):
    app, upstream = _app("responses_unary_plain")
    result = await call(app, RESPONSES, _request("responses_unary_plain", **extra))
    assert result.status == 400 and upstream.calls == 0
    assert json.loads(result.body)["error"]["param"] == param


async def test_max_thinking_tokens_refusal_names_the_installed_release():
    """Mounted in vLLM 0.32 (no thinking budget on its Responses API): the 400 says which vLLM and from when."""
    app, _ = _app("responses_unary_plain")
    result = await call(app, RESPONSES, _request("responses_unary_plain", nvext={"max_thinking_tokens": 5}))
    message = json.loads(result.body)["error"]["message"]
    assert "vLLM 0.32.0" in message and "Responses API has no thinking budget" in message, message
    assert "vLLM 0.34 on: `thinking_token_budget`" in message


async def test_nvext_request_fields_reach_vllm_as_its_own():
    app, upstream = _app("responses_unary_plain")
    request = _request("responses_unary_plain", nvext={"greed_sampling": True, "cache_salt": "salt", "dp_rank": 1})
    await call(app, RESPONSES, request)
    sent = json.loads(upstream.received or b"")
    assert sent["temperature"] == 0.0 and sent["cache_salt"] == "salt" and "nvext" not in sent
    assert "enable_response_messages" not in sent  # no ids asked: nothing turned on
    assert (b"x-data-parallel-rank", b"1") in upstream.received_headers


@pytest.fixture
def responses_take_a_thinking_budget(vllm_at, tmp_path):
    """The installed vLLM (0.32), its Responses request model with vLLM 0.34's `thinking_token_budget` added."""
    from vllm_nvext import _vllm_compat

    installed = _vllm_compat._vllm_root()
    assert installed is not None
    relative = "entrypoints/openai/responses/protocol.py"
    copy = tmp_path / "vllm"
    for name in (relative, "entrypoints/openai/completion/protocol.py"):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_text((installed / name).read_text())
    with (copy / relative).open("a") as protocol:
        protocol.write("\n    thinking_token_budget: ThinkingTokenBudget = None\n")
    vllm_at(copy)


async def test_max_thinking_tokens_reaches_a_vllm_whose_responses_take_a_thinking_budget(
    responses_take_a_thinking_budget,
):
    """vLLM 0.34's Responses API: `nvext.max_thinking_tokens` is sent as `thinking_token_budget` (a root one wins)."""
    for extra, budget in (({}, 5), ({"thinking_token_budget": 9}, 9)):
        app, upstream = _app("responses_unary_plain")
        result = await call(
            app, RESPONSES, _request("responses_unary_plain", nvext={"max_thinking_tokens": 5}, **extra)
        )
        sent = json.loads(upstream.received or b"")
        assert result.status == 200 and sent["thinking_token_budget"] == budget and "nvext" not in sent


async def test_messages_refuse_max_thinking_tokens_where_responses_take_it(responses_take_a_thinking_budget):
    """/v1/messages has Anthropic's own `thinking.budget_tokens`: `nvext.max_thinking_tokens` stays refused there."""
    app, upstream = _app("responses_unary_plain")
    body = json.dumps({"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                       "nvext": {"max_thinking_tokens": 5}}).encode()  # fmt: skip
    result = await call(app, "/v1/messages", body)
    assert result.status == 400 and upstream.calls == 0
    assert "`nvext.max_thinking_tokens` is not supported on /v1/messages" in json.loads(result.body)["error"]["message"]


def test_bodies_that_are_not_objects_pass_through():
    for body in (b"[1]", b"{", b'"nvext"'):
        assert plan_responses(body, Mode.AUTO) is None


# --- /v1/messages --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"return_token_ids": True}, "return_token_ids"),
        ({"nvext": NVEXT_IDS}, "nvext.extra_fields"),
        ({"nvext": {"extra_fields": ["prompt_token_ids"]}, "return_token_ids": True}, "nvext.extra_fields"),
    ],
)
async def test_messages_with_ids_asked_is_a_400_in_anthropics_envelope_never_a_200_without_them(extra, param):
    request, body, content_type = _rec("messages_unary_plain")
    upstream = Upstream(content_type=content_type, body=body)
    app = NvextMiddleware(upstream, settings=Settings())
    result = await call(app, MESSAGES, json.dumps({**request, **extra}).encode())
    assert result.status == 400 and upstream.calls == 0
    error = json.loads(result.body)
    assert error["type"] == "error" and error["error"]["type"] == "BadRequestError"
    assert f"`{param}`" in error["error"]["message"] and "endpoint plugin" in error["error"]["message"]


@pytest.mark.parametrize("name", ["messages_unary_plain", "messages_stream_plain"])
async def test_messages_opt_out_is_byte_identical(name, monkeypatch):
    request, body, content_type = _rec(name)
    upstream = Upstream(content_type=content_type, body=body)
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    monkeypatch.setattr(nvjson, "loads", None)  # never decoded
    sent = json.dumps(request).encode()
    result = await call(app, MESSAGES, sent)
    assert upstream.received == sent and result.body == body
    assert plan_messages(json.dumps({**request, "return_token_ids": False}).encode(), Mode.AUTO) is None


async def test_messages_nvext_without_ids_reaches_vllm_as_its_own_fields():
    request, body, content_type = _rec("messages_unary_plain")
    upstream = Upstream(content_type=content_type, body=body)
    app = NvextMiddleware(upstream, settings=Settings())
    result = await call(app, MESSAGES, json.dumps({**request, "nvext": {"cache_salt": "s"}}).encode())
    assert result.body == body
    assert json.loads(upstream.received or b"") == {**request, "cache_salt": "s"}

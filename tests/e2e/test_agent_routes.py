"""Token ids on the agent routes (docs/protocol.md §11), on vLLM 0.32's real engine, both mounts.

/v1/responses through the OpenAI SDK (`responses.create` / `responses.stream` with `extra_body`):
the ids equal chat's for the same conversation; /v1/messages through the Anthropic SDK: a request
that asks for ids is refused, any other is stock vLLM's answer.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from scripts.vllm_harness import text_ids
from tests.helpers import API_KEY, CHAT, MODEL_NAME, http_client, post, websocket_refusal, without_agent_volatile
from tests.support.servers import TOOL_CALL_TEXT, tiny_model_dir

pytestmark = pytest.mark.e2e

TEXT = "Tell me about token ids."
MAX = 12
RESPONSES_BODY: dict[str, Any] = {"model": MODEL_NAME, "input": TEXT, "max_output_tokens": MAX, "temperature": 0}
MESSAGES_BODY: dict[str, Any] = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": TEXT}],
    "max_tokens": MAX,
}
# The Anthropic SDK's methods take no `temperature` here: it travels in extra_body.
GREEDY = {"temperature": 0}
NVEXT_IDS = {"nvext": {"extra_fields": ["completion_token_ids"]}}


@pytest.fixture(scope="module")
def chat_ids(raw: httpx.Client) -> tuple[list[int], list[int]]:
    """(completion ids, prompt ids) of the same conversation on chat, from stock vLLM."""
    answer = post(raw, CHAT, {**MESSAGES_BODY, **GREEDY, "return_token_ids": True})
    return answer["choices"][0]["token_ids"], answer["prompt_token_ids"]


@pytest.fixture(params=["mw", "plugin"])
def server_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue(f"{request.param}_server").url)


def _runs(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


# The SDKs' clients are used in a `with`: one left to the garbage collector leaves its socket to an
# unclosed-socket warning (an error under pytest) in whichever later test runs then (as capture_loops.py).
def _sdk(url: str) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)


def _sdk_answer(url: str, body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """The OpenAI SDK's response object for `body` with nvext ids: created, or the stream's final one."""
    with _sdk(url) as sdk:
        if not stream:
            return dict(sdk.responses.create(**body, extra_body=NVEXT_IDS).to_dict())
        with sdk.responses.stream(**body, extra_body=NVEXT_IDS) as events:
            for _ in events:
                pass
            return dict(events.get_final_response().to_dict())


def test_codex_websocket_attempt_is_answered_426_and_http_serves_the_same_route(server_url, raw_server):
    """Codex opens a WebSocket on /v1/responses first; 426 is what makes it POST at once (docs/protocol.md §11.4)."""
    status, body = websocket_refusal(server_url)
    assert status == 426 and json.loads(body)["error"]["code"] == 426
    assert websocket_refusal(raw_server.url)[0] == 403, "stock vLLM: no such WebSocket route"
    # vLLM's key check comes first: without the key it is vLLM's own 401.
    assert websocket_refusal(server_url, auth=False)[0] == 401
    with http_client(server_url) as client:
        assert post(client, "/v1/responses", RESPONSES_BODY)["object"] == "response"


def test_responses_create_nvext_ids_equal_chat_and_the_rest_is_stock(server_url, raw, chat_ids):
    with _sdk(server_url) as sdk:
        answer = sdk.responses.create(**RESPONSES_BODY, extra_body=NVEXT_IDS).to_dict()
    completion, prompt = chat_ids
    assert answer["nvext"] == {"completion_token_ids": completion, "prompt_token_ids": prompt}
    assert answer["input_messages"] is None and answer["output_messages"] is None
    stock = post(raw, "/v1/responses", RESPONSES_BODY)
    assert without_agent_volatile({k: v for k, v in answer.items() if k != "nvext"}) == without_agent_volatile(stock)


def test_responses_create_vllm_dialect_is_vllms_response_messages(server_url, chat_ids):
    with _sdk(server_url) as sdk:
        answer = sdk.responses.create(**RESPONSES_BODY, extra_body={"return_token_ids": True}).to_dict()
    completion, prompt = chat_ids
    assert "nvext" not in answer
    assert answer["input_messages"][0]["tokens"] == prompt and answer["output_messages"][0]["tokens"] == completion


def test_responses_stream_ends_with_the_ids_on_the_final_response(server_url, raw, chat_ids):
    with _sdk(server_url) as sdk, sdk.responses.stream(**RESPONSES_BODY, extra_body=NVEXT_IDS) as stream:
        types = [event.type for event in stream]
        final = stream.get_final_response().to_dict()
    completion, prompt = chat_ids
    assert types[-1] == "response.completed"
    assert final["nvext"] == {"completion_token_ids": completion, "prompt_token_ids": prompt}
    assert final["output_messages"] is None
    with raw.stream("POST", "/v1/responses", json={**RESPONSES_BODY, "stream": True}) as stock:
        stock_types = [line[7:] for line in stock.iter_lines() if line.startswith("event: ")]
    # chunk boundaries are vLLM's business: the same kinds of events, in the same order
    assert _runs(types) == _runs(stock_types)


def test_responses_opt_out_is_stock(server_url, raw):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    got = httpx.post(server_url + "/v1/responses", json=RESPONSES_BODY, headers=headers, timeout=120)
    assert got.status_code == 200
    assert without_agent_volatile(got.json()) == without_agent_volatile(post(raw, "/v1/responses", RESPONSES_BODY))


def test_responses_refuses_what_it_cannot_answer_naming_the_field(server_url):
    openai = pytest.importorskip("openai")
    with _sdk(server_url) as sdk, pytest.raises(openai.BadRequestError) as refused:
        sdk.responses.create(**RESPONSES_BODY, extra_body={"nvext": {"extra_fields": ["timing"]}})
    assert refused.value.status_code == 400 and refused.value.body["param"] == "nvext.extra_fields"


def _anthropic(url: str) -> Any:
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)


def test_messages_through_the_middleware_mount_asking_for_ids_is_a_400_never_a_200_without_them(mw_server):
    anthropic = pytest.importorskip("anthropic")
    with _anthropic(mw_server.url) as client:
        for extra in (NVEXT_IDS, {"return_token_ids": True}):
            with pytest.raises(anthropic.BadRequestError) as refused:
                client.messages.create(**MESSAGES_BODY, extra_body={**GREEDY, **extra})
            assert "endpoint plugin" in refused.value.body["error"]["message"]
            with (
                pytest.raises(anthropic.BadRequestError),
                client.messages.stream(**MESSAGES_BODY, extra_body={**GREEDY, **extra}) as s,
            ):
                s.get_final_message()


def test_messages_create_through_the_plugin_has_chat_ids_in_both_dialects(plugin_server, raw, chat_ids):
    with _anthropic(plugin_server.url) as client:
        completion, prompt = chat_ids
        message = client.messages.create(**MESSAGES_BODY, extra_body={**GREEDY, **NVEXT_IDS}).to_dict()
        assert message["nvext"] == {"completion_token_ids": completion, "prompt_token_ids": prompt}
        stock = post(raw, "/v1/messages", {**MESSAGES_BODY, **GREEDY})
        without_ids = {k: v for k, v in message.items() if k != "nvext"}
        assert without_agent_volatile(without_ids) == without_agent_volatile(stock)
        vllm = client.messages.create(**MESSAGES_BODY, extra_body={**GREEDY, "return_token_ids": True}).to_dict()
        assert vllm["token_ids"] == completion and vllm["prompt_token_ids"] == prompt and "nvext" not in vllm


def test_messages_stream_through_the_plugin_has_the_ids_on_message_delta(plugin_server, chat_ids):
    with _anthropic(plugin_server.url) as client:
        completion, prompt = chat_ids
        with client.messages.stream(**MESSAGES_BODY, extra_body={**GREEDY, **NVEXT_IDS}) as stream:
            deltas = [event.to_dict() for event in stream if event.type == "message_delta"]
            text = stream.get_final_message().content[0].to_dict()["text"]
        assert [d["nvext"] for d in deltas] == [{"completion_token_ids": completion, "prompt_token_ids": prompt}]
        unary = client.messages.create(**MESSAGES_BODY, extra_body=GREEDY).to_dict()
        assert text == unary["content"][0]["text"]
        with client.messages.stream(**MESSAGES_BODY, extra_body={**GREEDY, "return_token_ids": True}) as stream:
            events = [event.to_dict() for event in stream]
        start = next(e for e in events if e["type"] == "message_start")
        delta = next(e for e in events if e["type"] == "message_delta")
        assert start["message"]["prompt_token_ids"] == prompt and delta["token_ids"] == completion


def test_an_invalid_messages_body_gets_stock_vllms_own_400_through_the_plugin(plugin_server, raw):
    """The plugin answers an opted-in body vLLM's Messages model refuses with stock vLLM's own 400, byte
    for byte (its errors count the body's keys as sent), from one validation
    (tests/unit/test_messages_api.py counts them)."""
    with httpx.Client(base_url=str(plugin_server.url), headers=raw.headers, timeout=60) as plugin:
        for extra in (NVEXT_IDS, {"return_token_ids": True}):
            body = {"model": MODEL_NAME, "messages": [{"role": "user"}] * 3, **extra}
            stock = raw.post("/v1/messages", json=body)
            served = plugin.post("/v1/messages", json=body)
            assert stock.status_code == 400 and "validation errors" in stock.json()["error"]["message"]
            assert (served.status_code, served.content) == (stock.status_code, stock.content)


def test_messages_opt_out_is_stock(server_url, raw):
    with _anthropic(server_url) as client:
        message = client.messages.create(**MESSAGES_BODY, extra_body=GREEDY).to_dict()
        stock = post(raw, "/v1/messages", {**MESSAGES_BODY, **GREEDY})
        assert without_agent_volatile(message) == without_agent_volatile(stock)
        with client.messages.stream(**MESSAGES_BODY, extra_body=GREEDY) as stream:
            streamed = stream.get_final_message()
        assert [block.to_dict() for block in streamed.content] == stock["content"]


# --- every sampled token: a server with a reasoning parser (marker e2e_parser, a pytest run of its own) ---


@pytest.mark.e2e_parser
@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_tokens_are_in_the_responses_ids(parser_server, stream):
    # The tiny model never closes its thinking: with the qwen3 parser all of its output is reasoning.
    body = {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": MAX, "temperature": 0}
    chat_body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": MAX}
    with httpx.Client(base_url=parser_server.url, timeout=120.0) as client:
        chat = post(client, CHAT, {**chat_body, "temperature": 0, "return_token_ids": True})
    answer = _sdk_answer(parser_server.url, body, stream)
    assert "reasoning" in [item["type"] for item in answer["output"]]
    assert answer["nvext"] == {
        "completion_token_ids": chat["choices"][0]["token_ids"],
        "prompt_token_ids": chat["prompt_token_ids"],
    }
    assert len(answer["nvext"]["completion_token_ids"]) == answer["usage"]["output_tokens"]


# --- every sampled token: a tool call on the 0.33 serving layer (its scripted engine samples it) ---
# Marker e2e_parser: in the parser group's pytest run, never beside the main group (its server adds ~1.9 GB).

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOL_MAX = 100  # the scripted tool call is shorter: it ends with finish `stop`
WEATHER_ARGUMENTS = {"city": "Paris"}


@pytest.fixture(scope="module")
def tool_chat(tool033_server) -> tuple[list[int], list[int]]:
    """(completion ids, prompt ids) of the tool-call conversation on chat, on the same server."""
    body = {
        **MESSAGES_BODY,
        "max_tokens": TOOL_MAX,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_SCHEMA}}],
        "return_token_ids": True,
    }
    with httpx.Client(base_url=tool033_server.url, headers={"Authorization": f"Bearer {API_KEY}"}) as client:
        answer = post(client, CHAT, body)
    choice = answer["choices"][0]
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["get_weather"]
    # the scripted engine sampled exactly the tool call's ids, and chat reports all of them
    assert choice["token_ids"] == text_ids(tiny_model_dir(), TOOL_CALL_TEXT)
    return choice["token_ids"], answer["prompt_token_ids"]


@pytest.mark.e2e_parser
@pytest.mark.parametrize("stream", [False, True])
def test_responses_function_call_tokens_are_in_the_ids(tool033_server, tool_chat, stream):
    body = {
        **RESPONSES_BODY,
        "max_output_tokens": TOOL_MAX,
        "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER_SCHEMA}],
    }
    answer = _sdk_answer(tool033_server.url, body, stream)
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", WEATHER_ARGUMENTS)]
    completion, prompt = tool_chat
    assert answer["nvext"] == {"completion_token_ids": completion, "prompt_token_ids": prompt}
    assert len(completion) == answer["usage"]["output_tokens"]


@pytest.mark.e2e_parser
@pytest.mark.parametrize("stream", [False, True])
def test_messages_tool_use_tokens_are_in_the_ids_through_the_plugin(tool033_server, tool_chat, stream):
    body = {
        **MESSAGES_BODY,
        "max_tokens": TOOL_MAX,
        "tools": [{"name": "get_weather", "input_schema": WEATHER_SCHEMA}],
    }
    with _anthropic(tool033_server.url) as client:
        completion, prompt = tool_chat
        if stream:
            with client.messages.stream(**body, extra_body=NVEXT_IDS) as events:
                deltas = [event.to_dict() for event in events if event.type == "message_delta"]
                message = events.get_final_message().to_dict()
            assert [d["nvext"] for d in deltas] == [{"completion_token_ids": completion, "prompt_token_ids": prompt}]
        else:
            message = client.messages.create(**body, extra_body=NVEXT_IDS).to_dict()
            assert message["nvext"] == {"completion_token_ids": completion, "prompt_token_ids": prompt}
        uses = [block for block in message["content"] if block["type"] == "tool_use"]
        assert [(u["name"], u["input"]) for u in uses] == [("get_weather", WEATHER_ARGUMENTS)]
        assert message["stop_reason"] == "tool_use"
        assert len(completion) == message["usage"]["output_tokens"]

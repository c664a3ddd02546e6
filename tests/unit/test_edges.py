"""Where the middleware meets the rest of vLLM, on recorded answers: withheld ids stay unreported,
an orchestrator's root kv_transfer_params stays at the root, vLLM's errors name the client's field,
the echoed prompt is put back, and the batch route follows the several-choices rules.

Withheld ids are recordings with `token_ids` set to null, exactly what vLLM writes when it hides
them (`include_reasoning: false` on a server with a parser; tests/e2e/test_edges.py sees it live).
"""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest

from tests.helpers import CHAT, COMPLETIONS, sse_events, sse_frames
from tests.recorded import recording
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, _vllm_compat
from vllm_nvext.inbound.request import plan, plan_request, read_request
from vllm_nvext.outbound.chunks import rename_error, reshape_unary
from vllm_nvext.outbound.decoding import DecodingStreamReshaper
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.outbound.stream import StreamReshaper
from vllm_nvext.protocol import Endpoint, RequestError

NVEXT_IDS = {"extra_fields": ["completion_token_ids", "engine_data"]}


def _plan(body: dict, endpoint: Endpoint = Endpoint.CHAT, mode: Mode = Mode.AUTO):
    plan = plan_request(json.dumps(body).encode(), endpoint, mode)
    assert plan is not None
    return plan


def _withheld(event: bytes) -> bytes:
    return re.sub(rb'"token_ids":\[[0-9,]*\]', b'"token_ids":null', event)


def test_withheld_unary_ids_are_null_never_empty():
    rec = recording("chat_unary_ids")
    body = rec.json()
    body["choices"][0]["token_ids"] = None
    plan = _plan({**rec.request, "nvext": NVEXT_IDS})
    assert reshape_unary(body, plan, Clock())
    nv = body["nvext"]
    assert "completion_token_ids" in nv and nv["completion_token_ids"] is None, "not reported, never []"
    assert nv["engine_data"]["completion_token_ids"] is None
    assert nv["prompt_token_ids"] == rec.json()["prompt_token_ids"], "vLLM still reports the prompt ids"


def _stream_through(plan, events: list[bytes], fast: bool) -> list[dict]:
    reshaper = (StreamReshaper if fast else DecodingStreamReshaper)(plan, Clock())  # else the general path only
    sent = b""
    for event in events:
        new = reshaper.reshape_event(event)
        sent += event if new is None else new  # the finish chunk waits for the usage chunk
    sent += reshaper.flush()
    return [c for c in sse_events(sent, complete=False) if c["choices"]]


# What vLLM's args hold on a server with a reasoning parser (`--reasoning-parser qwen3`).
PARSER_ARGS = SimpleNamespace(reasoning_parser="qwen3", tool_call_parser=None, enable_auto_tool_choice=False)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("mode", [Mode.AUTO, Mode.BOTH])
def test_withheld_stream_ids_are_null_on_every_chunk_the_role_chunk_too(fast, mode):
    rec = recording("chat_stream_ids")
    request = read_request(
        json.dumps({**rec.request, "include_reasoning": False, "nvext": NVEXT_IDS}).encode(), Endpoint.CHAT
    )
    assert request is not None
    hides = _vllm_compat.hides_reasoning_ids(PARSER_ARGS)
    chunks = _stream_through(plan(request, mode, hides_reasoning_ids=hides), [*map(_withheld, sse_frames(rec.body))],
                             fast)  # fmt: skip
    assert "token_ids" not in chunks[0]["choices"][0], "the role chunk, before any id"
    for chunk in chunks:
        # A client doing `ids += chunk["nvext"]["completion_token_ids"] or []` would read [] as "no tokens".
        assert chunk["nvext"]["completion_token_ids"] is None, chunk
    finish = chunks[-1]["nvext"]
    assert finish["engine_data"]["completion_token_ids"] is None and finish["engine_data"]["finished"] is True


@pytest.mark.parametrize("fast", [True, False])
def test_role_chunk_says_no_tokens_where_vllm_reports_the_ids(fast):
    rec = recording("chat_stream_ids")
    shown = [i for e in sse_events(rec.body) if e["choices"] for i in e["choices"][0].get("token_ids") or []]
    for body, hides in (({**rec.request, "include_reasoning": False}, False), (rec.request, True)):
        request = read_request(json.dumps({**body, "nvext": NVEXT_IDS}).encode(), Endpoint.CHAT)
        assert request is not None
        chunks = _stream_through(plan(request, Mode.AUTO, hides_reasoning_ids=hides), sse_frames(rec.body), fast)
        assert chunks[0]["nvext"]["completion_token_ids"] == [], "the role chunk has no token: [] is true"
        assert [i for c in chunks for i in c["nvext"]["completion_token_ids"]] == shown


@pytest.mark.parametrize(
    ("args", "hides"),
    [
        (None, False),
        (SimpleNamespace(), False),
        (PARSER_ARGS, True),
        (
            SimpleNamespace(reasoning_parser="", structured_outputs_config=SimpleNamespace(reasoning_parser="qwen3")),
            True,
        ),
        (SimpleNamespace(reasoning_parser=None, tool_call_parser="hermes", enable_auto_tool_choice=True), True),
        # vLLM composes no tool parser without auto tool choice: it reports the ids.
        (SimpleNamespace(reasoning_parser=None, tool_call_parser="hermes", enable_auto_tool_choice=False), False),
    ],
)
def test_the_server_withholds_ids_exactly_when_vllm_composes_a_parser(args, hides):
    assert _vllm_compat.hides_reasoning_ids(args) is hides


def test_withheld_ids_are_read_from_the_servers_args_through_the_middleware():
    rec = recording("chat_stream_ids")
    body = json.dumps({**rec.request, "include_reasoning": False, "nvext": NVEXT_IDS}).encode()
    for args, role_ids in ((PARSER_ARGS, None), (SimpleNamespace(reasoning_parser=None), [])):
        app = SimpleNamespace(state=SimpleNamespace(args=args))
        upstream = Upstream(content_type="text/event-stream", body=b"".join(map(_withheld, sse_frames(rec.body))))
        got = asyncio.run(call(NvextMiddleware(upstream), CHAT, body, scope_extra={"app": app}))
        assert sse_events(got.body, complete=False)[0]["nvext"]["completion_token_ids"] == role_ids


def test_orchestrator_root_kv_transfer_params_stay_at_the_root_in_every_mode():
    rec = recording("chat_unary_ids")
    for mode in Mode:
        for extra in ({"nvext": {"extra_fields": ["completion_token_ids"]}}, {"return_token_ids": True}):
            body = rec.json()
            body["kv_transfer_params"] = {"do_remote_prefill": True, "remote_block_ids": [1]}
            plan = _plan({**rec.request, **extra, "kv_transfer_params": {"do_remote_decode": True}}, mode=mode)
            reshape_unary(body, plan, Clock())
            assert body["kv_transfer_params"] == {"do_remote_prefill": True, "remote_block_ids": [1]}, mode
            if plan.nvext_trio:
                assert body["nvext"]["kv_transfer_params"] == body["kv_transfer_params"], "the nvext copy too"
    # Without the client's own root kv_transfer_params, nvext placement moves it (docs/protocol.md).
    body = rec.json()
    body["kv_transfer_params"] = {"hidden_states_path": "/x"}
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    reshape_unary(body, _plan({**request, "nvext": {"extra_fields": ["completion_token_ids"]}}), Clock())
    assert body["kv_transfer_params"] is None and body["nvext"]["kv_transfer_params"] == {"hidden_states_path": "/x"}


@pytest.mark.parametrize(
    ("endpoint", "nvext", "error", "client_field"),
    [
        (
            Endpoint.CHAT,
            {"token_data": [71, 999]},
            {"message": "Token id 999 is out of vocabulary", "param": "kv_transfer_params.prompt_token_ids"},
            "nvext.token_data",
        ),
        (
            Endpoint.COMPLETIONS,
            {"token_data": [71, 999]},
            {"message": "Token id 999 is out of vocabulary", "param": None},
            "nvext.token_data",
        ),
        (
            Endpoint.CHAT,
            {"max_thinking_tokens": 5},
            {"message": "thinking_token_budget is set but reasoning_config is not configured.", "param": None},
            "nvext.max_thinking_tokens",
        ),
    ],
)
def test_vllm_errors_about_a_field_the_middleware_set_name_the_clients_field(endpoint, nvext, error, client_field):
    base = {"model": "tiny", "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "x"}]} if endpoint is Endpoint.CHAT else {"prompt": "x"})
    plan = _plan({**base, "nvext": nvext}, endpoint)
    answer = {"error": {**error, "type": "BadRequestError", "code": 400}}
    assert plan.reshapes_response and rename_error(answer, plan)
    assert answer["error"]["param"] == client_field
    assert answer["error"]["message"].startswith(f"`{client_field}`") and error["message"] in answer["error"]["message"]
    unrelated = {"error": {"message": "temperature must be non-negative", "param": "temperature"}}
    assert not rename_error(unrelated, plan), "an error about another field is left as vLLM wrote it"


@pytest.mark.parametrize(
    ("nvext", "error"),
    [
        # the client's model name holds the field's name: stock's 404 about `model` stays
        ({"greed_sampling": True}, {"message": "The model `my temperature model` does not exist.", "param": "model"}),
        ({"cache_salt": "s"}, {"message": "The model `cache_salt` does not exist.", "param": "model"}),
        ({"token_data": [1]}, {"message": "The model `Token id 5` does not exist.", "param": "model"}),
        # a logit_bias key named like the field: vLLM's message quotes it, with no param
        ({"greed_sampling": True}, {"message": "Invalid key in logit_bias: 'temperature'", "param": None}),
        ({"max_thinking_tokens": 5}, {"message": "Bad logit_bias key 'thinking_token_budget x'", "param": None}),
        ({"token_data": [1]}, {"message": "bad logit_bias key 'Token id 5 is out of vocabulary'", "param": None}),
    ],
)
def test_errors_are_renamed_from_vllms_param_never_from_text_a_client_wrote(nvext, error):
    """vLLM's message can quote the client (its model name, a logit_bias key): only `param` or one of
    vLLM's whole-message templates tells which field an error is about (docs/protocol.md §9)."""
    plan = _plan({"model": "tiny", "prompt": "x", "nvext": nvext}, Endpoint.COMPLETIONS)
    answer = {"error": {**error, "type": "NotFoundError", "code": 404}}
    assert plan.error_params and not rename_error(answer, plan)
    assert answer["error"] == {**error, "type": "NotFoundError", "code": 404}, "as vLLM wrote it"


def test_echoed_prompt_is_put_back_per_choice():
    rec = recording("completions_unary_ids_n2")
    body = rec.json()
    for choice in body["choices"]:
        choice["text"] = "gen"  # what vLLM writes under return_token_ids: the prompt's text left out
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    nvext = {"extra_fields": ["completion_token_ids"]}  # in vLLM placement: ids on several choices
    plan = _plan(
        {**request, "prompt": ["A", "B"], "n": 1, "echo": True, "nvext": nvext}, Endpoint.COMPLETIONS, Mode.VLLM
    )
    assert plan.echo_prompts == ("A", "B")
    reshape_unary(body, plan, Clock())
    assert [c["text"] for c in body["choices"]] == ["Agen", "Bgen"][: len(body["choices"])]


def test_chat_batch_follows_the_several_choices_rules():
    two = {"model": "tiny", "messages": [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]}
    plan = _plan({**two, "return_token_ids": True}, Endpoint.CHAT_BATCH)
    assert plan.vllm_placement and not plan.single_choice and not plan.nvext_trio
    with pytest.raises(RequestError) as trio:
        _plan({**two, "nvext": {"extra_fields": ["completion_token_ids"]}}, Endpoint.CHAT_BATCH)
    assert trio.value.param == "messages"
    with pytest.raises(RequestError) as streamed:
        _plan({**two, "stream": True, "return_token_ids": True}, Endpoint.CHAT_BATCH)
    assert streamed.value.param == "stream", "vLLM would answer each conversation with its last token only"
    one = _plan({**two, "messages": two["messages"][:1], "nvext": {"extra_fields": ["completion_token_ids"]}},
                Endpoint.CHAT_BATCH)  # fmt: skip
    assert one.nvext_trio


@pytest.mark.parametrize(
    "messages",
    [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], [], [[]], "junk", [[{"role": "user"}], {}]],
)
def test_batch_messages_that_are_not_conversations_get_vllms_own_error(messages):
    """vLLM's batch model refuses them itself: the middleware's several-choices refusal never answers."""
    body = {"model": "tiny", "messages": messages, "nvext": {"extra_fields": ["completion_token_ids"]}}
    assert plan_request(json.dumps(body).encode(), Endpoint.CHAT_BATCH, Mode.AUTO) is None


def test_invocations_is_read_as_the_route_vllm_serves_it_on():
    chat = _plan({"messages": [{"role": "user", "content": "a"}], "return_token_ids": True}, Endpoint.INVOCATIONS)
    completions = _plan({"prompt": "a", "return_token_ids": True}, Endpoint.INVOCATIONS)
    assert chat.endpoint is Endpoint.CHAT and completions.endpoint is Endpoint.COMPLETIONS


class _VllmWithDetokenize:
    """Stands in for vLLM: `/detokenize` decodes ids as `chr`, completions answer `gen` with ids on."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.detokenized: list[tuple[str, list[tuple[bytes, bytes]], dict]] = []

    async def __call__(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        data = json.loads(body)
        answer: dict[str, Any]
        if scope["path"].endswith("/detokenize"):
            await asyncio.sleep(0)  # vLLM's tokenizer runs apart: the event loop turns meanwhile
            self.detokenized.append((scope["path"], list(scope["headers"]), data))
            status, answer = (400, {"error": {"message": "Token id 99999 is out of vocabulary"}}) if self.refuse else (
                200, {"prompt": "".join(chr(t) for t in data["tokens"])})  # fmt: skip
        elif self.refuse:  # vLLM's completions check the same ids
            status, answer = 400, {"error": {"message": "Token id 99999 is out of vocabulary", "param": None}}
        else:
            status = 200
            prompts = data["prompt"] if isinstance(data["prompt"][0], list) else [data["prompt"]]
            answer = {"choices": [{"index": i, "text": "gen", "token_ids": [1, 2], "prompt_token_ids": p}
                                  for i, p in enumerate(prompts)]}  # fmt: skip
        out = json.dumps(answer).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out, "more_body": False})


async def test_echo_of_an_id_prompt_is_decoded_by_vllms_own_detokenize():
    from tests.unit.asgi import call
    from vllm_nvext import NvextMiddleware, Settings

    vllm = _VllmWithDetokenize()
    app = NvextMiddleware(vllm, settings=Settings())
    body = json.dumps(
        {"model": "tiny", "prompt": [72, 105], "echo": True, "nvext": {"extra_fields": ["completion_token_ids"]}}
    )
    headers = ((b"content-type", b"application/json"), (b"authorization", b"Bearer k"))
    result = await call(app, "/api/v1/completions", body.encode(), headers=headers, root_path="/api")
    assert result.status == 200
    answer = json.loads(result.body)
    assert answer["choices"][0]["text"] == "Higen", "the decoded prompt, then the completion"
    assert answer["nvext"]["completion_token_ids"] == [1, 2]
    path, sent_headers, sent = vllm.detokenized[0]
    assert path == "/api/detokenize" and sent == {"model": "tiny", "tokens": [72, 105]}
    assert (b"authorization", b"Bearer k") in sent_headers, "with the client's credentials"

    refusing = _VllmWithDetokenize(refuse=True)
    result = await call(NvextMiddleware(refusing, settings=Settings()), COMPLETIONS, body.encode())
    assert result.status == 400 and b"out of vocabulary" in result.body, "vLLM's own answer about the ids"
    assert not refusing.detokenized and json.loads(result.body)["error"]["param"] is None, (
        "vLLM refused first: its completions answer, as stock; never /detokenize's, which names `body.tokens.0`"
    )

    async def not_json(scope, receive, send) -> None:  # a route answering something else: never a 500
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"<html>", "more_body": False})

    result = await call(NvextMiddleware(not_json, settings=Settings()), COMPLETIONS, body.encode())
    assert (result.status, result.body) == (200, b"<html>")


async def test_a_field_mapped_without_ids_leaves_vllms_answer_byte_for_byte():
    # greed_sampling alone: only an error about `temperature` could change; a good answer is vLLM's bytes.
    from tests.unit.asgi import Upstream, call
    from vllm_nvext import NvextMiddleware, Settings

    answer = b'{"choices": [{"index": 0, "text": "a"}], "usage": {"completion_tokens": 1}}'
    app = NvextMiddleware(Upstream(body=answer), settings=Settings())
    body = json.dumps({"model": "tiny", "prompt": "x", "nvext": {"greed_sampling": True}}).encode()
    result = await call(app, COMPLETIONS, body)
    assert result.status == 200 and result.body == answer
    error = b'{"error": {"message": "temperature is bad", "param": "temperature", "code": 400}}'
    refused = await call(NvextMiddleware(Upstream(status=400, body=error), settings=Settings()), COMPLETIONS, body)
    assert json.loads(refused.body)["error"]["param"] == "nvext.greed_sampling", "the client's field"


async def test_echo_decodes_each_distinct_id_prompt_once_and_stops_when_the_client_goes():
    from tests.unit.asgi import call
    from vllm_nvext import NvextMiddleware, Settings

    prompts = [[72, 105], [72, 105], [79, 107], [72, 105]]
    body = json.dumps(
        {"model": "tiny", "prompt": prompts, "echo": True, "nvext": {"extra_fields": ["timing"]}}
    ).encode()
    vllm = _VllmWithDetokenize()
    result = await call(NvextMiddleware(vllm, settings=Settings()), COMPLETIONS, body)
    assert [c["text"] for c in json.loads(result.body)["choices"]] == ["Higen", "Higen", "Okgen", "Higen"]
    assert [d["tokens"] for _, _, d in vllm.detokenized] == [[72, 105], [79, 107]], "one call per distinct prompt"

    gone = _VllmWithDetokenize()
    app = NvextMiddleware(gone, settings=Settings())
    many = json.dumps(
        {"model": "tiny", "prompt": [[65 + i] for i in range(50)], "echo": True, "nvext": {"extra_fields": ["timing"]}}
    ).encode()
    with pytest.raises(KeyError):  # the driver saw no response at all: nothing was sent to the client
        await call(app, COMPLETIONS, many, disconnect_after_body=True)
    assert len(gone.detokenized) < 5, "decoding stops when the client goes, not after the 50 prompts"
    assert all(path.endswith("/detokenize") for path, _, _ in gone.detokenized), "nothing went upstream"

"""The middleware over recorded vLLM responses: what a client sees, byte for byte."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import CHAT, COMPLETIONS, sse_events
from tests.recorded import Recording, recording, recordings
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings
from vllm_nvext import _json as nvjson

JSON = ((b"content-type", b"application/json"),)
NVEXT_IDS = {"extra_fields": ["completion_token_ids"]}


def _app(rec: Recording, cuts=(), **settings) -> tuple[NvextMiddleware, Upstream]:
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=rec.body, cuts=cuts)
    return NvextMiddleware(upstream, settings=Settings(**settings)), upstream


def _nvext_request(rec: Recording) -> bytes:
    body = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    return json.dumps({**body, "nvext": NVEXT_IDS}).encode()


def _assert_length_header(result):
    assert result.header(b"content-length") == str(len(result.body)).encode(), "content-length must match the body"


# --- pass-through -------------------------------------------------------------------------


@pytest.fixture
def no_json_parse(monkeypatch):
    def forbidden(_data):
        raise AssertionError("a request that opts into nothing must not be parsed")

    monkeypatch.setattr(nvjson, "loads", forbidden)


@pytest.mark.parametrize("name", [n for n in recordings() if "plain" in n])
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("request_cuts", [(3, 10), ()], ids=["in pieces", "whole"])
async def test_request_that_opts_into_nothing_is_byte_identical(name, mode, request_cuts, no_json_parse):
    rec = recording(name)
    app, upstream = _app(rec, cuts=(7, 100), mode=mode)
    body = json.dumps(rec.request).encode()
    result = await call(app, rec.path, body, request_cuts=request_cuts)
    assert upstream.received == body and upstream.received_headers[-1] == (b"content-length", str(len(body)).encode())
    assert result.body == rec.body and result.status == rec.status
    assert result.headers == (await call(upstream, rec.path, body)).headers, "vLLM's own answer, headers too"


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/v1/embeddings", "/v1/chat/completions/x"])
async def test_other_routes_are_not_touched(path, no_json_parse):
    rec = recording("chat_unary_ids")
    app, upstream = _app(rec, mode=Mode.NVEXT)
    body = json.dumps({"return_token_ids": True, "nvext": NVEXT_IDS}).encode()
    result = await call(app, path, body)
    assert upstream.received == body and result.body == rec.body


async def test_get_and_non_json_bodies_pass_untouched(no_json_parse):
    rec = recording("chat_unary_ids")
    app, upstream = _app(rec, mode=Mode.NVEXT)
    body = b'{"return_token_ids": true}'
    result = await call(app, CHAT, body, headers=((b"content-type", b"text/plain"),))
    assert upstream.received == body and result.body == rec.body
    result = await call(app, CHAT, b"", method="GET")
    assert result.body == rec.body


async def test_invalid_json_reaches_vllm_unchanged():
    rec = recording("error_max_tokens")
    app, upstream = _app(rec, mode=Mode.NVEXT)
    body = b'{"nvext": {"extra_fields": ["completion_token_ids"]'
    result = await call(app, COMPLETIONS, body)
    assert upstream.received == body and result.status == 400 and result.body == rec.body


async def test_error_status_from_vllm_passes_through_in_every_mode():
    rec = recording("error_max_tokens")
    for mode in Mode:
        app, _ = _app(rec, mode=mode)
        result = await call(app, COMPLETIONS, _nvext_request(rec))
        assert (result.status, result.body) == (400, rec.body)


async def test_encoded_response_is_forwarded_untouched():
    rec = recording("chat_unary_ids")
    upstream = Upstream(body=rec.body, extra_headers=[(b"content-encoding", b"gzip")])
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    result = await call(app, rec.path, _nvext_request(rec))
    assert result.body == rec.body


# --- unary reshaping ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chat_unary_ids", "completions_unary_ids", "completions_unary_ids_token_prompt"])
async def test_unary_nvext_placement(name):
    rec = recording(name)
    raw = rec.json()
    app, upstream = _app(rec)
    result = await call(app, rec.path, _nvext_request(rec))
    sent = json.loads(upstream.received)
    assert sent["return_token_ids"] is True and "nvext" not in sent
    got = json.loads(result.body)
    _assert_length_header(result)
    choice = raw["choices"][0]
    prompt = raw["prompt_token_ids"] if rec.path.endswith("chat/completions") else choice["prompt_token_ids"]
    assert got["nvext"] == {"completion_token_ids": choice["token_ids"], "prompt_token_ids": prompt}
    # vLLM's copies were caused by the middleware: back to what vLLM writes without them
    assert got["choices"][0]["token_ids"] is None
    assert got.get("prompt_token_ids") is None and got["choices"][0].get("prompt_token_ids") is None
    expected = dict(raw, nvext=got["nvext"])
    expected["choices"] = [
        dict(choice, token_ids=None, **({"prompt_token_ids": None} if "prompt_token_ids" in choice else {}))
    ]
    if "prompt_token_ids" in raw:
        expected["prompt_token_ids"] = None
    assert got == expected


async def test_unary_both_placement_keeps_vllm_copies_and_adds_nvext():
    rec = recording("chat_unary_ids")
    raw = rec.json()
    app, _ = _app(rec)
    body = json.dumps({**rec.request, "nvext": NVEXT_IDS}).encode()
    got = json.loads((await call(app, rec.path, body)).body)
    assert got["choices"][0]["token_ids"] == raw["choices"][0]["token_ids"]
    assert got["prompt_token_ids"] == raw["prompt_token_ids"]
    assert got["nvext"]["completion_token_ids"] == raw["choices"][0]["token_ids"]


async def test_kv_transfer_params_move_under_nvext():
    rec = recording("completions_unary_ids")
    raw = rec.json()
    raw["kv_transfer_params"] = {"hidden_states_path": "/hs/req-1.safetensors"}
    upstream = Upstream(body=json.dumps(raw).encode())
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    got = json.loads((await call(app, rec.path, json.dumps(rec.request).encode())).body)
    assert got["nvext"]["kv_transfer_params"] == {"hidden_states_path": "/hs/req-1.safetensors"}
    assert got["kv_transfer_params"] is None
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.BOTH))
    got = json.loads((await call(app, rec.path, json.dumps(rec.request).encode())).body)
    assert got["kv_transfer_params"] == got["nvext"]["kv_transfer_params"]


async def test_mode_header_overrides_server_mode_and_can_be_disabled():
    rec = recording("chat_unary_ids")
    body = json.dumps(rec.request).encode()
    headers = (*JSON, (b"x-nvext-mode", b"nvext"))
    app, _ = _app(rec, mode=Mode.VLLM)
    assert "nvext" in json.loads((await call(app, rec.path, body, headers=headers)).body)
    app, _ = _app(rec, mode=Mode.VLLM, allow_mode_header=False)
    result = await call(app, rec.path, body, headers=headers)
    assert result.body == rec.body


async def test_invalid_mode_header_is_a_400_naming_it():
    rec = recording("chat_unary_ids")
    app, upstream = _app(rec)
    body = json.dumps({**rec.request, "return_token_ids": True}).encode()
    result = await call(app, rec.path, body, headers=(*JSON, (b"x-nvext-mode", b"dynamo")))
    assert result.status == 400 and upstream.calls == 0
    err = json.loads(result.body)["error"]
    assert err["param"] == "x-nvext-mode" and "dynamo" in err["message"] and err["code"] == 400
    _assert_length_header(result)


@pytest.mark.parametrize("request_cuts", [(500,), ()], ids=["in pieces", "whole"])
async def test_body_over_the_cap_is_a_413(request_cuts):
    rec = recording("chat_unary_ids")
    app, upstream = _app(rec, max_body_bytes=1000)
    body = json.dumps({"return_token_ids": True, "prompt": "x" * 2000}).encode()
    result = await call(app, rec.path, body, request_cuts=request_cuts)
    assert result.status == 413 and upstream.calls == 0
    assert "1000" in json.loads(result.body)["error"]["message"]
    at_the_cap = json.dumps({**rec.request, "return_token_ids": True}).encode()
    app, upstream = _app(rec, max_body_bytes=len(at_the_cap))
    assert (await call(app, rec.path, at_the_cap, request_cuts=request_cuts)).status == 200
    assert upstream.calls == 1
    app, upstream = _app(rec, max_body_bytes=len(at_the_cap) - 1)
    assert (await call(app, rec.path, at_the_cap, request_cuts=request_cuts)).status == 413
    assert upstream.calls == 0


async def test_n_greater_than_one_in_nvext_placement_is_refused_in_vllm_envelope():
    rec = recording("completions_unary_ids_n2")
    app, upstream = _app(rec)
    body = json.dumps({**rec.request, "return_token_ids": False, "nvext": NVEXT_IDS}).encode()
    result = await call(app, rec.path, body)
    assert result.status == 400 and upstream.calls == 0
    assert json.loads(result.body) == {
        "error": {
            "message": '`nvext.extra_fields=["completion_token_ids"]` requires exactly one generated choice',
            "type": "BadRequestError",
            "param": "n",
            "code": 400,
        }
    }


async def test_n_greater_than_one_in_vllm_placement_is_raw_vllm():
    rec = recording("completions_unary_ids_n2")
    app, _ = _app(rec, mode=Mode.VLLM)
    result = await call(app, rec.path, json.dumps(rec.request).encode())
    assert result.body == rec.body


# --- streaming ------------------------------------------------------------------------------


def _raw_stream_ids(rec: Recording) -> tuple[list[int] | None, list[int]]:
    prompt: list[int] | None = None
    ids: list[int] = []
    for event in rec.events():
        for choice in event["choices"]:
            ids += choice.get("token_ids") or []
            prompt = prompt or choice.get("prompt_token_ids")
        prompt = prompt or event.get("prompt_token_ids")
    return prompt, ids


@pytest.mark.parametrize("name", ["chat_stream_ids", "completions_stream_ids", "chat_stream_ids_long"])
async def test_stream_nvext_placement(name):
    rec = recording(name)
    app, _ = _app(rec, cuts=(1, 50, 51, 400))
    result = await call(app, rec.path, _nvext_request(rec))
    raw_events, got = rec.events(), sse_events(result.body)
    assert len(got) == len(raw_events)
    assert result.body.endswith(b"data: [DONE]\n\n")
    prompt, ids = _raw_stream_ids(rec)
    concatenated = []
    for raw_event, event in zip(raw_events, got, strict=True):
        if not raw_event["choices"]:
            assert "nvext" not in event and event == raw_event, "the usage-only chunk never carries nvext"
            continue
        raw_choice, choice = raw_event["choices"][0], event["choices"][0]
        assert event["nvext"]["completion_token_ids"] == (raw_choice.get("token_ids") or [])
        concatenated += event["nvext"]["completion_token_ids"]
        if raw_choice["finish_reason"] is not None:
            assert event["nvext"]["prompt_token_ids"] == prompt
        else:
            assert "prompt_token_ids" not in event["nvext"]
        assert choice.get("token_ids") is None and event.get("prompt_token_ids") is None
        assert (
            choice["delta" if "delta" in choice else "text"] == raw_choice["delta" if "delta" in raw_choice else "text"]
        )
    assert concatenated == ids


async def test_stream_in_vllm_placement_is_exactly_what_vllm_sent():
    rec = recording("chat_stream_ids")
    app, _ = _app(rec, cuts=(5,), mode=Mode.VLLM)
    result = await call(app, rec.path, _nvext_request(rec))
    assert result.body == rec.body


async def test_stream_headers_have_no_content_length():
    rec = recording("chat_stream_ids")
    app, _ = _app(rec)
    result = await call(app, rec.path, _nvext_request(rec))
    assert result.header(b"content-length") is None
    assert result.header(b"content-type").startswith(b"text/event-stream")


async def test_echo_prompt_ids_vllm_sends_anyway_are_kept():
    rec = recording("completions_stream_echo")
    app, _ = _app(rec, mode=Mode.NVEXT)
    result = await call(app, rec.path, json.dumps({**rec.request, "return_token_ids": True}).encode())
    raw_first, got_first = rec.events()[0]["choices"][0], sse_events(result.body)[0]["choices"][0]
    assert got_first.get("prompt_token_ids") == raw_first.get("prompt_token_ids")


async def test_each_event_is_forwarded_in_the_message_that_completes_it():
    rec = recording("completions_stream_ids")
    ends = [i + 2 for i in range(len(rec.body)) if rec.body[i : i + 2] == b"\n\n"]
    app, _ = _app(rec, cuts=ends)
    result = await call(app, rec.path, _nvext_request(rec))
    assert len([m for m in result.body_messages if m]) == len(ends)
    assert all(m.endswith(b"\n\n") for m in result.body_messages if m)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    name=st.sampled_from(["chat_stream_ids", "completions_stream_ids", "chat_stream_ids_logprobs"]),
    mode=st.sampled_from([Mode.NVEXT, Mode.BOTH]),
    data=st.data(),
)
async def test_any_split_of_a_recorded_stream_gives_the_same_bytes(name, mode, data):
    rec = recording(name)
    cuts = data.draw(st.lists(st.integers(0, len(rec.body)), max_size=25))
    request = json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids", "engine_data"]}}).encode()
    whole_app, _ = _app(rec, mode=mode)
    split_app, _ = _app(rec, cuts=cuts, mode=mode)
    whole = await call(whole_app, rec.path, request)
    split = await call(split_app, rec.path, request)
    assert split.body == whole.body


async def test_mid_stream_error_reaches_the_client_without_nvext():
    rec = recording("chat_stream_ids")
    blocks = rec.body.split(b"\n\n")
    error = b'data: {"error": {"message": "engine died", "type": "InternalServerError", "param": null, "code": 500}}'
    body = b"\n\n".join([*blocks[:3], error, b"data: [DONE]", b""])
    upstream = Upstream(content_type=rec.content_type, body=body)
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    request = json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids", "engine_data"]}}).encode()
    body = (await call(app, rec.path, request)).body
    got = sse_events(body)
    assert got[-1]["error"]["message"] == "engine died"
    assert error + b"\n\n" in body, "the error event passes as vLLM sent it, with no nvext (as Dynamo sends it)"
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    plain = await call(app, rec.path, _nvext_request(rec))
    assert error + b"\n\n" in plain.body, "without engine_data the error event is forwarded untouched"


@pytest.mark.parametrize("status", [204, 206, 304])
async def test_bodiless_and_partial_statuses_pass_through(status):
    upstream = Upstream(status=status, body=b"")
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    result = await call(app, COMPLETIONS, b'{"return_token_ids": true}')
    assert result.status == status and result.body == b""


async def test_head_request_is_not_touched(no_json_parse):
    rec = recording("chat_unary_ids")
    app, upstream = _app(rec, mode=Mode.NVEXT)
    result = await call(app, rec.path, b"", method="HEAD")
    assert upstream.calls == 1 and result.body == rec.body


async def test_memoryview_bodies_are_read_as_bytes():
    rec = recording("chat_unary_ids")
    app, upstream = _app(rec)
    body = _nvext_request(rec)
    pending = [{"type": "http.request", "body": memoryview(body), "more_body": False}]
    sent: list[dict] = []

    async def receive():
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": rec.path, "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    assert json.loads(upstream.received)["return_token_ids"] is True
    assert "nvext" in json.loads(sent[-1]["body"])


@pytest.mark.parametrize("request_cuts", [(), (5,)], ids=["whole", "in pieces"])
async def test_timing_says_when_the_request_came_before_its_body(request_cuts, monkeypatch):
    """`request_received_ms` is the middleware's reading before the body, though the clock is only
    built once vLLM's answer is to be reshaped (docs/protocol.md §3.3)."""
    import time

    from vllm_nvext import middleware

    rec = recording("chat_unary_ids")
    app, _ = _app(rec)
    body = json.dumps({**json.loads(_nvext_request(rec)), "nvext": {"extra_fields": ["timing"]}}).encode()
    pending = [{"type": "http.request", "body": body[: request_cuts[0]], "more_body": True}] if request_cuts else []
    pending.append({"type": "http.request", "body": body[request_cuts[0] if request_cuts else 0 :], "more_body": False})
    received: list[dict] = []
    sent: list[dict] = []

    async def receive():
        received.append(pending.pop(0) if pending else {"type": "http.disconnect"})
        return received[-1]

    async def send(message):
        sent.append(message)

    clock = type("Clock", (), {"time": lambda: 2000.0 if received else 1000.0, "perf_counter": time.perf_counter})
    monkeypatch.setattr(middleware, "time", clock)
    scope = {"type": "http", "method": "POST", "path": rec.path, "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    timing = json.loads(sent[-1]["body"])["nvext"]["timing"]
    assert timing["request_received_ms"] == 1_000_000, "read before the body came"
    assert 0 <= timing["total_time_ms"] < 60_000


async def test_both_mounts_translate_once():
    rec = recording("chat_unary_ids")
    upstream = Upstream(body=rec.body)
    inner = NvextMiddleware(upstream, settings=Settings(mode=Mode.NVEXT))
    outer = NvextMiddleware(inner, settings=Settings(mode=Mode.NVEXT))
    got = json.loads((await call(outer, rec.path, _nvext_request(rec))).body)
    raw = rec.json()
    assert got["nvext"]["completion_token_ids"] == raw["choices"][0]["token_ids"]
    assert got["choices"][0]["token_ids"] is None


async def test_root_path_prefix_is_understood():
    rec = recording("chat_unary_ids")
    app, upstream = _app(rec)
    scope_path = "/api" + rec.path
    result = await call(app, scope_path, _nvext_request(rec), root_path="/api")
    assert "nvext" in json.loads(result.body) and "nvext" not in json.loads(upstream.received)


@pytest.mark.parametrize("dialect", ["vllm", "nvext", "both"])
@pytest.mark.parametrize("mode", list(Mode))
async def test_mid_stream_error_event_is_forwarded_unchanged_in_every_mode(mode, dialect):
    rec = recording("completions_stream_ids")
    blocks = rec.body.split(b"\n\n")
    error = b'data: {"error":{"message":"engine died","type":"InternalServerError","param":null,"code":500}}'
    body = b"\n\n".join([*blocks[:2], error, b"data: [DONE]", b""])
    upstream = Upstream(content_type=rec.content_type, body=body, cuts=(len(body) - 30,))
    app = NvextMiddleware(upstream, settings=Settings(mode=mode))
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    if dialect != "nvext":
        request["return_token_ids"] = True
    if dialect != "vllm":
        request["nvext"] = NVEXT_IDS
    result = await call(app, rec.path, json.dumps(request).encode())
    assert result.status == 200
    assert result.body.endswith(error + b"\n\ndata: [DONE]\n\n")


def _fastapi_reads_untyped_body_as_json() -> bool:
    """Ask the installed FastAPI itself, the way vLLM's routes declare their body."""
    import httpx
    import pydantic
    from fastapi import FastAPI

    class Body(pydantic.BaseModel):
        n: int

    async def post(body):
        return {"n": body.n}

    post.__annotations__ = {"body": Body}  # a local class: the string annotation would not resolve
    app = FastAPI()
    app.post("/p")(post)

    async def go() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            resp = await client.post("/p", content=b'{"n": 1}', headers={"content-type": ""})
            return resp.status_code

    import asyncio

    return asyncio.run(go()) == 200


def test_the_probe_for_bodies_without_content_type_agrees_with_fastapi():
    from vllm_nvext import _vllm_compat

    pytest.importorskip("fastapi")
    assert _vllm_compat.untyped_body_is_json() == _fastapi_reads_untyped_body_as_json()


@pytest.mark.parametrize("as_json", [False, True])
async def test_a_body_without_content_type_is_read_as_vllms_fastapi_reads_it(as_json, monkeypatch):
    from vllm_nvext import _vllm_compat

    monkeypatch.setattr(_vllm_compat, "untyped_body_is_json", lambda: as_json)
    rec = recording("completions_unary_ids")
    app, upstream = _app(rec, mode=Mode.AUTO)
    body = _nvext_request(rec)
    result = await call(app, rec.path, body, headers=())
    assert result.status == 200
    # Read as JSON by vLLM: translated (nvext answered); otherwise vLLM never sees the fields: untouched.
    assert ("nvext" in json.loads(result.body)) is as_json
    assert (upstream.received == body) is not as_json


# --- one Content-Type rule, request and response side: FastAPI's, on the first header ----------

CONTENT_TYPES = [
    "application/json",
    "Application/JSON; charset=utf-8",
    " application/json ;",
    "application/problem+json",
    "application/vnd.api+json",
    "application/json-seq",
    "application/jsonx",
    "application/x-ndjson",
    "text/json",
    "text/plain",
    "json",
    "",
]


def _fastapi_reads_as_json(content_type: str) -> bool:
    """Ask the installed FastAPI whether a route with a body model reads this Content-Type as JSON."""
    import asyncio

    import httpx
    import pydantic
    from fastapi import FastAPI

    class Body(pydantic.BaseModel):
        n: int

    async def post(body):
        return {"n": body.n}

    post.__annotations__ = {"body": Body}  # a local class: the string annotation would not resolve
    app = FastAPI()
    app.post("/p")(post)

    async def go() -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            resp = await client.post("/p", content=b'{"n": 1}', headers={"content-type": content_type})
            return resp.status_code

    return asyncio.run(go()) == 200


@pytest.mark.parametrize("content_type", [c for c in CONTENT_TYPES if c])
def test_a_content_type_is_json_exactly_when_fastapi_reads_it_as_json(content_type):
    from vllm_nvext.asgi import is_json

    pytest.importorskip("fastapi")
    assert is_json(content_type.encode()) is _fastapi_reads_as_json(content_type)


@pytest.mark.parametrize("content_type", CONTENT_TYPES)
async def test_a_response_is_reshaped_as_json_by_the_request_sides_rule(content_type):
    from vllm_nvext.asgi import is_json

    rec = recording("chat_unary_ids")
    upstream = Upstream(content_type=content_type, body=rec.body)
    result = await call(NvextMiddleware(upstream), rec.path, _nvext_request(rec))
    reshaped = "nvext" in json.loads(result.body)
    assert reshaped is (bool(content_type) and is_json(content_type.encode())), "application/json-seq is not JSON"


@pytest.mark.parametrize(("first", "second"), [("text/plain", "application/json"), ("application/json", "text/plain")])
async def test_of_repeated_response_content_types_the_first_counts_as_on_the_request_side(first, second):
    rec = recording("chat_unary_ids")
    upstream = Upstream(content_type=first, body=rec.body, extra_headers=[(b"content-type", second.encode())])
    result = await call(NvextMiddleware(upstream), rec.path, _nvext_request(rec))
    assert ("nvext" in json.loads(result.body)) is (first == "application/json")


async def test_a_stream_is_reshaped_whatever_the_parameters_of_its_event_stream_type():
    rec = recording("chat_stream_ids")
    for content_type in ("text/event-stream", "Text/Event-Stream; charset=utf-8"):
        upstream = Upstream(content_type=content_type, body=rec.body)
        result = await call(NvextMiddleware(upstream), rec.path, _nvext_request(rec))
        assert b'"nvext"' in result.body, content_type

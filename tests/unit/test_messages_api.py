"""/v1/messages served with ids by the plugin mount (docs/protocol.md §11.2).

vLLM 0.32's own Anthropic handler (`AnthropicServingMessages`: the conversion to chat and the
Anthropic answer) runs here over chat answers recorded from vLLM 0.32 (scripts/record_fixtures.py):
only the engine behind its chat serving is replaced by the recording.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit import asgi
from tests.unit.asgi import Upstream
from vllm_nvext import Mode, NvextMiddleware, Settings
from vllm_nvext.agent.messages import PLUGIN_STATE, CapturedIds, _handler_copy, place_ids_in_event

serving = pytest.importorskip("vllm.entrypoints.anthropic.serving")
chat_protocol = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHAT_UNARY = FIXTURES / "agent-apis" / "chat_unary_ids_same_conversation.json"
CHAT_STREAM = FIXTURES / "chat_stream_ids.sse"  # the same conversation, streamed with usage
REQUEST = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me about token ids."}], "max_tokens": 8}
NVEXT_IDS = {"nvext": {"extra_fields": ["completion_token_ids"]}}


async def call(app: Any, path: str, body: bytes, **kwargs: Any) -> asgi.Result:
    """tests.unit.asgi.call, with a client that stays connected until the answer is complete."""
    done = asyncio.Event()

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def connected() -> Any:
            message = await receive()
            if message["type"] == "http.disconnect":
                await done.wait()
            return message

        async def sending(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        await app(scope, connected, sending)

    return await asgi.call(wrapped, path, body, **kwargs)


class _App:
    """vLLM's app as the plugin mount sees it: its state holds the Anthropic handler; routes are `upstream`."""

    def __init__(self, handler: Any, upstream: Upstream, plugin: bool = True) -> None:
        self.state = SimpleNamespace(anthropic_serving_messages=handler, **{PLUGIN_STATE: plugin})
        self.upstream = upstream
        self.inner = NvextMiddleware(upstream, settings=Settings(), serve_messages=True)
        self.outer = NvextMiddleware(self.inner, settings=Settings())  # a --middleware mount too

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope["app"] = self
        await self.outer(scope, receive, send)


def _handler(stream_error: bool = False) -> tuple[Any, list[Any]]:
    """vLLM's Anthropic handler whose chat serving answers from the recordings."""
    handler = object.__new__(serving.AnthropicServingMessages)
    handler._merge_inline_system = False
    handler._disabled_thinking_effort = "none"
    seen: list[Any] = []

    async def create_chat_completion(request: Any, raw_request: Any = None) -> Any:
        seen.append(request)
        if not request.stream:
            return chat_protocol.ChatCompletionResponse.model_validate_json(CHAT_UNARY.read_bytes())

        async def events() -> AsyncIterator[str]:
            for block in CHAT_STREAM.read_bytes().decode().split("\n\n")[:-1]:
                yield block + "\n\n"

        return events()

    handler.create_chat_completion = create_chat_completion
    return handler, seen


def _chat_ids() -> tuple[list[int], list[int]]:
    chat = json.loads(CHAT_UNARY.read_bytes())
    return chat["choices"][0]["token_ids"], chat["prompt_token_ids"]


def _stream_ids() -> tuple[list[int], list[int]]:
    events = [json.loads(b[6:]) for b in CHAT_STREAM.read_bytes().split(b"\n\n")[:-1] if b != b"data: [DONE]"]
    ids = [i for e in events for c in e["choices"] for i in (c.get("token_ids") or [])]
    return ids, events[0]["prompt_token_ids"]


def _events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for block in body.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        out.append(event)
    return out


@pytest.mark.parametrize("extra", [NVEXT_IDS, {"return_token_ids": True}])
async def test_unary_ids_through_vllms_own_anthropic_handler(extra):
    handler, seen = _handler()
    app = _App(handler, Upstream())
    result = await call(app, "/v1/messages", json.dumps({**REQUEST, **extra}).encode())
    assert result.status == 200 and app.upstream.calls == 0
    assert seen[0].return_token_ids is True  # vLLM's chat request, with the ids asked for
    message = json.loads(result.body)
    completion, prompt = _chat_ids()
    if "nvext" in extra:
        assert message["nvext"] == {"completion_token_ids": completion, "prompt_token_ids": prompt}
        assert "token_ids" not in message
    else:
        assert message["token_ids"] == completion and message["prompt_token_ids"] == prompt
        assert "nvext" not in message
    stock = handler.messages_full_converter(
        chat_protocol.ChatCompletionResponse.model_validate_json(CHAT_UNARY.read_bytes())
    )
    stock_json = stock.model_dump(exclude_none=True)
    assert {k: v for k, v in message.items() if k not in {"nvext", "token_ids", "prompt_token_ids"}} == stock_json


async def test_stream_ids_on_message_delta_and_prompt_ids_on_message_start():
    handler, _ = _handler()
    app = _App(handler, Upstream())
    completion, prompt = _stream_ids()
    result = await call(app, "/v1/messages", json.dumps({**REQUEST, "stream": True, **NVEXT_IDS}).encode())
    events = _events(result.body)
    deltas = [e for e in events if e["type"] == "message_delta"]
    assert [d["nvext"] for d in deltas] == [{"completion_token_ids": completion, "prompt_token_ids": prompt}]
    assert not any("nvext" in e for e in events if e["type"] != "message_delta")
    assert events[-1]["type"] == "message_stop"
    both = await call(
        app,
        "/v1/messages",
        json.dumps({**REQUEST, "stream": True, **NVEXT_IDS, "return_token_ids": True}).encode(),
        headers=((b"content-type", b"application/json"), (b"x-nvext-mode", b"both")),
    )
    events = _events(both.body)
    start = next(e for e in events if e["type"] == "message_start")
    delta = next(e for e in events if e["type"] == "message_delta")
    assert start["message"]["prompt_token_ids"] == prompt and delta["token_ids"] == completion
    assert delta["nvext"]["completion_token_ids"] == completion


class _RawStreamHandler:
    """vLLM 0.33's shape: its chat serving reads the raw chat chunks (objects) through `self` and
    turns them into Anthropic events itself, so no chat event string is ever written."""

    def to_chat_completion_request(self, request: Any) -> Any:
        return SimpleNamespace(stream=True, return_token_ids=False)

    async def create_chat_completion(self, request: Any, raw_request: Any = None) -> Any:
        async def converted() -> AsyncIterator[str]:
            async for chunk in self.chat_completion_stream_generator_raw():
                yield f"event: anthropic\ndata: {len(chunk.choices)}\n\n"

        return converted()

    async def chat_completion_stream_generator_raw(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        for block in CHAT_STREAM.read_bytes().decode().split("\n\n")[:-1]:
            if block != "data: [DONE]":
                yield chat_protocol.ChatCompletionStreamResponse.model_validate_json(block[6:])


async def test_stream_ids_where_vllm_converts_the_raw_chat_chunks_itself():
    handler = _RawStreamHandler()
    ids = CapturedIds()
    proxy = _handler_copy(handler, ids)
    request = proxy.to_chat_completion_request(REQUEST)
    assert request.return_token_ids is True
    events = [event async for event in await proxy.create_chat_completion(request)]
    assert events and all(e.startswith("event: anthropic") for e in events)
    assert (ids.completion, ids.prompt) == _stream_ids()
    # the shared handler is untouched: a request without ids reads no chunk
    assert not vars(handler)
    again = CapturedIds()
    [event async for event in await _handler_copy(handler, again).create_chat_completion(request)]
    assert (again.completion, again.prompt) == _stream_ids()


def test_captured_ids_from_raw_chunks_skip_errors_and_keep_withheld_ids_null():
    ids = CapturedIds()
    ids.add_chunk_object(SimpleNamespace(error="no choices"))  # vLLM's ErrorResponse has none
    chunk = chat_protocol.ChatCompletionStreamResponse.model_validate(
        {"model": "tiny", "choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": None}]}
    )
    ids.add_chunk_object(chunk)
    assert ids.completion is None and ids.prompt is None


async def test_invalid_bodies_get_vllms_own_answer_and_a_vllm_without_the_handler_a_400():
    handler, seen = _handler()
    upstream = Upstream(status=400, body=b'{"error": "vLLM says"}')
    app = _App(handler, upstream)
    result = await call(app, "/v1/messages", json.dumps({"model": "tiny", "messages": 3, **NVEXT_IDS}).encode())
    assert result.body == b'{"error": "vLLM says"}' and not seen
    assert json.loads(upstream.received or b"") == {"model": "tiny", "messages": 3}
    app = _App(None, Upstream())
    result = await call(app, "/v1/messages", json.dumps({**REQUEST, **NVEXT_IDS}).encode())
    assert result.status == 400 and "endpoint plugin" in json.loads(result.body)["error"]["message"]


def _vllm_app(handler: Any, plugin: bool) -> Any:
    """vLLM's own /v1/messages route and exception handlers on a FastAPI app, the plugin mounted as vLLM mounts it."""
    from fastapi import FastAPI
    from vllm.entrypoints.anthropic.api_router import router
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    from vllm_nvext.plugin import NvextPlugin

    app = FastAPI()
    app.include_router(router)
    init_exception_handler(app)
    app.state.anthropic_serving_messages = handler
    app.state.args = SimpleNamespace(log_error_stack=False)
    if plugin:
        NvextPlugin().attach_router(app)
    return app


@pytest.mark.parametrize("extra", [NVEXT_IDS, {"return_token_ids": True}, {**NVEXT_IDS, "return_token_ids": True}])
async def test_an_invalid_body_is_validated_once_and_gets_stock_vllms_own_400(monkeypatch, extra):
    """vLLM's model validation runs once per request, as on stock vLLM's own route (its before-validator
    counts the runs), and the 400 is stock's byte for byte: its errors count the body's keys as sent."""
    anthropic = pytest.importorskip("vllm.entrypoints.anthropic.protocol")
    real = anthropic.resolve_return_mm_kwargs_alias
    runs: list[int] = []

    def counted(data: Any) -> Any:
        runs.append(1)
        return real(data)

    monkeypatch.setattr(anthropic, "resolve_return_mm_kwargs_alias", counted)
    body = json.dumps({"model": "tiny", "messages": [{"role": "user"}] * 3, **extra}).encode()
    handler, seen = _handler()
    stock = await call(_vllm_app(handler, plugin=False), "/v1/messages", body)
    assert stock.status == 400 and len(runs) == 1, "stock vLLM validates once"
    runs.clear()
    served = await call(_vllm_app(handler, plugin=True), "/v1/messages", body)
    assert (served.status, served.body) == (stock.status, stock.body)
    assert len(runs) == 1, "the plugin mount validates once, not once more for vLLM's own route"
    assert "dict of " + str(2 + len(extra)) + " items" in json.loads(served.body)["error"]["message"]
    assert not seen


async def test_errors_of_vllms_handler_come_back_in_its_anthropic_envelope():
    handler, _ = _handler()

    async def failing(request: Any, raw_request: Any = None) -> Any:
        raise ValueError("bad request inside vLLM")

    handler.create_chat_completion = failing
    result = await call(_App(handler, Upstream()), "/v1/messages", json.dumps({**REQUEST, **NVEXT_IDS}).encode())
    body = json.loads(result.body)
    assert result.status == 400 and body["type"] == "error" and "nvext" not in body


async def test_without_the_plugin_the_middleware_mount_refuses():
    handler, seen = _handler()
    app = _App(handler, Upstream(), plugin=False)
    app.outer = NvextMiddleware(app.upstream, settings=Settings(mode=Mode.AUTO))
    result = await call(app, "/v1/messages", json.dumps({**REQUEST, **NVEXT_IDS}).encode())
    assert result.status == 400 and not seen and app.upstream.calls == 0


def test_ids_vllm_withholds_stay_null_and_odd_events_pass():
    ids = CapturedIds()
    ids.add_chunk('data: {"choices":[{"token_ids":[1]}],"prompt_token_ids":[7]}\n\n')
    ids.add_chunk('data: {"choices":[{"token_ids":null}]}\n\n')
    ids.add_chunk('data: {"choices":[{"token_ids":[2]}]}\n\n')
    ids.add_chunk("data: [DONE]\n\n")
    ids.add_chunk("data: {not json\n\n")
    ids.add_chunk("data: [1]\n\n")
    assert ids.completion is None and ids.prompt == [7]
    for event in ("event: message_delta\ndata: [1]\n\n", "event: message_delta\ndata: {\n\n"):
        assert place_ids_in_event(event, ids, True, True, False) == event
    start = 'event: message_start\ndata: {"message": 1}\n\n'
    assert place_ids_in_event(start, ids, True, False, False) == start


def test_the_plugin_mount_serves_messages_and_says_so_on_vllms_app():
    from starlette.applications import Starlette

    from vllm_nvext.plugin import NvextPlugin

    app = Starlette()
    NvextPlugin().attach_router(app)
    assert getattr(app.state, PLUGIN_STATE) is True  # a --middleware mount outside leaves the route to it
    assert [m.kwargs.get("serve_messages") for m in app.user_middleware] == [True]


async def test_a_client_that_goes_away_cancels_the_work():
    handler, _ = _handler()
    cancelled = asyncio.Event()

    async def forever(request: Any, raw_request: Any = None) -> Any:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    handler.create_chat_completion = forever
    body = json.dumps({**REQUEST, **NVEXT_IDS}).encode()
    incoming = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/messages", "root_path": "", "query_string": b""}
    scope["headers"] = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await _App(handler, Upstream())(scope, receive, send)
    await asyncio.wait_for(cancelled.wait(), 5)
    assert sent == []  # nothing answers a client that is gone

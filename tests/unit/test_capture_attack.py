"""Capture seen from the client's side where it meets an upstream or a history it cannot serve with ids: the
client's answer is the one it gets without capture (docs/capture.md, "What the client sees")."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from tests.unit.test_proxy import RESPONSES_BODY, _stop_what_started, call, proxy_over  # noqa: F401 (a fixture)
from vllm_nvext import Settings


def _vllm_rs_034(seen: list[dict[str, Any]]) -> Any:
    """vLLM 0.34's Rust frontend as docs/scaling-out.md saw it: /v1/responses refuses enable_response_messages."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def version(request: Request) -> JSONResponse:
        return JSONResponse({"version": "0.34.0", "rust_frontend_version": "0.34.0"})

    async def responses(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        if "enable_response_messages" in body:
            error = {"message": "enable_response_messages is not supported by this frontend.", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        return JSONResponse({"id": "resp_1", "object": "response", "status": "completed", "output": []})

    return Starlette(routes=[Route("/version", version), Route("/v1/responses", responses, methods=["POST"])])


async def test_a_captured_responses_request_through_the_proxy_to_vllm_rs_is_answered_as_without_capture(tmp_path):
    """vllm-rs refuses `enable_response_messages`, where vLLM puts the ids capture needs: capture turning it on
    for a client that asked nothing made the client's 200 a 400."""
    answers = []
    for capture in (None, f"sqlite:///{tmp_path / 'capture.sqlite3'}"):
        seen: list[dict[str, Any]] = []
        app = await proxy_over(_vllm_rs_034(seen), settings=Settings(capture=capture))
        await app.forwarder._read_version()
        result = await call(app, "/v1/responses", json.dumps(RESPONSES_BODY).encode())
        assert seen == [RESPONSES_BODY], "the request reaches vllm-rs as the client sent it"
        answers.append((result.status, json.loads(result.body)))
    assert answers[0][0] == 200 and answers[1] == answers[0]


class _Gone(Exception):
    """What a server's `send` raises once the client went away."""


async def _cut_short(app: Any, path: str, request: dict[str, Any], events_sent: int) -> int:
    """`request` through `app`, the client gone after `events_sent` whole events: how many it got."""
    body = json.dumps(request).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "root_path": "", "raw_path": path.encode(), "query_string": b"", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 8000), "headers": [(b"content-type", b"application/json"),
             (b"content-length", str(len(body)).encode()), (b"x-nvext-session-id", b"cut-1")]}  # fmt: skip
    got = b""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return pending.pop() if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal got
        if message["type"] == "http.response.body":
            if got.count(b"\n\n") >= events_sent:
                raise _Gone
            got += message.get("body", b"")

    with contextlib.suppress(_Gone):
        await app(scope, receive, send)
    return got.count(b"\n\n")


async def test_a_stream_the_client_cut_short_is_a_turn_on_chat_and_none_on_responses(tmp_path):
    """docs/capture.md: a chat stream cut short is recorded as far as it went (no finish reason); a /v1/responses
    stream reports its ids in its last event alone, so one cut short is no turn."""
    from tests.recorded import recording
    from tests.unit.asgi import Upstream
    from tests.unit.test_responses_api import _rec
    from vllm_nvext import NvextMiddleware
    from vllm_nvext.capture.store import Sink

    rec = recording("chat_stream_ids")
    chat = NvextMiddleware(Upstream(content_type=rec.content_type, body=rec.body, cuts=range(1, len(rec.body), 97)),
                           capture=f"sqlite:///{tmp_path / 'chat.sqlite3'}")  # fmt: skip
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    assert await _cut_short(chat, rec.path, request, 3) == 3
    sink: Sink | None = chat.sink
    assert sink is not None and sink.flush()
    (turn,) = sink.read("cut-1") or []
    every = [i for e in rec.events() for c in e["choices"] for i in c.get("token_ids") or []]
    got = [i for e in rec.events()[:3] for c in e["choices"] for i in c.get("token_ids") or []]
    ids = turn["completion_token_ids"]
    assert got == ids[: len(got)] and ids == every[: len(ids)] and len(ids) < len(every), "as far as vLLM sent it"
    assert turn["finish_reason"] is None
    sink.close()

    request, body, content_type = _rec("responses_stream_messages")
    responses = NvextMiddleware(Upstream(content_type=content_type, body=body, cuts=range(1, len(body), 97)),
                                capture=f"sqlite:///{tmp_path / 'responses.sqlite3'}")  # fmt: skip
    plain = {k: v for k, v in request.items() if k != "enable_response_messages"}
    assert await _cut_short(responses, "/v1/responses", plain, 3) == 3
    sink = responses.sink
    assert sink is not None and sink.flush()
    assert sink.read("cut-1") is None
    sink.close()


def test_an_atif_step_of_a_responses_turn_has_its_token_counts():
    """docs/capture.md: each step's metrics carry `prompt_tokens`, `completion_tokens`, `cached_tokens`; a
    /v1/responses turn's usage names them `input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`."""
    import jsonschema

    from tests.support.capture import make_turn
    from tests.unit.test_capture_api import SCHEMA
    from vllm_nvext.capture.atif import trajectory

    usage = {"input_tokens": 43, "input_tokens_details": {"cached_tokens": 16}, "output_tokens": 8, "total_tokens": 51}
    turn = make_turn("codex-1", [1] * 43, [2] * 8, route="/v1/responses", request_id="resp_1", usage=usage)
    doc = trajectory("codex-1", [turn.to_json()])
    jsonschema.validate(doc, SCHEMA)
    metrics = doc["steps"][0]["metrics"]
    assert (metrics["prompt_tokens"], metrics["completion_tokens"], metrics["cached_tokens"]) == (43, 8, 16)
    assert doc["final_metrics"] == {
        "total_steps": 1,
        "total_prompt_tokens": 43,
        "total_completion_tokens": 8,
        "total_cached_tokens": 16,
    }


def _completions_batch(stream: bool) -> bytes:
    """vLLM's answer to a /v1/completions request with two prompts and `return_token_ids` (each choice carries its
    prompt's ids: vLLM's CompletionResponseChoice / its stream chunks), choice i answering prompt i."""
    choices = [(0, [1, 2], [5, 7]), (1, [3, 4], [6, 8])]
    if not stream:
        body = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
                "choices": [{"index": i, "text": "xy", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                             "token_ids": out, "prompt_token_ids": p, "prompt_logprobs": None}
                            for i, p, out in choices],
                "usage": {"prompt_tokens": 4, "total_tokens": 8, "completion_tokens": 4}}  # fmt: skip
        return json.dumps(body).encode()
    events = []
    for i, p, out in choices:
        for k, token in enumerate(out):
            first = {"prompt_token_ids": p} if k == 0 else {}
            choice = {"index": i, "text": "x", "logprobs": None, "finish_reason": "length" if k else None,
                      "stop_reason": None, "token_ids": [token], **first}  # fmt: skip
            events.append({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny",
                           "choices": [choice]})  # fmt: skip
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
async def test_a_completions_batch_of_prompts_records_each_prompt_with_its_own_completion(stream, tmp_path):
    """Choice 1 answers prompt 1, not prompt 0: it is no other choice of prompt 0's turn but a turn of its own
    (a trainer pairs each turn's prompt with its completions)."""
    from tests.unit.asgi import Upstream
    from tests.unit.asgi import call as asgi_call
    from vllm_nvext import NvextMiddleware

    content_type = "text/event-stream" if stream else "application/json"
    upstream = Upstream(content_type=content_type, body=_completions_batch(stream))
    app = NvextMiddleware(upstream, capture=f"sqlite:///{tmp_path / 'c.sqlite3'}")
    request = {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2, "stream": stream}
    headers = ((b"content-type", b"application/json"), (b"x-nvext-session-id", b"batch-1"))
    result = await asgi_call(app, "/v1/completions", json.dumps(request).encode(), headers=headers)
    assert result.status == 200
    assert app.sink is not None and app.sink.flush()
    turns = app.sink.read("batch-1") or []
    app.sink.close()
    pairs = [(t["prompt_token_ids"], t["completion_token_ids"], t["choices"]) for t in turns]
    assert pairs == [([1, 2], [5, 7], None), ([3, 4], [6, 8], None)]
    assert {t["request_id"] for t in turns} == {"cmpl-1"}

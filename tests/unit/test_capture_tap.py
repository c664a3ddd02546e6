"""The capture tap (docs/capture.md): with capture on, a client that asked for nothing gets vLLM's answer
as stock vLLM gives it, and the recorded turn holds the ids vLLM reported, on both stream paths.

Over vLLM 0.32's recorded answers: the recording with ids is what vLLM answers the middleware (which turned
them on); the client must get it with vLLM's copies back to null, exactly what vLLM writes without them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import sse_events
from tests.recorded import recording
from tests.unit.asgi import Upstream, call
from tests.unit.test_responses_api import _events, _rec
from vllm_nvext import NvextMiddleware
from vllm_nvext.capture.keys import header_key, session_key
from vllm_nvext.capture.record import Turn

JSON = (b"content-type", b"application/json")
ID_CASES = ["chat_stream_ids", "chat_stream_ids_logprobs", "chat_stream_ids_long", "completions_stream_ids",
            "completions_stream_ids_logprobs", "completions_stream_ids_n2", "chat_unary_ids",
            "chat_unary_ids_logprobs"]  # fmt: skip


def _turns(app: NvextMiddleware) -> list[Turn]:
    """Every turn the middleware's store holds, read back through the store (SQLite)."""
    sink = app.sink
    assert sink is not None and sink.flush()
    sessions = sorted(sink.backend.sessions(None))
    turns = [Turn.from_json(t) for s in sessions for t in sink.read(s) or []]
    sink.close()
    return turns


def _app(upstream: Upstream, tmp_path: Path, **kw: Any) -> NvextMiddleware:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return NvextMiddleware(upstream, capture=f"sqlite:///{tmp_path}/capture.sqlite3", **kw)


def _without_ids(obj: Any) -> Any:
    """`obj` with every id key vLLM writes under `return_token_ids` set to null (what it writes without)."""
    if isinstance(obj, dict):
        return {k: None if k in ("token_ids", "prompt_token_ids") else _without_ids(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_without_ids(v) for v in obj]
    return obj


async def _captured(
    name: str, pure: bool, tmp_path: Path, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> tuple[Any, Any, Turn]:
    rec = recording(name)
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}  # the client asks for nothing
    upstream = Upstream(content_type=rec.content_type, body=rec.body, cuts=(7, 200))
    app = _app(upstream, tmp_path / ("py" if pure else "c"), pure_python=pure)
    result = await call(app, rec.path, json.dumps(request).encode(), headers=(JSON, *headers))
    assert json.loads(upstream.received or b"")["return_token_ids"] is True, "capture turns ids on upstream"
    (turn,) = _turns(app)
    return rec, result, turn


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
@pytest.mark.parametrize("name", ID_CASES)
async def test_a_captured_client_gets_stock_vllms_answer_and_the_turn_has_vllms_ids(name, pure, tmp_path):
    rec, result, turn = await _captured(name, pure, tmp_path, ((b"x-nvext-session-id", b"sess-1"),))
    assert result.status == 200
    if rec.stream:
        sent = rec.events()
        assert sse_events(result.body) == [_without_ids(e) for e in sent]
        completion = [i for e in sent for c in e["choices"] if c["index"] == 0 for i in c.get("token_ids") or []]
        prompt = next(e.get("prompt_token_ids") or e["choices"][0].get("prompt_token_ids") for e in sent
                      if e["choices"])  # fmt: skip
    else:
        sent = rec.json()
        assert json.loads(result.body) == _without_ids(sent)
        assert result.header(b"content-length") == str(len(result.body)).encode()
        completion = sent["choices"][0]["token_ids"]
        prompt = sent.get("prompt_token_ids") or sent["choices"][0].get("prompt_token_ids")
    record = turn.to_json()
    assert (record["session_id"], record["session_source"]) == ("sess-1", "x-nvext-session-id")
    assert record["completion_token_ids"] == completion and record["prompt_token_ids"] == prompt
    assert record["route"] == rec.path and record["request_id"] == (sent[0] if rec.stream else sent)["id"]
    assert record["finish_reason"] is not None
    assert record["spans"] == [{"kind": "text", "start": 0, "end": len(completion), "tool_call_id": None,
                                "name": None}]  # fmt: skip
    logprobs = rec.request.get("logprobs")
    assert (record["logprobs"] is not None) == bool(logprobs), "logprobs recorded when vLLM computed them"
    if record["logprobs"] is not None:
        assert len(record["logprobs"]) == len(completion)
    assert (record["choices"] is not None) == (rec.request.get("n", 1) > 1)


@pytest.mark.parametrize("name", ["chat_stream_ids", "completions_stream_ids_n2", "chat_unary_ids"])
async def test_both_stream_paths_give_the_same_bytes_and_turn_with_capture_on(name, tmp_path):
    _, c_result, c_turn = await _captured(name, False, tmp_path)
    _, py_result, py_turn = await _captured(name, True, tmp_path)
    assert c_result.body == py_result.body
    c_json, py_json = c_turn.to_json(), py_turn.to_json()
    c_json.pop("time"), py_json.pop("time")
    assert c_json == py_json


async def test_without_a_session_key_the_turn_is_its_own_session_named_by_the_response_id(tmp_path):
    rec, _, turn = await _captured("chat_stream_ids", False, tmp_path)
    assert turn.session_id == rec.events()[0]["id"] and turn.session_source == "request_id"


async def test_capture_off_forwards_a_request_that_asks_for_nothing_untouched():
    rec = recording("chat_stream_plain")
    upstream = Upstream(content_type=rec.content_type, body=rec.body)
    sent = json.dumps(rec.request).encode()
    result = await call(NvextMiddleware(upstream), rec.path, sent, headers=(JSON,))
    assert upstream.received == sent and result.body == rec.body


@pytest.mark.parametrize("stream", [False, True])
async def test_a_captured_responses_client_gets_stock_objects_and_the_turn_has_the_response_ids(stream, tmp_path):
    name = "responses_stream_messages" if stream else "responses_unary_messages"
    request, body, content_type = _rec(name)
    plain = {k: v for k, v in request.items() if k != "enable_response_messages"}
    upstream = Upstream(content_type=content_type, body=body, cuts=(5, 300))
    app = _app(upstream, tmp_path)
    headers = (JSON, (b"session_id", b"codex-conv-1"))
    result = await call(app, "/v1/responses", json.dumps(plain).encode(), headers=headers)
    assert json.loads(upstream.received or b"")["enable_response_messages"] is True
    final = _events(body)[-1]["response"] if stream else json.loads(body)
    got = _events(result.body)[-1]["response"] if stream else json.loads(result.body)
    assert got == {**final, "input_messages": None, "output_messages": None}
    if stream:
        assert _events(result.body)[:-1] == _events(body)[:-1], "every other event as vLLM sent it"
    (turn,) = _turns(app)
    record = turn.to_json()
    assert (record["session_id"], record["session_source"]) == ("codex-conv-1", "session_id")
    assert record["prompt_token_ids"] == final["input_messages"][0]["tokens"]
    assert record["completion_token_ids"] == final["output_messages"][0]["tokens"]
    assert record["route"] == "/v1/responses" and record["request_id"] == final["id"]
    assert record["spans"] is None, "Responses reports ids per round, not per item"


def test_session_keys_follow_the_documented_order_and_skip_unusable_values():
    both = [(b"x-claude-code-session-id", b"cc-1"), (b"x-dynamo-session-id", b"dyn-1")]
    assert header_key(both).session_id == "dyn-1"
    assert header_key([(b"x-nvext-session-id", b"ours"), *both]).source == "x-nvext-session-id"
    bad = [(b"x-dynamo-session-id", b"../../etc/passwd"), (b"x-claude-code-session-id", b"cc-1")]
    assert header_key(bad).session_id == "cc-1", "a value that is no valid session id is skipped"
    assert header_key([(b"x-dynamo-session-id", b"x" * 257)]).session_id is None
    lineage = [(b"x-claude-code-session-id", b"s"), (b"x-claude-code-agent-id", b"a"),
               (b"x-claude-code-parent-agent-id", b"p")]  # fmt: skip
    assert header_key(lineage)[:5] == ("s:a", "x-claude-code-session-id", "p", "a", "s"), "the subagent's thread"
    assert session_key([], {"prompt_cache_key": "conv-9"})[:2] == ("conv-9", "prompt_cache_key")
    assert session_key([], {"metadata": {"user_id": "user_1_session_2"}})[:2] == ("user_1_session_2",
                                                                                 "metadata.user_id")  # fmt: skip
    assert session_key([(b"session_id", b"h")], {"prompt_cache_key": "b"}).session_id == "h", "headers first"
    assert session_key([], {"prompt_cache_key": 7}) == (None, "request_id", None, None, None, None)


def _chunk(choices: list[Any], **root: Any) -> bytes:
    body = {"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices}
    return b"data: " + json.dumps({**body, **root}).encode() + b"\n\n"


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
async def test_a_choice_whose_ids_were_never_reported_is_null_never_empty(pure, tmp_path):
    """An upstream of the proxy that is not vLLM: a stream whose chunks never carry `token_ids` (the server ignores
    `return_token_ids`), and a body that answers no choice 0 (`choices: []`, or only a choice of another index). The
    turn's completion ids were not reported: `null` (with its logprobs and spans), never `[]`, which reads as "the
    model sampled nothing"; the session's next turn is recorded whole."""
    opening = _chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
    stream = opening + _chunk([{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]) + b"data: [DONE]\n\n"
    unary = {"id": "chatcmpl-y", "object": "chat.completion", "created": 1, "model": "m", "prompt_token_ids": [1, 2]}
    answers = [
        ("text/event-stream", stream, True),
        ("application/json", json.dumps({**unary, "choices": []}).encode(), False),
        (
            "application/json",
            json.dumps(
                {
                    **unary,
                    "choices": [
                        {
                            "index": 3,
                            "message": {"role": "assistant", "content": "x"},
                            "token_ids": [9],
                            "finish_reason": "stop",
                        }
                    ],
                }
            ).encode(),
            False,
        ),  # fmt: skip
    ]
    for n, (content_type, body, streamed) in enumerate(answers):
        upstream = Upstream(content_type=content_type, body=body)
        app = _app(upstream, tmp_path / f"{pure}-{n}", pure_python=pure)
        headers = (JSON, (b"x-nvext-session-id", b"s"))
        request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": streamed})
        await call(app, "/v1/chat/completions", request.encode(), headers=headers)
        upstream.body = json.dumps({**unary, "choices": [{"index": 0, "message": {"role": "assistant", "content": "k"},
                                    "token_ids": [3], "finish_reason": "stop"}]}).encode()  # fmt: skip
        upstream.content_type = "application/json"
        await call(app, "/v1/chat/completions", json.dumps({"model": "m", "messages": []}).encode(), headers=headers)
        first, second = (t.to_json() for t in _turns(app))
        assert first["completion_token_ids"] is None, (n, first)
        assert first["logprobs"] is None and first["spans"] is None, (n, first)
        assert second["completion_token_ids"] == [3] and second["index"] == 1, (n, second)


@pytest.mark.parametrize("name", ["messages_unary_plain", "messages_stream_plain"])
async def test_a_messages_request_on_the_middleware_alone_passes_as_sent_and_is_counted_not_captured(
    name, tmp_path, caplog
):
    """docs/capture.md, Mounts: without the plugin, /v1/messages' ids exist only inside vLLM's handler. The request
    reaches vLLM as the client sent it, the answer (vLLM 0.32's, recorded) the client as vLLM wrote it; no turn is
    recorded, and each such request counts as dropped (`not_on_this_mount`), the log saying so once."""
    request, answer, content_type = _rec(name)
    upstream = Upstream(content_type=content_type, body=answer)
    app = _app(upstream, tmp_path)
    body = json.dumps(request).encode()
    with caplog.at_level("WARNING", logger="vllm_nvext.capture"):
        for _ in range(2):
            result = await call(app, "/v1/messages", body, headers=(JSON, (b"x-claude-code-session-id", b"cc-1")))
            assert (result.status, result.body, upstream.received) == (200, answer, body)
    assert app.sink is not None and app.sink.tally.dropped_turns == {"not_on_this_mount": 2}
    told = [r.getMessage() for r in caplog.records if "not captured on this mount" in r.getMessage()]
    assert len(told) == 1 and "/v1/messages" in told[0] and "VLLM_PLUGINS=nvext" in told[0]
    assert _turns(app) == []

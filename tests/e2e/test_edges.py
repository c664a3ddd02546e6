"""End to end: where the middleware meets the rest of vLLM, next to stock vLLM on the real engine.

Echo is served with the text stock vLLM gives; vLLM's errors name the field the client sent; the
chat batch route and SageMaker's /invocations are translated; routes without ids pass untouched;
ids vLLM withholds (`include_reasoning: false` on a server with a parser) are never reported as
"no tokens" (the `parser` server, in a pytest run of its own: marker `e2e_parser`).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.helpers import CHAT, COMPLETIONS, MODEL_NAME, content_events, final_event, post, sse_events
from vllm_nvext.protocol import PATHS, Endpoint

pytestmark = pytest.mark.e2e

BATCH = PATHS[Endpoint.CHAT_BATCH]
NVEXT_IDS = {"nvext": {"extra_fields": ["completion_token_ids"]}}
GREEDY = {"model": MODEL_NAME, "max_tokens": 5, "temperature": 0}
USER_X = [{"role": "user", "content": "x"}]


def _stream_text(events: list[dict]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for event in content_events(events):
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def _stream_nvext_ids(events: list[dict]) -> list[int]:
    return [i for e in content_events(events) for i in e["nvext"]["completion_token_ids"]]


@pytest.mark.parametrize("prompt", ["Hello there", [72, 101, 108, 108, 111], [257, 72, 105, 258]])
@pytest.mark.parametrize("stream", [False, True])
def test_echo_is_served_with_the_text_stock_vllm_gives(translated, raw, prompt, stream):
    body = {**GREEDY, "prompt": prompt, "echo": True, "stream": stream}
    stock = post(raw, COMPLETIONS, body)
    stock_ids = post(raw, COMPLETIONS, {**body, "stream": False, "return_token_ids": True})["choices"][0]
    for mode in ("nvext", "auto"):
        got = post(translated, COMPLETIONS, {**body, **NVEXT_IDS}, headers={"x-nvext-mode": mode})
        if stream:
            assert _stream_text(got) == _stream_text(stock), "the echoed prompt, then the completion"
            assert _stream_nvext_ids(got) == stock_ids["token_ids"]
        else:
            assert got["choices"][0]["text"] == stock["choices"][0]["text"]
            assert got["nvext"]["completion_token_ids"] == stock_ids["token_ids"]
            assert got["nvext"]["prompt_token_ids"] == stock_ids["prompt_token_ids"]


def test_echo_of_a_batch_puts_each_prompt_back_in_front_of_its_own_choices(translated, raw):
    body = {**GREEDY, "prompt": ["Hello", "Good day"], "echo": True}
    stock = post(raw, COMPLETIONS, body)
    for stream in (False, True):
        got = post(translated, COMPLETIONS, {**body, "stream": stream, **NVEXT_IDS}, headers={"x-nvext-mode": "vllm"})
        texts = _stream_text(got) if stream else {c["index"]: c["text"] for c in got["choices"]}
        assert texts == {c["index"]: c["text"] for c in stock["choices"]}


def test_echo_of_ids_vllm_cannot_decode_gets_vllms_own_error(translated, raw):
    body = {**GREEDY, "prompt": [72, 10**9], "echo": True}
    got = translated.post(COMPLETIONS, json={**body, **NVEXT_IDS})
    stock = raw.post(COMPLETIONS, json=body)
    assert got.status_code == stock.status_code == 400 and "out of vocabulary" in got.json()["error"]["message"]
    assert translated.get("/health").status_code == 200


def test_chat_echo_keeps_its_text(translated, raw):
    body = {
        **GREEDY,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}],
        "echo": True,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    stock = post(raw, CHAT, body)["choices"][0]["message"]["content"]
    got = post(translated, CHAT, {**body, **NVEXT_IDS})
    assert got["choices"][0]["message"]["content"] == stock and stock.startswith("Hel")
    assert (
        got["nvext"]["completion_token_ids"]
        == post(raw, CHAT, {**body, "return_token_ids": True})["choices"][0]["token_ids"]
    )


@pytest.mark.parametrize(
    ("path", "body", "client_field"),
    [
        (CHAT, {"messages": USER_X, "nvext": {"token_data": [72, 10**9]}}, "nvext.token_data"),
        (COMPLETIONS, {"prompt": "x", "nvext": {"token_data": [72, 10**9]}}, "nvext.token_data"),
        (CHAT, {"messages": USER_X, "nvext": {"max_thinking_tokens": 4}}, "nvext.max_thinking_tokens"),
    ],
)  # fmt: skip
def test_vllms_errors_name_the_field_the_client_sent(translated, path, body, client_field):
    resp = translated.post(path, json={**GREEDY, **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == client_field and error["message"].startswith(f"`{client_field}`"), error
    if "max_thinking_tokens" in body["nvext"]:
        # vLLM answers a stream with an error event: it names the client's field too.
        events = post(translated, path, {**GREEDY, **body, "stream": True})
        errors = [e["error"] for e in events if "error" in e]
        assert errors and errors[0]["param"] == client_field, events


def _conversations(*texts: str) -> list[list[dict]]:
    return [[{"role": "user", "content": text}] for text in texts]


def test_chat_batch_is_translated_like_chat(translated, raw):
    body = {**GREEDY, "messages": _conversations("Hello")}
    stock = post(raw, BATCH, {**body, "return_token_ids": True})
    nvext = post(translated, BATCH, {**body, **NVEXT_IDS})
    assert nvext["nvext"]["completion_token_ids"] == stock["choices"][0]["token_ids"]
    assert nvext["choices"][0]["token_ids"] is None, "nvext placement: vLLM's copy is not shown"
    assert "prompt_token_ids" not in nvext["nvext"], "vLLM's batch route never reports prompt ids: not reported"
    two = {**body, "messages": _conversations("Hello", "Good day")}
    stock_two = post(raw, BATCH, {**two, "return_token_ids": True})
    placed = post(translated, BATCH, {**two, **NVEXT_IDS}, headers={"x-nvext-mode": "vllm"})
    assert [c["token_ids"] for c in placed["choices"]] == [c["token_ids"] for c in stock_two["choices"]]
    refused = translated.post(BATCH, json={**two, **NVEXT_IDS})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
    header = translated.post(BATCH, json={**two, "return_token_ids": True}, headers={"x-nvext-mode": "nvext"})
    assert header.status_code == 400 and header.json()["error"]["param"] == "messages", "the mode header is read"


def test_chat_batch_stream_is_refused_instead_of_answered_with_one_token(translated, raw):
    body = {**GREEDY, "messages": _conversations("Hello"), "stream": True, "return_token_ids": True}
    whole = post(raw, BATCH, {**body, "stream": False})["choices"][0]["token_ids"]
    stock = raw.post(BATCH, json=body)
    assert stock.status_code == 200, stock.text
    # vLLM's silent truncation: one JSON answer holding the last streamed delta's ids (how many the engine made in
    # its last step: one or several), never the whole answer, which begins with the prefill's token alone.
    tail = stock.json()["choices"][0]["token_ids"]
    assert 0 < len(tail) < len(whole) and whole[-len(tail) :] == tail, (tail, whole)
    resp = translated.post(BATCH, json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"


def test_invocations_is_translated_as_the_route_vllm_serves_the_body_on(translated, raw):
    chat = {**GREEDY, "messages": [{"role": "user", "content": "Hello"}]}
    completion = {**GREEDY, "prompt": "Hello"}
    for body, path in ((chat, CHAT), (completion, COMPLETIONS)):
        stock = post(raw, path, {**body, "return_token_ids": True})["choices"][0]["token_ids"]
        got = post(translated, PATHS[Endpoint.INVOCATIONS], {**body, **NVEXT_IDS})
        assert got["nvext"]["completion_token_ids"] == stock


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "Hello"}),
    ],
)
def test_routes_without_ids_pass_untouched(translated, raw, path, body):
    # vLLM ignores `nvext` there (an extra field), and so does the middleware: the answer is stock's.
    # (/v1/responses and /v1/messages: tests/e2e/test_agent_routes.py)
    request = {**GREEDY, **body, **NVEXT_IDS, "return_token_ids": True}
    got, stock = translated.post(path, json=request), raw.post(path, json=request)
    assert got.status_code == stock.status_code
    assert _stable(got.json()) == _stable(stock.json())


def _stable(obj):
    """An answer without the values that differ per request (ids and times, at any depth)."""
    if isinstance(obj, list):
        return [_stable(o) for o in obj]
    if isinstance(obj, dict):
        return {k: _stable(v) for k, v in obj.items() if k not in {"id", "created", "created_at", "completed_at"}}
    return obj


# --- ids vLLM withholds: a server with a reasoning parser -----------------------------------------

HIDDEN = {
    **GREEDY,
    "messages": [{"role": "user", "content": "Hello"}],
    "include_reasoning": False,
    # The tiny model never closes its thinking: without this everything is reasoning.
    "chat_template_kwargs": {"enable_thinking": False},
}


@pytest.fixture(scope="module")
def parser(parser_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=parser_server.url, timeout=120.0) as client:
        yield client


@pytest.mark.e2e_parser
@pytest.mark.parametrize("stream", [False, True])
def test_ids_vllm_withholds_are_never_reported_as_no_tokens(parser, stream):
    body = {**HIDDEN, "stream": stream, "stream_options": {"include_usage": True}} if stream else HIDDEN
    shown = post(parser, CHAT, {**HIDDEN, "include_reasoning": True, "return_token_ids": True})["choices"][0]
    assert shown["token_ids"], "with reasoning included vLLM reports the ids"
    nvext = {"nvext": {"extra_fields": ["completion_token_ids", "engine_data"]}}
    got = post(parser, CHAT, {**body, **nvext})
    both = post(parser, CHAT, {**body, **nvext, "return_token_ids": True}, headers={"x-nvext-mode": "both"})
    if not stream:
        assert got["usage"]["completion_tokens"] == len(shown["token_ids"]), "tokens were generated"
        assert got["nvext"]["completion_token_ids"] is None, "not reported, never []"
        assert got["nvext"]["engine_data"]["completion_token_ids"] is None
        assert both["choices"][0]["token_ids"] is None and both["nvext"]["completion_token_ids"] is None
        return
    chunks = content_events(got)
    assert "token_ids" not in chunks[0]["choices"][0], "the role chunk comes before any id"
    # Every chunk, the role chunk too: `ids += chunk["nvext"]["completion_token_ids"] or []` never reads [].
    assert all(c["nvext"]["completion_token_ids"] is None for c in chunks), chunks
    engine = final_event(got)["nvext"]["engine_data"]
    assert engine["completion_token_ids"] is None and engine["finished"] is True
    assert all(c["nvext"]["completion_token_ids"] is None for c in content_events(both))
    assert [e for e in got if not e["choices"]][0]["usage"]["completion_tokens"] == len(shown["token_ids"])


@pytest.mark.e2e_parser
def test_ids_are_reported_when_vllm_reports_them_on_a_parser_server(parser):
    shown = post(parser, CHAT, {**HIDDEN, "include_reasoning": True, "return_token_ids": True})["choices"][0]
    got = post(parser, CHAT, {**HIDDEN, "include_reasoning": True, **NVEXT_IDS})
    assert got["nvext"]["completion_token_ids"] == shown["token_ids"]
    events = sse_events(
        parser.post(CHAT, json={**HIDDEN, "include_reasoning": True, "stream": True, **NVEXT_IDS}).content
    )
    assert _stream_nvext_ids(events) == shown["token_ids"]

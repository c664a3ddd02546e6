"""vllm_nvext.client: token ids out of every placement, on responses recorded from real vLLM.

The vLLM-placement inputs are the recordings under tests/fixtures; their nvext and
engine_data twins are made from the same recordings by the middleware's own reshaping, and
the hand-written shapes follow docs/protocol.md §1/§3 where no recording exists (vLLM >= 0.33,
Dynamo's flat errors). tests/e2e/test_client.py reads live answers from the servers.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import httpx
import pytest

from tests.recorded import Recording, recording
from vllm_nvext import _json
from vllm_nvext.client import (
    ENGINE_DATA,
    NVEXT,
    VLLM,
    TokenIdsError,
    extract,
    extract_stream,
    first_difference,
    parse_sse,
)
from vllm_nvext.config import Mode
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.outbound import sse
from vllm_nvext.outbound.chunks import ChunkReshaper, reshape_unary
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.protocol import ENDPOINT_PATHS

NVEXT_TRIO = {"nvext": {"extra_fields": ["completion_token_ids"]}}
ENGINE = {"nvext": {"extra_fields": ["engine_data"]}}


# --- oracles: the ids read straight off the recorded JSON, per docs/protocol.md §1 ------------------


def recorded_ids(rec: Recording) -> tuple[list[int], dict[int, list[int]]]:
    """(prompt ids, completion ids per choice index) of a vLLM-placement recording."""
    objects = rec.events() if rec.stream else [rec.json()]
    prompt: list[int] | None = None
    completions: dict[int, list[int]] = {}
    for obj in objects:
        if prompt is None and obj.get("prompt_token_ids") is not None:
            prompt = obj["prompt_token_ids"]
        for choice in obj["choices"]:
            if prompt is None and choice.get("prompt_token_ids") is not None:
                prompt = choice["prompt_token_ids"]
            completions.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    assert prompt, f"{rec.name}: the recording has no prompt ids"
    assert all(completions.values()), f"{rec.name}: the recording has no completion ids"
    return prompt, completions


def reshaped(rec: Recording, dialect: dict[str, Any], mode: Mode = Mode.AUTO) -> Any:
    """The recording as the middleware answers a request in `dialect` (same upstream request)."""
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"} | dialect
    plan = plan_request(_json.dumps(request), ENDPOINT_PATHS[rec.path], mode)
    assert plan is not None
    if not rec.stream:
        body = rec.json()
        assert reshape_unary(body, plan, Clock())
        return body
    reshaper = ChunkReshaper(plan, Clock())
    events = rec.events()
    for event in events:
        reshaper.reshape(event)
    return events


UNARY = ["chat_unary_ids", "completions_unary_ids", "completions_unary_ids_token_prompt"]
STREAMS = ["chat_stream_ids", "completions_stream_ids", "chat_stream_ids_long", "completions_stream_ids_long"]


# --- vLLM placement ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", UNARY)
def test_unary_vllm_placement_gives_recorded_ids(name):
    rec = recording(name)
    prompt, completions = recorded_ids(rec)
    ids = extract(rec.json())
    assert ids.placement == VLLM and ids.placements == (VLLM,)
    assert ids.prompt_token_ids == prompt
    assert ids.completion_token_ids == [completions[0]]
    assert ids.finish_reasons == [rec.json()["choices"][0]["finish_reason"]]


def test_token_prompt_comes_back_as_sent():
    rec = recording("completions_unary_ids_token_prompt")
    assert extract(rec.json()).prompt_token_ids == rec.request["prompt"]


@pytest.mark.parametrize("name", STREAMS)
def test_stream_vllm_placement_concatenates_deltas(name):
    rec = recording(name)
    prompt, completions = recorded_ids(rec)
    ids = extract_stream(parse_sse(rec.body))
    assert ids.placement == VLLM
    assert ids.prompt_token_ids == prompt
    assert ids.completion_token_ids == [completions[0]]
    assert len(ids.completion_token_ids[0]) > 1, "a stream of one delta proves no concatenation"
    assert ids.finish_reasons[0] in ("length", "stop")


def test_stream_equals_unary_for_the_same_request():
    unary = extract(recording("completions_unary_ids").json())
    stream = extract_stream(recording("completions_stream_ids").events())
    assert stream.prompt_token_ids == unary.prompt_token_ids
    assert stream.completion_token_ids == unary.completion_token_ids


@pytest.mark.parametrize("name", ["completions_unary_ids_n2", "completions_stream_ids_n2"])
def test_n2_gives_one_id_list_per_choice_index(name):
    rec = recording(name)
    prompt, completions = recorded_ids(rec)
    ids = extract_stream(rec.events()) if rec.stream else extract(rec.json())
    assert sorted(completions) == [0, 1]
    assert ids.completion_token_ids == [completions[0], completions[1]]
    assert ids.prompt_token_ids == prompt
    assert len(ids.finish_reasons) == 2 and None not in ids.finish_reasons


def test_interleaved_choices_are_kept_apart_even_out_of_order():
    events = recording("completions_stream_ids_n2").events()
    _, completions = recorded_ids(recording("completions_stream_ids_n2"))
    odd_first = [e for e in events if e["choices"] and e["choices"][0]["index"] == 1]
    rest = [e for e in events if e not in odd_first]
    ids = extract_stream(odd_first + rest)
    assert ids.completion_token_ids == [completions[0], completions[1]]


@pytest.mark.parametrize("name", ["chat_unary_ids_logprobs", "completions_unary_ids_logprobs"])
def test_vllm_logprobs_align_with_ids(name):
    rec = recording(name)
    ids = extract(rec.json())
    lp = rec.json()["choices"][0]["logprobs"]
    expected = [c["logprob"] for c in lp["content"]] if "content" in lp else lp["token_logprobs"]
    assert ids.completion_logprobs == [expected]
    assert len(ids.completion_logprobs[0]) == len(ids.completion_token_ids[0])


def test_streamed_logprobs_align_with_ids():
    ids = extract_stream(parse_sse(recording("chat_stream_ids_logprobs").body))
    assert ids.completion_logprobs is not None
    assert len(ids.completion_logprobs[0]) == len(ids.completion_token_ids[0]) > 1


def test_echo_stream_has_prompt_ids_but_no_completion_ids():
    rec = recording("completions_stream_echo")
    ids = extract_stream(parse_sse(rec.body))
    assert ids.placement == VLLM
    assert ids.prompt_token_ids == rec.events()[0]["choices"][0]["prompt_token_ids"]
    assert ids.completion_token_ids == []


@pytest.mark.parametrize("name", ["chat_unary_plain", "completions_unary_plain"])
def test_response_without_ids_says_how_to_ask_for_them(name):
    with pytest.raises(TokenIdsError, match="return_token_ids"):
        extract(recording(name).json())


def test_stream_without_ids_says_how_to_ask_for_them():
    with pytest.raises(TokenIdsError, match="no token ids"):
        extract_stream(parse_sse(recording("chat_stream_plain").body))


def test_error_body_raises_with_the_servers_message():
    with pytest.raises(TokenIdsError, match="max_tokens=5000 cannot be greater"):
        extract(recording("error_max_tokens").json())


def test_dynamo_flat_error_raises_with_its_message():
    body = {"message": "Validation: Unsupported parameter(s): `foo`", "type": "Bad Request", "code": 400}
    with pytest.raises(TokenIdsError, match="Unsupported parameter"):
        extract(body)


def test_mid_stream_error_event_raises():
    events = recording("chat_stream_ids").events()[:3]
    events.append({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}})
    with pytest.raises(TokenIdsError, match="engine died"):
        extract_stream(events)


def test_empty_stream_raises():
    with pytest.raises(TokenIdsError, match="no events"):
        extract_stream(parse_sse(recording("error_max_tokens").body))


# --- nvext and engine_data placement (the middleware's reshaping of the same recordings) ------


@pytest.mark.parametrize("name", UNARY)
def test_unary_nvext_placement_gives_the_same_ids(name):
    rec = recording(name)
    prompt, completions = recorded_ids(rec)
    body = reshaped(rec, NVEXT_TRIO)
    assert body["choices"][0]["token_ids"] is None, "the vLLM copy must be gone for this test to mean anything"
    ids = extract(body)
    assert ids.placement == NVEXT and ids.placements == (NVEXT,)
    assert ids.prompt_token_ids == prompt
    assert ids.completion_token_ids == [completions[0]]


@pytest.mark.parametrize("name", STREAMS)
def test_stream_nvext_placement_gives_the_same_ids(name):
    rec = recording(name)
    prompt, completions = recorded_ids(rec)
    events = reshaped(rec, NVEXT_TRIO)
    assert all(not c.get("token_ids") for e in events for c in e["choices"])
    ids = extract_stream(events)
    assert ids.placement == NVEXT
    assert ids.prompt_token_ids == prompt
    assert ids.completion_token_ids == [completions[0]]


@pytest.mark.parametrize("name", ["chat_unary_ids_logprobs", "completions_unary_ids_logprobs"])
def test_engine_data_gives_ids_and_logprobs(name):
    rec = recording(name)
    prompt, completions = recorded_ids(rec)
    body = reshaped(rec, ENGINE)
    ids = extract(body)
    assert ids.placement == ENGINE_DATA
    assert ids.prompt_token_ids == prompt
    assert ids.completion_token_ids == [completions[0]]
    assert ids.completion_logprobs == [body["nvext"]["engine_data"]["completion_logprobs"]]
    assert len(ids.completion_logprobs[0]) == len(completions[0])


def test_engine_data_stream_gives_all_ids_from_the_final_chunk():
    rec = recording("chat_stream_ids_logprobs")
    prompt, completions = recorded_ids(rec)
    ids = extract_stream(reshaped(rec, ENGINE))
    assert ids.placement == ENGINE_DATA
    assert (ids.prompt_token_ids, ids.completion_token_ids) == (prompt, [completions[0]])
    assert len(ids.completion_logprobs[0]) == len(completions[0])


def test_both_placements_agreeing_are_both_reported():
    rec = recording("chat_stream_ids")
    prompt, completions = recorded_ids(rec)
    ids = extract_stream(reshaped(rec, {"return_token_ids": True}, Mode.BOTH))
    assert ids.placements == (NVEXT, VLLM)
    assert (ids.prompt_token_ids, ids.completion_token_ids) == (prompt, [completions[0]])


def test_placements_that_disagree_raise_with_the_first_difference():
    body = reshaped(recording("completions_unary_ids"), {"return_token_ids": True}, Mode.BOTH)
    altered = list(body["choices"][0]["token_ids"])  # a copy: nvext may share the list object
    original = altered[3]
    altered[3] = original + 1
    body["choices"][0]["token_ids"] = altered
    with pytest.raises(TokenIdsError, match=rf"completion ids differ .*index 3: {original} != {original + 1}"):
        extract(body)


def test_kv_transfer_params_from_nvext_then_root():
    body = reshaped(recording("completions_unary_ids"), NVEXT_TRIO)
    assert extract(body).kv_transfer_params is None
    body["nvext"]["kv_transfer_params"] = {"hidden_states_path": "/hs/a.safetensors"}
    body["kv_transfer_params"] = None
    assert extract(body).kv_transfer_params == {"hidden_states_path": "/hs/a.safetensors"}
    vllm = recording("completions_unary_ids").json()
    vllm["kv_transfer_params"] = {"hidden_states_path": "/hs/b.safetensors"}
    assert extract(vllm).kv_transfer_params == {"hidden_states_path": "/hs/b.safetensors"}


def test_kv_transfer_params_on_the_finish_chunk_as_vllm_033_sends_it():
    events = recording("completions_stream_ids").events()
    for event in events:
        finished = event["choices"] and event["choices"][0]["finish_reason"] is not None
        event["kv_transfer_params"] = {"hidden_states_path": "/hs/c.safetensors"} if finished else None
    assert extract_stream(events).kv_transfer_params == {"hidden_states_path": "/hs/c.safetensors"}


# --- input types -------------------------------------------------------------------------------


def test_openai_sdk_objects_keep_the_extra_fields():
    openai_types = pytest.importorskip("openai.types")
    chat = openai_types.chat.ChatCompletion.model_validate(recording("chat_unary_ids").json())
    assert extract(chat).completion_token_ids == extract(recording("chat_unary_ids").json()).completion_token_ids
    nvext_body = reshaped(recording("completions_unary_ids"), NVEXT_TRIO)
    completion = openai_types.Completion.model_validate(nvext_body)
    assert extract(completion).placement == NVEXT
    assert extract(completion).completion_token_ids == [nvext_body["nvext"]["completion_token_ids"]]
    chunks = [
        openai_types.chat.ChatCompletionChunk.model_validate(e)
        for e in reshaped(recording("chat_stream_ids"), NVEXT_TRIO)
    ]
    assert extract_stream(chunks) == extract_stream(reshaped(recording("chat_stream_ids"), NVEXT_TRIO))


def test_http_response_and_json_text_inputs():
    body = recording("chat_unary_ids").json()
    expected = extract(body)
    assert extract(httpx.Response(200, json=body)) == expected
    assert extract(json.dumps(body)) == expected
    assert extract(json.dumps(body).encode()) == expected
    assert extract_stream(json.dumps(e) for e in recording("chat_stream_ids").events()).prompt_token_ids


def test_extract_does_not_mutate_its_input():
    body = reshaped(recording("chat_unary_ids"), NVEXT_TRIO)
    before = copy.deepcopy(body)
    extract(body)
    assert body == before


def test_unreadable_objects_are_a_type_error():
    with pytest.raises(TypeError, match="int"):
        extract(42)


def test_pydantic_v1_objects_and_non_object_answers():
    body = recording("chat_unary_ids").json()

    class V1Model:  # pydantic v1's `.json()` returns the JSON text
        def json(self) -> str:
            return json.dumps(body)

    class ListAnswer:
        def json(self) -> list[int]:
            return [1, 2]

    assert extract(V1Model()) == extract(body)
    with pytest.raises(TokenIdsError, match="not a JSON object: list"):
        extract(ListAnswer())


def test_prompt_ids_from_another_placement_fill_in_and_disagreeing_prompts_raise():
    body = reshaped(recording("completions_unary_ids"), {"return_token_ids": True}, Mode.BOTH)
    prompt = body["choices"][0]["prompt_token_ids"]
    assert body["nvext"].pop("prompt_token_ids") == prompt
    ids = extract(body)
    assert ids.placement == NVEXT and ids.prompt_token_ids == prompt  # read from vLLM's placement
    body["nvext"]["prompt_token_ids"] = [*prompt[:-1], prompt[-1] + 1]
    with pytest.raises(TokenIdsError, match=rf"prompt ids differ .*index {len(prompt) - 1}: "):
        extract(body)


def test_choices_that_are_not_objects_are_skipped():
    body = recording("completions_unary_ids").json()
    body["choices"].append("garbage")
    assert extract(body).completion_token_ids == extract(recording("completions_unary_ids").json()).completion_token_ids


def test_non_integer_ids_are_refused():
    body = recording("chat_unary_ids").json()
    body["choices"][0]["token_ids"] = [1, "2"]
    with pytest.raises(TokenIdsError, match=r"choices\[0\].token_ids"):
        extract(body)


# --- parse_sse ---------------------------------------------------------------------------------


def test_parse_sse_any_split_gives_the_same_events():
    body = recording("chat_stream_ids").body
    expected = recording("chat_stream_ids").events()
    assert list(parse_sse(body)) == expected
    assert list(parse_sse([body[i : i + 1] for i in range(len(body))])) == expected  # byte by byte
    assert list(parse_sse([body[:7], body[7:100], body[100:]])) == expected


def test_parse_sse_utf8_split_inside_a_character():
    payload = json.dumps({"text": "héllo ✓ 日本"}, ensure_ascii=False).encode()
    body = b"data: " + payload + b"\n\n"
    cut = body.index("✓".encode()) + 1
    assert list(parse_sse([body[:cut], body[cut:]])) == [{"text": "héllo ✓ 日本"}]


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_parse_sse_line_ends_and_comments(eol):
    body = eol.join([b": keep-alive", b"", b'data: {"a": 1}', b"", b'data:{"b": 2}', b"", b"data: [DONE]", b"", b""])
    assert list(parse_sse(body)) == [{"a": 1}, {"b": 2}]
    # A CRLF split between chunks is one line end, not an extra blank line.
    cut = body.index(b"\r") + 1 if b"\r" in body else len(body)
    assert list(parse_sse([body[:cut], body[cut:]])) == [{"a": 1}, {"b": 2}]


def test_parse_sse_multiline_data_and_other_fields():
    body = b'event: message\nid: 7\ndata: {"a":\ndata:  1}\nretry: 10\n\n'
    assert list(parse_sse(body)) == [{"a": 1}]


def test_parse_sse_stops_at_done_and_keeps_an_unterminated_tail():
    assert list(parse_sse(b'data: {"a": 1}\n\ndata: [DONE]\n\ndata: {"b": 2}\n\n')) == [{"a": 1}]
    assert list(parse_sse(b'data: {"a": 1}\n\ndata: {"b": 2}')) == [{"a": 1}, {"b": 2}]


def test_parse_sse_lines_mode_takes_iter_lines_output():
    body = recording("completions_stream_ids").body.decode()
    lines = body.split("\n")
    assert list(parse_sse(lines, lines=True)) == recording("completions_stream_ids").events()


def test_parse_sse_non_json_payload_raises():
    with pytest.raises(TokenIdsError, match="not JSON"):
        list(parse_sse(b"data: hello\n\n"))
    with pytest.raises(TokenIdsError, match=r"not a JSON object: '\[1\]'"):
        list(parse_sse(b"data: [1]\n\n"))


def test_parse_sse_takes_bytearray_and_memoryview_bodies():
    body = recording("chat_stream_ids").body
    expected = recording("chat_stream_ids").events()
    assert list(parse_sse(bytearray(body))) == expected
    assert list(parse_sse(memoryview(body))) == expected
    assert list(parse_sse([memoryview(body)[:100], bytearray(body[100:])])) == expected


def _big_event_in_small_chunks(size: int, chunk: int = 100) -> list[bytes]:
    body = b'data: {"text": "' + b"x" * size + b'"}\n\ndata: [DONE]\n\n'
    return [body[i : i + chunk] for i in range(0, len(body), chunk)]


class _CountingEol:
    """Stands in for the framer's line-end pattern and counts the bytes each search reads."""

    def __init__(self, pattern: re.Pattern[bytes]) -> None:
        self.pattern = pattern
        self.scanned = 0

    def search(self, buf: bytearray, pos: int) -> re.Match[bytes] | None:
        m = self.pattern.search(buf, pos)
        self.scanned += (m.end() if m else len(buf)) - pos
        return m


@pytest.mark.parametrize("size", [100_000, 1_000_000])
def test_parse_sse_reads_each_byte_of_a_big_event_once(monkeypatch, size):
    """Work, not time, is measured: a 1 MB event in 100-byte chunks costs what 10 x 100 KB do."""
    counter = _CountingEol(sse._EOL)
    monkeypatch.setattr(sse, "_EOL", counter)
    chunks = _big_event_in_small_chunks(size)
    assert [len(e["text"]) for e in parse_sse(chunks)] == [size]
    # Every byte read by the one framer, once: a rescan per chunk would read ~size**2 / 200 bytes.
    assert size < counter.scanned <= sum(map(len, chunks))


# --- first_difference --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([1, 2, 3], [1, 2, 3], None),
        ([1, 2, 17], [1, 2, 18], "index 2: 17 != 18"),
        ([1, 2], [1, 2, 3], "index 2: <end> != 3 (lengths 2 and 3)"),
        ([1, 2, 3], [1, 2], "index 2: 3 != <end> (lengths 3 and 2)"),
        (None, [1], "missing != 1 ids"),
        (None, None, None),
    ],
)
def test_first_difference(a, b, expected):
    assert first_difference(a, b) == expected

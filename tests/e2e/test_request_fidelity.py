"""End to end: each request-reading finding replayed against the real servers next to stock vLLM.

The translated servers (`--middleware` and the endpoint plugin) must read every body as stock
vLLM reads it: the same prompt, the same sampling, and the ids the request asked for, or a 400
naming the field; never a 500, never an opt-in silently dropped. On .venv's vLLM and on 0.30 and
0.31's real engines (the marker `vllm_versions`).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import COMPLETIONS, MODEL_NAME

# .venv's vLLM and the real engines of 0.30 and 0.31 (docs/supported-vllm.md).
pytestmark = [pytest.mark.e2e, pytest.mark.vllm_versions("0.32", "0.30", "0.31")]

PLAIN = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
NVEXT_IDS = {"extra_fields": ["completion_token_ids"]}
JSON = {"content-type": "application/json"}


def send(client: httpx.Client, body: bytes, headers: dict[str, str] | list[tuple[str, str]] | None = None):
    given = headers or JSON
    return client.post(COMPLETIONS, content=body, headers=list(given.items()) if isinstance(given, dict) else given)


def greedy_ids(raw: httpx.Client, **fields) -> tuple[list[int], list[int], str]:
    """Stock vLLM's prompt ids, completion ids and text for a greedy request."""
    resp = raw.post(COMPLETIONS, json={**PLAIN, **fields, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"], choice["text"]


@pytest.mark.parametrize(
    "hazard",
    [b'"x":NaN', b'"x":Infinity', b'"x":-1e400', b'"x":"\\ud800"', b'"x":123456789012345678901234567890'],
)
def test_non_standard_json_still_applies_nvext(translated, raw, hazard):
    # Finding: bodies orjson refuses were passed through, so vLLM dropped nvext (token_data ignored).
    body = (
        b'{"model":"tiny","prompt":"Hello","max_tokens":4,'
        b'"nvext":{"token_data":[72,105],"greed_sampling":true,"extra_fields":["completion_token_ids"]},'
        + hazard
        + b"}"
    )
    resp = send(translated, body)
    assert resp.status_code == 200, resp.text
    prompt, ids, _ = greedy_ids(raw, prompt=[72, 105])
    assert resp.json()["nvext"]["prompt_token_ids"] == prompt == [72, 105]
    assert resp.json()["nvext"]["completion_token_ids"] == ids


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-8-sig"])
def test_bom_and_utf16_32_bodies_still_apply_nvext(translated, raw, encoding):
    body = json.dumps({**PLAIN, "nvext": {"token_data": [72, 105], **NVEXT_IDS}}).encode(encoding)
    resp = send(translated, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["nvext"]["prompt_token_ids"] == [72, 105]
    assert resp.json()["nvext"]["completion_token_ids"] == greedy_ids(raw, prompt=[72, 105])[1]


def test_invalid_nvext_in_a_nan_body_is_a_400(translated):
    body = b'{"model":"tiny","prompt":"Hello","max_tokens":4,"nvext":{"bogus":1},"x":NaN}'
    resp = send(translated, body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "nvext.bogus"


@pytest.mark.parametrize("n", ['"2"', "2.0"])
def test_n_that_vllm_coerces_to_two_is_refused_for_the_trio(translated, raw, n):
    body = f'{{"model":"tiny","prompt":"Hello","max_tokens":4,"n":{n},"nvext":{json.dumps(NVEXT_IDS)}}}'
    resp = send(translated, body.encode())
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "n"
    stock = send(raw, f'{{"model":"tiny","prompt":"Hello","max_tokens":4,"n":{n}}}'.encode())
    assert stock.status_code == 200 and len(stock.json()["choices"]) == 2, "stock vLLM reads it as 2"


def test_batch_with_single_prompt_selectors_is_refused(translated):
    for selector in ("prompt_token_ids", "engine_data"):
        body = {**PLAIN, "prompt": ["Hello", "World"], "nvext": {"extra_fields": [selector]}}
        resp = translated.post(COMPLETIONS, json=body)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "prompt" and selector in error["message"]


def test_selectors_other_than_the_trio_are_answered_with_n_2(translated):
    body = {**PLAIN, "n": 2, "temperature": 0.8, "nvext": {"extra_fields": ["stop_reason", "timing"]}}
    resp = translated.post(COMPLETIONS, json=body)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 2


@pytest.mark.parametrize("value", ['"true"', "1"])
def test_return_token_ids_vllm_coerces_is_accepted(translated, raw, value):
    body = f'{{"model":"tiny","prompt":"Hello","max_tokens":4,"temperature":0,"return_token_ids":{value}}}'
    resp = send(translated, body.encode())
    stock = send(raw, body.encode())
    assert resp.status_code == stock.status_code == 200
    assert resp.json()["choices"][0]["token_ids"] == stock.json()["choices"][0]["token_ids"]


def test_float_token_ids_are_one_prompt(translated, raw):
    body = b'{"model":"tiny","prompt":[72.0,105.0],"max_tokens":4,"temperature":0,"nvext":{"extra_fields":["x"]}}'
    body = body.replace(b'["x"]', b'["completion_token_ids"]')
    resp = send(translated, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["nvext"]["prompt_token_ids"] == [72, 105]
    assert resp.json()["nvext"]["completion_token_ids"] == greedy_ids(raw, prompt=[72, 105])[1]


def test_echo_is_never_answered_without_its_text(translated, raw):
    # vLLM leaves the echoed prompt out of `text` whenever return_token_ids is on: for a request
    # whose ids only the middleware turns on, the middleware puts it back (tests/e2e/test_edges.py).
    body = {**PLAIN, "echo": True, "nvext": NVEXT_IDS}
    resp = translated.post(COMPLETIONS, json=body)
    stock_text = raw.post(COMPLETIONS, json={**PLAIN, "echo": True}).json()["choices"][0]["text"]
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == stock_text
    # The client's own return_token_ids with echo: stock vLLM's answer, prompt ids only where asked.
    own = {**PLAIN, "echo": True, "return_token_ids": True}
    got = translated.post(COMPLETIONS, json=own, headers={"x-nvext-mode": "vllm"})
    stock = raw.post(COMPLETIONS, json=own)
    assert got.json()["choices"][0]["text"] == stock.json()["choices"][0]["text"]
    unary = translated.post(COMPLETIONS, json=own, headers={"x-nvext-mode": "nvext"}).json()
    assert unary["choices"][0]["prompt_token_ids"] is None, "unary: no vLLM-placed prompt ids in nvext mode"
    assert unary["nvext"]["prompt_token_ids"] == stock.json()["choices"][0]["prompt_token_ids"]


@pytest.mark.parametrize("depth", [500, 1000, 1023, 5000])
def test_deep_nesting_answers_as_stock_vllm_never_500(translated, raw, depth):
    nested = b"[" * depth + b"]" * depth
    for opt_in in (b'"nvext":{"extra_fields":["completion_token_ids"]}', b'"return_token_ids":true'):
        body = b'{"model":"tiny","prompt":"Hello","max_tokens":2,' + opt_in + b',"x":' + nested + b"}"
        got, stock = send(translated, body), send(raw, body)
        assert got.status_code != 500 and got.status_code == stock.status_code, (depth, got.text[:200])


def test_lone_surrogate_and_a_long_digit_run_answer_as_stock(translated, raw):
    body = (
        b'{"model":"tiny","prompt":"Hello 1234567890123456789012","user":"\\ud800","max_tokens":4,"temperature":0,'
        b'"return_token_ids":true}'
    )
    got, stock = send(translated, body), send(raw, body)
    assert got.status_code == stock.status_code == 200, got.text
    assert got.json()["choices"][0]["token_ids"] == stock.json()["choices"][0]["token_ids"]
    with_nvext = body.replace(b'"return_token_ids":true', b'"nvext":{"extra_fields":["completion_token_ids"]}')
    got = send(translated, with_nvext)
    assert (
        got.status_code == 200
        and got.json()["nvext"]["completion_token_ids"] == stock.json()["choices"][0]["token_ids"]
    )


def test_out_of_range_number_is_refused_as_stock_not_defaulted(translated, raw):
    body = b'{"model":"tiny","prompt":"Hello","max_tokens":4,"presence_penalty":1e400,"seed":12345678901234567890,'
    body += b'"nvext":{}}'
    got, stock = send(translated, body), send(raw, body.replace(b',"nvext":{}', b""))
    assert got.status_code == stock.status_code == 400


def test_duplicate_content_type_is_read_as_vllm_reads_it(translated, raw):
    body = json.dumps({**PLAIN, "nvext": {"token_data": [72, 105], **NVEXT_IDS}}).encode()
    headers = [("content-type", "application/json"), ("content-type", "text/plain")]
    got = send(translated, body, headers)
    assert got.status_code == 200 and got.json()["nvext"]["prompt_token_ids"] == [72, 105]
    flipped = [("content-type", "text/plain"), ("content-type", "application/json")]
    assert send(translated, body, flipped).status_code == send(raw, body, flipped).status_code


@pytest.mark.parametrize("mode", ["", "bogus"])
def test_mode_header_never_fails_a_request_that_opts_into_nothing(translated, raw, mode):
    body = json.dumps(PLAIN).encode()
    got = send(translated, body, {**JSON, "x-nvext-mode": mode})
    assert got.status_code == 200
    assert got.json()["choices"][0]["text"] == send(raw, body).json()["choices"][0]["text"]


def test_repeated_mode_headers_that_differ_are_refused(translated):
    body = json.dumps({**PLAIN, "return_token_ids": True}).encode()
    headers = [*JSON.items(), ("x-nvext-mode", "nvext"), ("x-nvext-mode", "vllm")]
    got = send(translated, body, headers)
    assert got.status_code == 400 and got.json()["error"]["param"] == "x-nvext-mode"


def test_dp_rank_conflicting_with_the_clients_header_is_refused(translated):
    body = json.dumps({**PLAIN, "nvext": {"dp_rank": 0, **NVEXT_IDS}}).encode()
    got = send(translated, body, {**JSON, "X-data-parallel-rank": "1"})
    assert got.status_code == 400 and got.json()["error"]["param"] == "nvext.dp_rank"
    same = send(translated, body, {**JSON, "X-data-parallel-rank": "0"})
    assert same.status_code == 200, same.text


def test_token_data_error_names_the_element(translated):
    resp = translated.post(COMPLETIONS, json={**PLAIN, "nvext": {"token_data": [-1]}})
    assert resp.status_code == 400 and "-1 at index 0" in resp.json()["error"]["message"]


def test_large_body_that_opts_into_nothing_is_served_as_stock(translated, raw):
    # Over the 32 MiB cap, with `\u` escapes (which make the middleware look closer): streams through.
    body = json.dumps({**PLAIN, "user": "\u00e9" * (6 * 1024 * 1024)}).encode()
    assert len(body) > 32 * 1024 * 1024
    got, stock = send(translated, body), send(raw, body)
    assert got.status_code == stock.status_code == 200
    assert got.json()["choices"][0]["text"] == stock.json()["choices"][0]["text"]
    late = body[:-1] + b',"nvext":{"extra_fields":["completion_token_ids"]}}'
    refused = send(translated, late)
    assert refused.status_code == 413, "an opt-in over the cap is refused, never passed on without nvext"

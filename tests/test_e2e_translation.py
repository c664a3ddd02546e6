"""End to end on real vLLM servers: every endpoint x stream x mode x dialect against raw vLLM.

The translated servers (`--middleware` and the endpoint plugin) must give the same greedy ids
as stock vLLM, in the placement the mode calls for, and nothing the middleware caused.
"""

from __future__ import annotations

import json
from functools import cache

import httpx
import pytest

pytestmark = pytest.mark.e2e

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BASE = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6},
    COMPLETIONS: {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6},
}
DIALECTS = {
    "vllm": {"return_token_ids": True},
    "nvext": {"nvext": {"extra_fields": ["completion_token_ids"]}},
    "both": {"return_token_ids": True, "nvext": {"extra_fields": ["completion_token_ids"]}},
}
# (mode, dialect) -> (vLLM placement, nvext placement); PROTOCOL §1/§3, README "Modes".
PLACEMENT = {
    ("auto", "vllm"): (True, False),
    ("auto", "nvext"): (False, True),
    ("auto", "both"): (True, True),
    **{("vllm", d): (True, False) for d in DIALECTS},
    **{("nvext", d): (False, True) for d in DIALECTS},
    **{("both", d): (True, True) for d in DIALECTS},
}
VOLATILE = ("id", "created")


def request_body(path: str, stream: bool, dialect: str | None) -> dict:
    body = {**BASE[path], "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if dialect:
        body.update(DIALECTS[dialect])
    return body


def post(client: httpx.Client, path: str, body: dict, headers: dict | None = None) -> list[dict] | dict:
    """A unary body, or the list of a stream's JSON events (checking the SSE framing)."""
    resp = client.post(path, json=body, headers=headers or {})
    assert resp.status_code == 200, resp.text
    if not body.get("stream"):
        assert int(resp.headers["content-length"]) == len(resp.content)
        return resp.json()
    text = resp.content
    assert text.endswith(b"data: [DONE]\n\n"), "stream must end with [DONE]"
    blocks = text.split(b"\n\n")[:-1]
    assert all(b.startswith(b"data: ") for b in blocks)
    return [json.loads(b[6:]) for b in blocks[:-1]]


def strip_volatile(obj):
    if isinstance(obj, list):
        return [strip_volatile(o) for o in obj]
    return {k: v for k, v in obj.items() if k not in VOLATILE}


@cache
def _raw(url: str, path: str, stream: bool, ids: bool):
    with httpx.Client(base_url=url, timeout=120) as client:
        return post(client, path, request_body(path, stream, "vllm" if ids else None))


@pytest.fixture(scope="session")
def raw_answer(servers):
    url = servers["raw"].url

    def answer(path: str, stream: bool, ids: bool):
        return _raw(url, path, stream, ids)

    return answer


def _ids_of_raw(path: str, raw) -> tuple[list[int], list[int]]:
    events = raw if isinstance(raw, list) else [raw]
    prompt, ids = None, []
    for event in events:
        if path == CHAT and event.get("prompt_token_ids"):
            prompt = event["prompt_token_ids"]
        for choice in event["choices"]:
            ids += choice.get("token_ids") or []
            if path == COMPLETIONS and choice.get("prompt_token_ids"):
                prompt = prompt or choice["prompt_token_ids"]
    return prompt, ids


@pytest.mark.parametrize("dialect", list(DIALECTS))
@pytest.mark.parametrize("mode", ["auto", "vllm", "nvext", "both"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_translation_matrix(translated, raw_answer, path, stream, mode, dialect):
    vllm_placed, nvext_placed = PLACEMENT[(mode, dialect)]
    got = post(translated, path, request_body(path, stream, dialect), headers={"x-nvext-mode": mode})
    with_ids, without_ids = raw_answer(path, stream, True), raw_answer(path, stream, False)
    prompt, ids = _ids_of_raw(path, with_ids)
    assert prompt and ids, "the raw baseline must carry ids"

    # Everything outside `nvext` is raw vLLM's answer: with ids in vLLM placement, else as if
    # return_token_ids had never been sent.
    expected = with_ids if vllm_placed else without_ids
    events = got if stream else [got]
    outside = [{k: v for k, v in e.items() if k != "nvext"} for e in events]
    assert strip_volatile(outside) == strip_volatile(expected if stream else [expected])

    if not nvext_placed:
        assert all("nvext" not in e for e in events), "nvext appears only when the mode calls for it"
        return
    if not stream:
        assert got["nvext"] == {"completion_token_ids": ids, "prompt_token_ids": prompt}
        return
    streamed: list[int] = []
    for event in events:
        if not event["choices"]:
            assert "nvext" not in event, "no nvext on the usage-only chunk"
            continue
        nv = event["nvext"]
        streamed += nv["completion_token_ids"]
        if event["choices"][0]["finish_reason"] is None:
            assert set(nv) == {"completion_token_ids"}
        else:
            assert nv["prompt_token_ids"] == prompt
    assert streamed == ids


def test_n_greater_than_one_in_vllm_placement_matches_raw(translated, raw):
    body = {**BASE[COMPLETIONS], "n": 2, "temperature": 0.8, "seed": 11, "return_token_ids": True}
    got = post(translated, COMPLETIONS, body, headers={"x-nvext-mode": "vllm"})
    assert strip_volatile(got) == strip_volatile(post(raw, COMPLETIONS, body))
    assert len(got["choices"]) == 2 and all(c["token_ids"] for c in got["choices"])


@pytest.mark.parametrize("mode", ["nvext", "both"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_n_greater_than_one_in_nvext_placement_is_dynamos_400(translated, path, mode):
    body = {**BASE[path], "n": 2, "temperature": 0.8, "return_token_ids": True}
    resp = translated.post(path, json=body, headers={"x-nvext-mode": mode})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        '`nvext.extra_fields=["completion_token_ids"]` requires exactly one generated choice'
    )


def test_completions_batch_in_nvext_placement_is_refused(translated):
    body = {**BASE[COMPLETIONS], "prompt": ["a", "b"], "nvext": {"extra_fields": ["completion_token_ids"]}}
    resp = translated.post(COMPLETIONS, json=body)
    assert resp.status_code == 400 and "exactly one generated choice" in resp.json()["error"]["message"]


def test_request_that_opts_into_nothing_matches_raw(translated, raw_answer):
    for path in (CHAT, COMPLETIONS):
        for stream in (False, True):
            got = post(translated, path, request_body(path, stream, None), headers={"x-nvext-mode": "nvext"})
            assert strip_volatile(got) == strip_volatile(raw_answer(path, stream, False))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"return_token_ids": "true"}, "return_token_ids"),
        ({"nvext": ["completion_token_ids"]}, "nvext"),
        ({"nvext": {"extra_fields": "completion_token_ids"}}, "nvext.extra_fields"),
        ({"nvext": {"unknown_key": True}}, "nvext.unknown_key"),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_the_server_keeps_serving(translated, raw_answer, body, param):
    resp = translated.post(COMPLETIONS, json={**BASE[COMPLETIONS], **body})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == 400 and param.split(".")[-1] in error["message"]
    good = post(translated, COMPLETIONS, request_body(COMPLETIONS, False, "vllm"))
    assert strip_volatile(good) == strip_volatile(raw_answer(COMPLETIONS, False, True))


def test_invalid_mode_header_is_a_400(translated):
    resp = translated.post(COMPLETIONS, json=request_body(COMPLETIONS, False, "vllm"), headers={"x-nvext-mode": "x"})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "x-nvext-mode"


def test_upstream_400_passes_through_unchanged(translated, raw):
    body = {**BASE[COMPLETIONS], "max_tokens": 5000, "nvext": {"extra_fields": ["completion_token_ids"]}}
    got = translated.post(COMPLETIONS, json=body, headers={"x-nvext-mode": "both"})
    expected = raw.post(COMPLETIONS, json={**BASE[COMPLETIONS], "max_tokens": 5000, "return_token_ids": True})
    assert got.status_code == expected.status_code == 400
    assert got.content == expected.content

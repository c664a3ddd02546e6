"""End to end on real vLLM servers: every endpoint x stream x mode x dialect against raw vLLM.

The translated servers (`--middleware` and the endpoint plugin) must give the same greedy ids
as stock vLLM, in the placement the mode calls for, and nothing the middleware caused. On every
declared version (the marker `vllm_versions`: .venv's, 0.30 and 0.31's real engines, 0.33's and 0.34's
serving layers; and through `vllm-nvext proxy` alone, vLLM 0.33's and 0.34's Rust frontend `vllm-rs`), one
version's servers at a time.
"""

from __future__ import annotations

from functools import cache

import pytest

from tests.helpers import (
    BASE,
    CHAT,
    COMPLETIONS,
    DIALECTS,
    MODES,
    assert_nvext_chunks,
    assert_stream_consistent,
    http_client,
    ids_as_null,
    ids_of,
    post,
    stream_digest,
    strip_volatile,
    without_nvext,
)
from tests.support.servers import version_server

# Every declared version (docs/supported-vllm.md): .venv's, the real engines of 0.30 and 0.31, 0.33's and 0.34's
# serving layers (0.34's: marker e2e_vllm034, `make test-e2e-vllm034`), and 0.33's Rust frontend (the proxy in
# front of it; marker e2e_proxy: `make test-e2e-proxy`) and 0.34's (in 0.34's group).
VERSIONS = ("0.32", "0.30", "0.31", "0.33", "0.34", "0.33-rust", "0.34-rust")
pytestmark = [pytest.mark.e2e, pytest.mark.vllm_versions(*VERSIONS)]
# The versions whose stock server answers the request of the two tests that use them as vLLM's Python
# server does. 0.33's vllm-rs answers n > 1 with its own 400 "Only n=1 is supported." (passed through unchanged:
# tests/e2e/test_versions.py), and max_tokens beyond the context with 200, cut at the context
# (docs/scaling-out.md, "vLLM's Rust frontend"); 0.34's answers both as the Python server does.
PYTHON_SERVERS = tuple(v for v in VERSIONS if v != "0.33-rust")

# (mode, dialect) -> (vLLM placement, nvext placement); docs/protocol.md §6.
PLACEMENT = {
    ("auto", "vllm"): (True, False),
    ("auto", "nvext"): (False, True),
    ("auto", "both"): (True, True),
    **{("vllm", d): (True, False) for d in DIALECTS},
    **{("nvext", d): (False, True) for d in DIALECTS},
    **{("both", d): (True, True) for d in DIALECTS},
}


def request_body(path: str, stream: bool, dialect: str | None) -> dict:
    body = {**BASE[path], "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    if dialect:
        body.update(DIALECTS[dialect])
    return body


@cache
def _raw(url: str, path: str, stream: bool, ids: bool):
    with http_client(url) as client:
        return post(client, path, request_body(path, stream, "vllm" if ids else None))


@pytest.fixture(scope="session")
def raw_answer(vllm_version):
    url = version_server(vllm_version, "raw").url

    def answer(path: str, stream: bool, ids: bool):
        return _raw(url, path, stream, ids)

    return answer


def same_answer(got, expected) -> None:
    """Unary: the whole body, less id and created. Stream: the same digest (chunking forgotten)."""
    if isinstance(expected, list):
        assert stream_digest(got) == stream_digest(expected)
    else:
        assert strip_volatile(got) == strip_volatile(expected)


@pytest.mark.parametrize("dialect", list(DIALECTS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_translation_matrix(translated, raw_answer, vllm_version, path, stream, mode, dialect):
    vllm_placed, nvext_placed = PLACEMENT[(mode, dialect)]
    got = post(translated, path, request_body(path, stream, dialect), headers={"x-nvext-mode": mode})
    with_ids, without_ids = raw_answer(path, stream, True), raw_answer(path, stream, False)
    prompt, ids = ids_of(path, with_ids)
    assert prompt and ids, "the raw baseline must carry ids"

    # Everything outside `nvext` is raw vLLM's answer: with ids in vLLM placement, else as if
    # return_token_ids had never been sent (vLLM's copies, which the middleware asked for, null; vllm-rs's
    # streams leave the keys out, and so does the proxy in front of it: docs/scaling-out.md).
    events = got if stream else [got]
    outside = without_nvext(events)
    unplaced = ids_as_null(without_ids, with_ids) if stream and not vllm_version.endswith("-rust") else without_ids
    same_answer(outside if stream else outside[0], with_ids if vllm_placed else unplaced)
    if stream:
        assert_stream_consistent(path, events)

    if not nvext_placed:
        assert all("nvext" not in e for e in events), "nvext appears only when the mode calls for it"
    elif not stream:
        assert got["nvext"] == {"completion_token_ids": ids, "prompt_token_ids": prompt}
    else:
        assert_nvext_chunks(events, prompt, ids, both=vllm_placed)


@pytest.mark.vllm_versions(*PYTHON_SERVERS)
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
            same_answer(got, raw_answer(path, stream, False))
            if stream:
                assert_stream_consistent(path, got)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"return_token_ids": "maybe"}, "return_token_ids"),
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


@pytest.mark.vllm_versions(*PYTHON_SERVERS)
def test_upstream_400_passes_through_unchanged(translated, raw):
    body = {**BASE[COMPLETIONS], "max_tokens": 5000, "nvext": {"extra_fields": ["completion_token_ids"]}}
    got = translated.post(COMPLETIONS, json=body, headers={"x-nvext-mode": "both"})
    expected = raw.post(COMPLETIONS, json={**BASE[COMPLETIONS], "max_tokens": 5000, "return_token_ids": True})
    assert got.status_code == expected.status_code == 400
    assert got.content == expected.content

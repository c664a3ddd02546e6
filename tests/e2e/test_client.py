"""vllm_nvext.client on live answers: every placement of the real servers gives stock vLLM's ids."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.helpers import API_KEY, CHAT, COMPLETIONS, DIALECTS, nvext
from vllm_nvext.client import ENGINE_DATA, NVEXT, VLLM, TokenIds, extract, extract_stream, parse_sse

pytestmark = pytest.mark.e2e

LIVE_BASE: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Count: one, two"}]},
    COMPLETIONS: {"prompt": "Count: one, two"},
}
ENGINE = nvext("engine_data")


def _live(client: httpx.Client, path: str, body: dict[str, Any], stream: bool) -> TokenIds:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, **LIVE_BASE[path], **body}
    if not stream:
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        return extract(response)
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return extract_stream(parse_sse(response.iter_bytes()))


@pytest.mark.parametrize("path", list(LIVE_BASE))
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize(
    ("dialect", "placement"),
    [(DIALECTS["vllm"], VLLM), (DIALECTS["nvext"], NVEXT), (ENGINE, ENGINE_DATA)],
    ids=["vllm", "nvext", "engine_data"],
)
def test_live_every_placement_reads_the_ids_of_stock_vllm(translated, raw, path, stream, dialect, placement):
    baseline = _live(raw, path, DIALECTS["vllm"], stream=False)
    ids = _live(translated, path, dialect, stream)
    assert ids.placement == placement
    assert ids.prompt_token_ids == baseline.prompt_token_ids
    assert ids.completion_token_ids == baseline.completion_token_ids
    assert len(baseline.completion_token_ids[0]) == 8


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_live_openai_sdk_objects_in_both_dialects(mw_server, raw, stream):
    openai = pytest.importorskip("openai")
    baseline = _live(raw, CHAT, DIALECTS["vllm"], stream=False)
    # Closed on the way out: a client left to the garbage collector leaves its socket to an unclosed-socket
    # warning (an error under pytest) in whichever later test runs then.
    with openai.OpenAI(base_url=mw_server.url + "/v1", api_key=API_KEY, max_retries=0) as sdk:
        for extra_body, placement in ((DIALECTS["vllm"], VLLM), (DIALECTS["nvext"], NVEXT)):
            response = sdk.chat.completions.create(
                model="tiny",
                messages=LIVE_BASE[CHAT]["messages"],
                max_tokens=8,
                temperature=0,
                stream=stream,
                extra_body=extra_body,
            )
            ids = extract_stream(response) if stream else extract(response)
            assert ids.placement == placement
            assert ids.prompt_token_ids == baseline.prompt_token_ids
            assert ids.completion_token_ids == baseline.completion_token_ids


def test_live_engine_data_logprobs_match_the_ids(mw):
    ids = _live(mw, CHAT, {**ENGINE, "logprobs": True}, stream=True)
    assert ids.placement == ENGINE_DATA
    assert ids.completion_logprobs is not None
    assert len(ids.completion_logprobs[0]) == len(ids.completion_token_ids[0]) == 8

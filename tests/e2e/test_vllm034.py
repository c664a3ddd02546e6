"""End to end on vLLM 0.34's serving code: what changed from 0.33 for vllm-nvext, on both releases.

The servers are each release's own `vllm serve` over a scripted engine core (scripts/vllm_harness.py):
0.33's in the main e2e run, 0.34's in a pytest run of its own (marker `e2e_vllm034`, `make
test-e2e-vllm034`). The translation, key-check and agent-route suites run on 0.34 too (the marker
`vllm_versions` of tests/e2e/test_translation.py and tests/e2e/test_versions.py lists it).
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_agent_routes import GREEDY, MESSAGES_BODY, NVEXT_IDS, RESPONSES_BODY
from tests.helpers import CHAT, http_client
from tests.support.refs import RELEASES
from tests.support.servers import version_server

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_versions("0.33", "0.34")]


def test_max_thinking_tokens_on_responses_is_vllms_thinking_budget_where_vllm_has_one(raw, translated, vllm_version):
    """vLLM 0.34's Responses API takes `thinking_token_budget`: `nvext.max_thinking_tokens` is sent as it, so the
    answer is vLLM's own to a root `thinking_token_budget` (these servers have no reasoning parser: vLLM's 400).
    On 0.33 it is refused, naming the field and the release; so it is through `vllm-nvext proxy`, which reads
    the release from its upstream's /version (docs/protocol.md §11.1)."""
    nvext = {**NVEXT_IDS["nvext"], "max_thinking_tokens": 3}
    got = translated.post("/v1/responses", json={**RESPONSES_BODY, "nvext": nvext})
    if vllm_version == "0.34":
        stock = raw.post("/v1/responses", json={**RESPONSES_BODY, "thinking_token_budget": 3})
        assert stock.status_code == 400 and "thinking_token_budget" in stock.json()["error"]["message"]
        assert (got.status_code, got.json()["error"]) == (stock.status_code, stock.json()["error"])
    else:
        error = got.json()["error"]
        assert got.status_code == 400 and error["param"] == "nvext.max_thinking_tokens"
        assert "vLLM 0.33.0's Responses API has no thinking budget" in error["message"], error


def test_metrics_say_the_release_serving_is_a_tested_one(vllm_version):
    """`vllm_nvext:vllm_version_tested{version}` is 1 on every mount of a release in the tested range (an
    untested one: 0, and a warning at start-up; tests/unit/test_vllm_compat.py)."""
    line = f'vllm_nvext:vllm_version_tested{{version="{RELEASES[vllm_version]}"}} 1.0'
    for role in ("mw", "plugin"):
        metrics = httpx.get(version_server(vllm_version, role).url + "/metrics", timeout=30).text
        assert line in metrics.splitlines(), (role, [m for m in metrics.splitlines() if "vllm_version" in m])


def test_an_empty_tools_array_on_chat_gets_this_releases_answer(raw, translated, vllm_version):
    """vLLM 0.34 takes `tools: []` as no tools (0.33: 400 naming `tools`): with ids asked, every mount answers
    as stock vLLM of the release does, the ids of its greedy answer or its own 400, unchanged."""
    body = {**MESSAGES_BODY, **GREEDY, "tools": []}
    got = translated.post(CHAT, json={**body, **NVEXT_IDS})
    stock = raw.post(CHAT, json={**body, "return_token_ids": True})
    if vllm_version == "0.33":
        assert got.status_code == stock.status_code == 400 and stock.json()["error"]["param"] == "tools"
        assert got.json()["error"] == stock.json()["error"]
        return
    assert got.status_code == stock.status_code == 200, got.text
    want = {"completion_token_ids": stock.json()["choices"][0]["token_ids"]}
    assert {"completion_token_ids": got.json()["nvext"]["completion_token_ids"]} == want
    assert got.json()["choices"][0]["message"]["content"] == stock.json()["choices"][0]["message"]["content"]


def test_anthropic_min_tokens_and_thinking_between_tools_pass_through_the_plugin(raw, vllm_version):
    """/v1/messages through the endpoint plugin: 0.34's Anthropic fields (`min_tokens`, `thinking:
    {"type": "between_tools"}`) reach vLLM, whose answer comes back with its ids; 0.33's 400 for the thinking
    type it lacks comes back as stock 0.33 gives it."""
    plugin = version_server(vllm_version, "plugin").url
    body = {**MESSAGES_BODY, **GREEDY, "min_tokens": 2, "thinking": {"type": "between_tools"}}
    with http_client(plugin) as client:
        got = client.post("/v1/messages", json={**body, **NVEXT_IDS})
    stock = raw.post("/v1/messages", json=body)
    if vllm_version == "0.33":
        assert got.status_code == stock.status_code == 400, (got.text, stock.text)
        assert got.json() == stock.json()
        return
    assert got.status_code == stock.status_code == 200, (got.text, stock.text)
    answer = got.json()
    assert answer["content"] == stock.json()["content"] and answer["usage"] == stock.json()["usage"]
    ids = answer["nvext"]["completion_token_ids"]
    assert len(ids) == answer["usage"]["output_tokens"] >= 2

"""End to end on vLLM 0.34's serving code: what changed from 0.33 for vllm-nvext, on both releases.

The servers are each release's own `vllm serve` over a scripted engine core (scripts/vllm_harness.py):
0.33's in the main e2e run, 0.34's in a pytest run of its own (marker `e2e_vllm034`, `make
test-e2e-vllm034`). The translation, key-check and agent-route suites run on 0.34 too (the marker
`vllm_versions` of tests/e2e/test_translation.py and tests/e2e/test_versions.py lists it).
"""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.test_agent_routes import NVEXT_IDS, RESPONSES_BODY
from tests.support.refs import RELEASES
from tests.support.servers import version_server

pytestmark = [pytest.mark.e2e, pytest.mark.vllm_versions("0.33", "0.34")]


def test_max_thinking_tokens_on_responses_is_vllms_thinking_budget_where_vllm_has_one(
    raw, translated, vllm_version, request
):
    """vLLM 0.34's Responses API takes `thinking_token_budget`: `nvext.max_thinking_tokens` is sent as it, so the
    answer is vLLM's own to a root `thinking_token_budget` (these servers have no reasoning parser: vLLM's 400).
    On 0.33 it is refused, naming the field; so it is through `vllm-nvext proxy`, which knows its upstream's
    rules from the vLLM installed beside it (.venv's 0.32), not from the upstream (docs/protocol.md §11.1)."""
    nvext = {**NVEXT_IDS["nvext"], "max_thinking_tokens": 3}
    got = translated.post("/v1/responses", json={**RESPONSES_BODY, "nvext": nvext})
    if vllm_version == "0.34" and request.node.callspec.params["translated"] != "proxy":
        stock = raw.post("/v1/responses", json={**RESPONSES_BODY, "thinking_token_budget": 3})
        assert stock.status_code == 400 and "thinking_token_budget" in stock.json()["error"]["message"]
        assert (got.status_code, got.json()["error"]) == (stock.status_code, stock.json()["error"])
    else:
        assert got.status_code == 400 and got.json()["error"]["param"] == "nvext.max_thinking_tokens"


def test_metrics_say_the_release_serving_is_a_tested_one(vllm_version):
    """`vllm_nvext:vllm_version_tested{version}` is 1 on every mount of a release in the tested range (an
    untested one: 0, and a warning at start-up; tests/unit/test_vllm_compat.py)."""
    line = f'vllm_nvext:vllm_version_tested{{version="{RELEASES[vllm_version]}"}} 1.0'
    for role in ("mw", "plugin"):
        metrics = httpx.get(version_server(vllm_version, role).url + "/metrics", timeout=30).text
        assert line in metrics.splitlines(), (role, [m for m in metrics.splitlines() if "vllm_version" in m])

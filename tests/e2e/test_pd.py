"""End to end through prefill/decode disaggregation: a real orchestrator, a real KV handoff on CPU.

vllm-router `--vllm-pd-disaggregation` fronts a prefill server (`--middleware`) and a decode server
(the plugin), both with the package's CPU KV connector (vllm_nvext/connectors/pd.py) over one
shared folder. The router sends the prefill server the client's body with `max_tokens: 1`,
`stream: false` and a root `kv_transfer_params: {"do_remote_decode": true, ...}`, reads the root
`kv_transfer_params` of its answer and sends the decode server the client's body with that object
as its root `kv_transfer_params`; the connector loads the prompt's KV cache only then. The proof
of each handoff is the decode server's own count of prompt tokens that came from
`external_kv_transfer` (vLLM's `vllm:prompt_tokens_by_source_total`), and the client gets, in its
own dialect, what one server gives. The router sends neither the client's `x-nvext-mode` nor its
`Authorization` to the servers; `test_prefill_answer_*` plays an orchestrator that forwards the
mode header. Out of process (marker `e2e_proxy`): `vllm-nvext proxy` in front of the same router
mode in front of a stock prefill and a stock decode server. A pytest run of its own (`make
test-e2e-scaleout`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.scaleout import prompt_tokens_by_source
from tests.helpers import (
    CHAT,
    COMPLETIONS,
    DIALECTS,
    MODEL_NAME,
    MODES,
    final_event,
    http_client,
    ids_of,
    nvext_placed,
    nvext_stream_ids,
    post,
    stream_digest,
    strip_volatile,
    without_nvext,
)

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_scaleout]

MAX_TOKENS = 8
# The prefill leg exactly as vllm-router 0.1.17 writes it (`kv_transfer_params` replaced, `min_tokens`
# added, `stream_options` dropped; recorded from its requests).
PREFILL_LEG = {
    "max_tokens": 1,
    "min_tokens": 1,
    "stream": False,
    "kv_transfer_params": {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    },
}


def _body(path: str, words: str, **extra: Any) -> dict[str, Any]:
    """A greedy request whose prompt spans more than one KV block (vLLM hands over full blocks)."""
    prompt = " ".join(f"{words}{i}" for i in range(40))
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return {**body, **extra}


@pytest.fixture(scope="session")
def prefill(pd_prefill_server) -> Iterator[httpx.Client]:
    with http_client(pd_prefill_server.url, timeout=300.0) as client:
        yield client


@pytest.fixture(scope="session")
def decode(pd_decode_server) -> Iterator[httpx.Client]:
    with http_client(pd_decode_server.url, timeout=300.0) as client:
        yield client


@pytest.fixture(scope="session")
def pd_router(pd_router_server, pd_prefill_server, pd_decode_server) -> Iterator[httpx.Client]:
    with http_client(pd_router_server.url, timeout=300.0) as client:
        yield client


@pytest.fixture(scope="session")
def block_size(pd_decode_server) -> int:
    """The decode server's KV block size, from vLLM's `vllm:cache_config_info`."""
    text = httpx.get(pd_decode_server.url + "/metrics", timeout=10).text
    match = re.search(r'^vllm:cache_config_info\{[^}]*block_size="(\d+)"', text, re.M)
    assert match, "vLLM reports its cache config"
    return int(match.group(1))


def _handed_over(prompt_tokens: int, block_size: int) -> int:
    """The prompt tokens a handoff carries: the full blocks before the last prompt token."""
    return (prompt_tokens - 1) // block_size * block_size


def _external(server) -> float:
    return prompt_tokens_by_source(server.url, "external_kv_transfer")


def _ids(path: str, answer: Any, dialect: str, mode: str = "auto") -> tuple[Any, list[int]]:
    """(prompt ids, completion ids) wherever this mode and dialect put them."""
    if not nvext_placed(mode, dialect):
        return ids_of(path, answer)
    if isinstance(answer, list):
        return final_event(answer)["nvext"]["prompt_token_ids"], nvext_stream_ids(answer)
    return answer["nvext"]["prompt_token_ids"], answer["nvext"]["completion_token_ids"]


def _without_usage(answer: Any) -> Any:
    """An answer less id, created and usage; a stream with its chunking forgotten."""
    if isinstance(answer, list):
        digest = stream_digest(without_nvext(answer))  # nvext ids per chunk: compared by `_ids`
        digest.pop("usage-only chunks")
        return digest
    return {k: v for k, v in strip_volatile(answer).items() if k != "usage"}


def _usage(answer: Any) -> dict[str, Any]:
    return (answer[-1] if isinstance(answer, list) else answer)["usage"]


def _handed_over_as_one_server(
    tag: str, front: httpx.Client, prefill: httpx.Client, decode_server: Any, block_size: int, path: str, dialect: str,
    stream: bool,
) -> tuple[Any, Any]:  # fmt: skip
    """One request through `front` (a PD fleet) and the same to `prefill` alone (no handoff): the decode
    server took the prompt's KV cache from its prefill server, and the client gets the ids and answer one
    server gives. Returns (the answer through the fleet, the one server's); `tag` starts the prompt."""
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = _body(path, f"{tag}{path[4]}{dialect}{int(stream)}w", **DIALECTS[dialect], **extra)
    want = post(prefill, path, body)
    before = _external(decode_server)
    got = post(front, path, body)
    assert _external(decode_server) - before == _handed_over(_usage(got)["prompt_tokens"], block_size) > 0, (
        "the decode server took the prompt's KV cache from its prefill server, not from its own compute"
    )
    assert _ids(path, got, dialect) == _ids(path, want, dialect), "the same ids, in the client's dialect"
    assert _without_usage(got) == _without_usage(want), "the same answer as one server gives, less usage"
    return got, want


# --- the whole flow through vllm-router -------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("dialect", ["vllm", "nvext", "both"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_router_pd_hands_the_prompt_over_and_answers_as_one_server(
    pd_router, prefill, pd_decode_server, block_size, path, dialect, stream
):
    fleet = (pd_router, prefill, pd_decode_server)
    got, want = _handed_over_as_one_server("pd", *fleet, block_size, path, dialect, stream)
    prompt_tokens = _usage(got)["prompt_tokens"]
    # vLLM reports the prefill server's prefix-cache hits as the decode's cached prompt tokens; the
    # prefill server had this prompt cached from `want`.
    cached = _usage(got)["prompt_tokens_details"]["cached_tokens"]
    assert _usage(want)["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached == _handed_over(prompt_tokens, block_size)


# --- out of process: vllm-nvext proxy in front of the PD router, in front of stock servers ----------


@pytest.fixture(scope="session")
def proxy_pd(proxy_pd_server) -> Iterator[httpx.Client]:
    with http_client(proxy_pd_server.url, timeout=300.0) as client:
        yield client


@pytest.mark.e2e_proxy
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("dialect", ["vllm", "nvext", "both"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_proxy_in_front_of_router_pd_hands_the_prompt_over_and_answers_as_one_server(
    proxy_pd, prefill, pd_stock_decode_server, block_size, path, dialect, stream
):
    """The proxy translates; the router and both servers are stock, and the handoff still happens."""
    _handed_over_as_one_server("px", proxy_pd, prefill, pd_stock_decode_server, block_size, path, dialect, stream)


# --- every mode: the prefill answer keeps its root kv_transfer_params -------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dialect", ["vllm", "nvext", "both"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_prefill_answer_keeps_root_kv_transfer_params_in_every_mode(
    prefill, decode, pd_decode_server, block_size, path, dialect, mode
):
    """An orchestrator that forwards the client's mode header: both legs by hand, as the router writes them."""
    headers = {"x-nvext-mode": mode}
    body = _body(path, f"m{mode}{dialect}{path[4]}w", **DIALECTS[dialect])
    want = post(prefill, path, body, headers)
    answer = post(prefill, path, {**body, **PREFILL_LEG}, headers)
    params = answer.get("kv_transfer_params")
    assert isinstance(params, dict) and params.get("do_remote_prefill") is True, (
        f"root kv_transfer_params where the orchestrator reads it, mode {mode}: {params!r}"
    )
    if nvext_placed(mode, dialect):
        assert answer["nvext"]["kv_transfer_params"] == params, "the nvext copy, where the trio goes under nvext"
    before = _external(pd_decode_server)
    got = post(decode, path, {**body, "kv_transfer_params": params}, headers)
    assert _external(pd_decode_server) - before == _handed_over(got["usage"]["prompt_tokens"], block_size) > 0
    assert _ids(path, got, dialect, mode) == _ids(path, want, dialect, mode)
    assert _without_usage(got) == _without_usage(want)
    # vLLM reports the prefill server's cache hits as the decode's cached prompt tokens.
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == params["remote_prefill_cached_tokens"]


# --- without the handoff the decode computes the prompt itself ---------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        None,  # what the router sends when the prefill answer had no root kv_transfer_params
        {"do_remote_prefill": True, "remote_key": "../../../../etc/passwd"},
        {"do_remote_prefill": True, "remote_key": "0" * 32},
        {"do_remote_prefill": "yes", "remote_key": None},
    ],
    ids=["null", "path", "other-prompt", "garbage"],
)
def test_decode_without_a_valid_handoff_computes_the_prompt(prefill, decode, pd_decode_server, params):
    body = _body(COMPLETIONS, f"nohandoff{params and str(params.get('remote_key'))[:2]}w", **DIALECTS["vllm"])
    want = post(prefill, COMPLETIONS, body)
    before = _external(pd_decode_server)
    got = post(decode, COMPLETIONS, {**body, "kv_transfer_params": params})
    assert _external(pd_decode_server) == before, "nothing loaded"
    assert ids_of(COMPLETIONS, got) == ids_of(COMPLETIONS, want)


def test_prefill_answer_of_another_prompt_is_not_loaded(prefill, decode, pd_decode_server):
    """A handoff names its prompt: the decode of a different prompt computes its own."""
    params = post(prefill, COMPLETIONS, {**_body(COMPLETIONS, "firstw"), **PREFILL_LEG})["kv_transfer_params"]
    body = _body(COMPLETIONS, "secondw", **DIALECTS["vllm"])
    want = post(prefill, COMPLETIONS, body)
    before = _external(pd_decode_server)
    got = post(decode, COMPLETIONS, {**body, "kv_transfer_params": params})
    assert _external(pd_decode_server) == before
    assert ids_of(COMPLETIONS, got) == ids_of(COMPLETIONS, want)

"""End to end behind vLLM's own load balancer: vllm-router in front of two vllm-nvext servers.

One server mounts the middleware (`--middleware`), the other the endpoint plugin
(`VLLM_PLUGINS=nvext`); two routers (`round_robin`, `cache_aware`) front both. The router forwards
the client's headers (`Authorization`, `x-nvext-mode`, `X-Request-Id`) and a re-serialized body
(vLLM's defaults such as `echo: false` written out): every answer must be the one the
`--middleware` server gives when asked directly. Out of process, the same tests (the `fleet`
params marked `e2e_proxy`) run through `vllm-nvext proxy` in front of a router in front of two
stock servers, and through a router in front of two proxies, each in front of one of them. A
pytest run of its own (`make test-e2e-scaleout`): four servers and four routers, never beside the
rest of the suite.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.helpers import (
    CHAT,
    COMPLETIONS,
    DIALECTS,
    MODES,
    final_event,
    greedy,
    http_client,
    nvext_placed,
    nvext_stream_ids,
    post,
    stream_digest,
    strip_volatile,
    without_nvext,
)
from tests.support.servers import boot_all as boot

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_scaleout, pytest.mark.reference]  # all behind vllm-router


@pytest.fixture(scope="session")
def router_rr(router_rr_server) -> Iterator[httpx.Client]:
    with http_client(router_rr_server.url) as client:
        yield client


@pytest.fixture(scope="session")
def router_ca(router_ca_server) -> Iterator[httpx.Client]:
    with http_client(router_ca_server.url) as client:
        yield client


# What a client talks to -> (that kind, the vLLM servers behind it). Out of process, each server stock:
# `vllm-nvext proxy` in front of vllm-router, and vllm-router in front of a proxy per server.
FLEETS = {
    "round_robin": ("router_rr", ("mw", "plugin")),
    "cache_aware": ("router_ca", ("mw", "plugin")),
    "proxy-router": ("proxy_router", ("raw", "raw2")),
    "router-proxies": ("router_proxies", ("raw", "raw2")),
}


@dataclass(frozen=True)
class Fleet:
    url: str
    client: httpx.Client
    servers: tuple[Any, ...]  # the vLLM servers behind it, whose counters the tests read


@pytest.fixture(scope="session")
def _fleets_started(request: pytest.FixtureRequest) -> None:
    """Every fleet the selected tests use starts at once, in the background, at the first one's use."""
    params = {item.callspec.params.get("fleet") for item in request.session.items if hasattr(item, "callspec")}
    boot(*(FLEETS[p][0] for p in sorted(params - {None})))


@pytest.fixture(
    scope="session",
    params=[
        "round_robin",
        "cache_aware",
        pytest.param("proxy-router", marks=[pytest.mark.e2e_proxy]),
        pytest.param("router-proxies", marks=[pytest.mark.e2e_proxy]),
    ],
)
def fleet(request: pytest.FixtureRequest, _fleets_started: None) -> Iterator[Fleet]:
    front, behind = FLEETS[request.param]
    url = request.getfixturevalue(f"{front}_server").url
    with http_client(url) as client:
        yield Fleet(url, client, tuple(request.getfixturevalue(f"{name}_server") for name in behind))


@pytest.fixture(scope="session")
def router(fleet: Fleet) -> httpx.Client:
    return fleet.client


def _served(url: str) -> float:
    """How many requests this vLLM server finished (`vllm:request_success_total`, all reasons)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def _same(path: str, got, want) -> None:
    """The router's answer is the direct one: whole (less id/created), or a stream up to its chunking."""
    if isinstance(want, list):
        # `nvext.completion_token_ids` are each chunk's own ids: compared concatenated.
        assert stream_digest(without_nvext(got)) == stream_digest(without_nvext(want))
        if any("nvext" in e for e in want):
            assert nvext_stream_ids(got) == nvext_stream_ids(want)
            got_final, want_final = final_event(got)["nvext"], final_event(want)["nvext"]
            assert set(got_final) == set(want_final)
            assert got_final.get("prompt_token_ids") == want_final.get("prompt_token_ids")
    else:
        assert strip_volatile(got) == strip_volatile(want)


# --- both dialects, unary and stream, through both policies ---------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("dialect", ["vllm", "nvext", "both"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_router_answers_as_one_server(router, fleet, mw, path, dialect, stream):
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = {**greedy(path), **DIALECTS[dialect], **extra}
    want = post(mw, path, body)
    before = sum(_served(server.url) for server in fleet.servers)
    answers = [post(router, path, body) for _ in range(2)]
    for got in answers:
        _same(path, got, want)
    assert sum(_served(server.url) for server in fleet.servers) - before == 2, "each request served once"


def test_round_robin_spreads_requests_over_both_servers(router_rr, mw_server, plugin_server):
    body = {**greedy(COMPLETIONS), **DIALECTS["nvext"]}
    before = (_served(mw_server.url), _served(plugin_server.url))
    for _ in range(4):
        post(router_rr, COMPLETIONS, body)
    after = (_served(mw_server.url), _served(plugin_server.url))
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2), "round_robin: two requests to each mount"


def test_cache_aware_keeps_a_prompt_on_one_server(router_ca, mw, mw_server, plugin_server):
    body = {
        **greedy(COMPLETIONS, prompt="A prompt the cache-aware router remembers, word for word."),
        **DIALECTS["both"],
    }
    want = post(mw, COMPLETIONS, body)
    before = (_served(mw_server.url), _served(plugin_server.url))
    for _ in range(4):
        _same(COMPLETIONS, post(router_ca, COMPLETIONS, body), want)
    delta = sorted((_served(mw_server.url) - before[0], _served(plugin_server.url) - before[1]))
    assert delta == [0, 4], "cache_aware: the same prompt goes to the server that has its prefix"


# --- n > 1 and the mode header ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS], ids=["chat", "completions"])
def test_several_choices_in_vllm_placement(router, mw, path, stream):
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    # Seeded sampling (vLLM refuses n > 1 when greedy): the same choices from any server.
    body = {**greedy(path), "n": 3, "temperature": 0.8, "seed": 11, "ignore_eos": True, **DIALECTS["vllm"], **extra}
    want = post(mw, path, body)
    got = post(router, path, body)
    _same(path, got, want)
    events = got if stream else [got]
    per_choice: dict[int, list[int]] = {}
    for event in events:
        for choice in event["choices"]:
            per_choice.setdefault(choice["index"], []).extend(choice.get("token_ids") or [])
    assert sorted(per_choice) == [0, 1, 2]
    assert all(len(ids) == body["max_tokens"] for ids in per_choice.values()), "every choice's ids"
    assert all("nvext" not in e for e in events), "vLLM placement: nothing under nvext"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dialect", ["vllm", "nvext"])
def test_mode_header_reaches_the_servers(router, mw, mode, dialect):
    body = {**greedy(CHAT), **DIALECTS[dialect]}
    headers = {"x-nvext-mode": mode}
    want = post(mw, CHAT, body, headers)
    got = post(router, CHAT, body, headers)
    _same(CHAT, got, want)
    if nvext_placed(mode, dialect):
        assert len(got["nvext"]["completion_token_ids"]) == body["max_tokens"]
    else:
        assert "nvext" not in got and len(got["choices"][0]["token_ids"]) == body["max_tokens"]


# --- the router passes the servers' refusals through -------------------------------------------------


def test_refusals_pass_through_the_router(fleet):
    body = {**greedy(CHAT), **DIALECTS["vllm"]}
    assert httpx.post(fleet.url + CHAT, json=body, timeout=60).status_code == 401, "no key, no answer"
    with http_client(fleet.url) as client:
        for _ in range(2):  # both servers
            bad = client.post(CHAT, json={**greedy(CHAT), "nvext": {"extra_fields": 3}})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "nvext.extra_fields"


# --- a client gone mid-stream -------------------------------------------------------------------


def _requests_in_engine(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_client_gone_mid_stream_then_router_and_servers_still_serve(router, fleet, mw):
    body = {**greedy(COMPLETIONS), "max_tokens": 600, "ignore_eos": True, "stream": True, **DIALECTS["nvext"]}
    for _ in range(2):  # one stream cut on each server (round_robin)
        with router.stream("POST", COMPLETIONS, json=body) as resp:
            assert resp.status_code == 200
            for chunk in resp.iter_bytes():
                if b"completion_token_ids" in chunk:
                    break  # leave with the stream open: the client is gone
    deadline = time.monotonic() + 180
    while sum(_requests_in_engine(server.url) for server in fleet.servers) > 0:
        assert time.monotonic() < deadline, "the cut streams still hold the engines"
        time.sleep(0.5)
    small = {**greedy(COMPLETIONS), **DIALECTS["nvext"], "stream": True}
    want = nvext_stream_ids(post(mw, COMPLETIONS, small))
    for _ in range(2):
        assert nvext_stream_ids(post(router, COMPLETIONS, small)) == want

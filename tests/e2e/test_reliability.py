"""End to end: nothing lost, nothing garbled, nobody let in; under load, disconnects and scale-out."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import httpx
import pytest

from tests.helpers import (
    API_KEY,
    BASE,
    CHAT,
    COMPLETIONS,
    DIALECTS,
    MODES,
    nvext_placed,
    post,
    sse_events,
    strip_volatile,
)

pytestmark = pytest.mark.e2e

PROMPTS = [
    f"Prompt number {i}: tell a story about {w}."
    for i, w in enumerate(["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"])
]
MAX_TOKENS = 12


def _body(path: str, prompt: str, stream: bool) -> dict:
    body = {"model": "tiny", "max_tokens": MAX_TOKENS, "temperature": 0}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
    return body


def _stream_ids(events: list[dict], mode: str, dialect: str) -> list[int]:
    key = "nvext" if nvext_placed(mode, dialect) else None
    ids: list[int] = []
    for event in events:
        if event.get("choices"):
            ids += (event[key]["completion_token_ids"] if key else event["choices"][0].get("token_ids")) or []
    return ids


@pytest.fixture(scope="session")
def reference_ids(raw) -> dict[tuple[str, str], list[int]]:
    """Unary greedy ids of every (endpoint, prompt) from stock vLLM."""
    out = {}
    for path in (CHAT, COMPLETIONS):
        for prompt in PROMPTS:
            got = post(raw, path, {**_body(path, prompt, False), "return_token_ids": True})
            out[(path, prompt)] = got["choices"][0]["token_ids"]
    return out


async def _load(url: str, reference, requests: int, concurrency: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    jobs = [
        (rng.choice((CHAT, COMPLETIONS)), rng.choice(PROMPTS), rng.choice(list(DIALECTS)), rng.choice(MODES))
        for _ in range(requests)
    ]  # fmt: skip
    failures: list[str] = []
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers, limits=limits) as client:

        async def one(path, prompt, dialect, mode):
            async with gate:
                body = {**_body(path, prompt, True), **DIALECTS[dialect]}
                resp = await client.post(path, json=body, headers={"x-nvext-mode": mode})
                if resp.status_code != 200:
                    failures.append(f"{path} {dialect}/{mode}: HTTP {resp.status_code} {resp.text[:200]}")
                    return
                ids = _stream_ids(sse_events(resp.content), mode, dialect)
                if ids != reference[(path, prompt)]:
                    failures.append(f"{path} {dialect}/{mode} {prompt!r}: {ids} != {reference[(path, prompt)]}")

        await asyncio.gather(*(one(*job) for job in jobs))
    return failures


def test_64_concurrent_streams_mixing_dialects_and_modes_have_no_cross_talk(mw_server, reference_ids):
    failures = asyncio.run(_load(mw_server.url, reference_ids, requests=320, concurrency=64, seed=1))
    assert failures == [], f"{len(failures)} of 320 streams wrong; first: {failures[:3]}"


def test_scale_out_with_two_api_server_processes(scale_server, reference_ids, scale):
    failures = asyncio.run(_load(scale_server.url, reference_ids, requests=128, concurrency=32, seed=2))
    assert failures == [], f"{len(failures)} of 128 streams wrong; first: {failures[:3]}"
    bad = scale.post(CHAT, json={**BASE[CHAT], "nvext": {"extra_fields": 3}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "nvext.extra_fields"
    assert httpx.post(scale_server.url + CHAT, json={**BASE[CHAT], "return_token_ids": True}).status_code == 401


# --- client disconnects ---------------------------------------------------------------------


def _requests_in_engine(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def _engine_idle(url: str, timeout: float = 120.0) -> bool:
    """Wait until the engine holds no request (aborts reach it asynchronously); False on timeout."""
    deadline = time.monotonic() + timeout
    while _requests_in_engine(url) > 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _log_size(server) -> int:
    return server.log_path.stat().st_size


def _log_since(server, offset: int) -> str:
    """The server's output after byte `offset` (a byte offset: characters may span reads)."""
    with open(server.log_path, "rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


async def _cut_streams(host: str, port: int, count: int, seed: int) -> None:
    rng = random.Random(seed)

    async def one(i: int) -> None:
        path = CHAT if i % 2 else COMPLETIONS
        body = json.dumps(
            {**_body(path, PROMPTS[i % len(PROMPTS)], True), "max_tokens": 300, "ignore_eos": True,
             **DIALECTS[("vllm", "nvext", "both")[i % 3]]}
        ).encode()  # fmt: skip
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        want = rng.randint(0, 6000)  # cut anywhere: before the headers, mid-event, mid-stream
        got = 0
        while got < want:
            chunk = await reader.read(rng.randint(1, 512))
            if not chunk:
                break
            got += len(chunk)
        writer.transport.abort()

    for start in range(0, count, 20):
        await asyncio.gather(*(one(i) for i in range(start, min(count, start + 20))))


def test_client_disconnects_abort_requests_and_leak_nothing(mw_server, mw):
    server = mw_server
    asyncio.run(_cut_streams(server.host, server.port, 40, seed=3))  # warm-up
    assert _engine_idle(server.url), "vLLM must abort the requests of clients that went away"
    before = _rss_kib(server.proc.pid)
    log_start = _log_size(server)
    asyncio.run(_cut_streams(server.host, server.port, 100, seed=4))
    assert _engine_idle(server.url), "vLLM must abort the requests of clients that went away"
    grown = _rss_kib(server.proc.pid) - before
    assert grown < 64 * 1024, f"API server grew by {grown} KiB over 100 cut streams"
    log = _log_since(server, log_start)
    assert "vllm_nvext" not in log and "Traceback" not in log, log[-3000:]
    ok = post(mw, COMPLETIONS, {**_body(COMPLETIONS, PROMPTS[0], False), "return_token_ids": True})
    assert len(ok["choices"][0]["token_ids"]) == MAX_TOKENS


# --- security ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mw", "plugin"])
@pytest.mark.parametrize(
    "body",
    [
        {"return_token_ids": True},
        {"nvext": {"extra_fields": ["completion_token_ids"]}},
        {"nvext": {"extra_fields": "garbage"}},  # would be our 400: auth must come first
        {"nvext": "garbage"},
    ],
)
def test_requests_without_the_api_key_are_refused_untranslated(mw_server, plugin_server, name, body):
    url = {"mw": mw_server, "plugin": plugin_server}[name].url + COMPLETIONS
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        resp = httpx.post(url, json={**BASE[COMPLETIONS], **body}, headers=headers, timeout=30)
        assert resp.status_code == 401 and resp.json() == {"error": "Unauthorized"}
    bad_header = httpx.post(url, json=BASE[COMPLETIONS], headers={"x-nvext-mode": "nope"}, timeout=30)
    assert bad_header.status_code == 401


def test_prompts_and_ids_are_never_logged(mw_server, mw):
    marker = "secret-prompt-4f1d9"
    got = post(mw, COMPLETIONS, {**_body(COMPLETIONS, marker, False), "nvext": {"extra_fields": ["engine_data"]}})
    ids = got["nvext"]["engine_data"]["completion_token_ids"]
    log = mw_server.log_text()
    assert marker not in log
    assert json.dumps(ids) not in log and ",".join(map(str, ids)) not in log


def test_other_routes_are_identical_to_raw_vllm(mw, raw):
    for path in ("/v1/models", "/version", "/health"):
        got, expected = mw.get(path), raw.get(path)
        assert got.status_code == expected.status_code == 200
        if path == "/v1/models":  # ids and timestamps differ per server; the listing must not
            keep = ("id", "object", "owned_by", "root", "max_model_len")
            assert [{k: m[k] for k in keep} for m in got.json()["data"]] == [
                {k: m[k] for k in keep} for m in expected.json()["data"]
            ]
        else:
            assert got.content == expected.content
    tokenize = {"model": "tiny", "prompt": "hello", "return_token_ids": True}
    assert mw.post("/tokenize", json=tokenize).json() == raw.post("/tokenize", json=tokenize).json()


def test_body_size_cap_is_enforced_on_the_real_server(mw):
    huge = {**BASE[COMPLETIONS], "prompt": "x" * (33 * 1024 * 1024), "return_token_ids": True}
    resp = mw.post(COMPLETIONS, json=huge)
    assert resp.status_code == 413 and "limit" in resp.json()["error"]["message"]
    assert strip_volatile(post(mw, COMPLETIONS, {**BASE[COMPLETIONS], "temperature": 0}))["choices"]


# --- bad input matrix -------------------------------------------------------------------------

_GOOD = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": 0}
# (json body or raw bytes, extra headers, expected status, the field the error must name)
BAD_INPUTS = [
    ({"return_token_ids": "maybe"}, {}, 400, "return_token_ids"),  # "true" and 1 are true to vLLM
    ({"return_token_ids": 2}, {}, 400, "return_token_ids"),
    ({"return_token_ids": []}, {}, 400, "return_token_ids"),
    ({"nvext": "x"}, {}, 400, "nvext"),
    ({"nvext": 5}, {}, 400, "nvext"),
    ({"nvext": []}, {}, 400, "nvext"),
    ({"nvext": {"extra_fields": "completion_token_ids"}}, {}, 400, "nvext.extra_fields"),
    ({"nvext": {"extra_fields": [None]}}, {}, 400, "nvext.extra_fields"),
    ({"nvext": {"extra_fields": [["completion_token_ids"]]}}, {}, 400, "nvext.extra_fields"),
    ({"nvext": {"greed_sampling": "yes"}}, {}, 400, "nvext.greed_sampling"),
    ({"nvext": {"use_raw_prompt": 0}}, {}, 400, "nvext.use_raw_prompt"),
    ({"nvext": {"annotations": [1]}}, {}, 400, "nvext.annotations"),
    ({"nvext": {"backend_instance_id": -1}}, {}, 400, "nvext.backend_instance_id"),
    ({"nvext": {"token_data": [1.5]}}, {}, 400, "nvext.token_data"),
    ({"nvext": {"token_data": []}}, {}, 400, "nvext.token_data"),
    ({"nvext": {"max_thinking_tokens": "10"}}, {}, 400, "nvext.max_thinking_tokens"),
    ({"nvext": {"cache_salt": ["a"]}}, {}, 400, "nvext.cache_salt"),
    ({"nvext": {"metadata_upload": {"url": ""}}}, {}, 400, "nvext.metadata_upload.url"),
    ({"nvext": {"metadata_upload": {"uri": "x"}}}, {}, 400, "nvext.metadata_upload.uri"),
    ({"nvext": {"prefill_worker_id": "1"}}, {}, 400, "nvext.prefill_worker_id"),
    ({"nvext": {"decode_worker_id": True}}, {}, 400, "nvext.decode_worker_id"),
    ({"nvext": {"dp_rank": -2}}, {}, 400, "nvext.dp_rank"),
    ({"nvext": {"prefill_dp_rank": 0.5}}, {}, 400, "nvext.prefill_dp_rank"),
    ({"nvext": {"agent_hints": {"osl": "long"}}}, {}, 400, "nvext.agent_hints.osl"),
    ({"nvext": {"agent_hints": {"nested": {"deep": [1, {"x": None}]}}}}, {}, 400, "nvext.agent_hints.nested"),
    ({"nvext": {"request_timestamp_ms": "now"}}, {}, 400, "nvext.request_timestamp_ms"),
    (
        {"nvext": {"routing_constraints": {"required_taints": "gpu"}}},
        {},
        400,
        "nvext.routing_constraints.required_taints",
    ),
    ({"nvext": {"router": {"ttft_target": "fast"}}}, {}, 400, "nvext.router.ttft_target"),
    ({"nvext": {"completion_token_ids": True}}, {}, 400, "nvext.completion_token_ids"),
    ({"n": 3, "temperature": 1, "nvext": {"extra_fields": ["completion_token_ids"]}}, {}, 400, "n"),
    ({"prompt": ["a", "b"], "return_token_ids": True}, {"x-nvext-mode": "nvext"}, 400, "prompt"),
    ({"return_token_ids": True}, {"x-nvext-mode": "dynamo"}, 400, "x-nvext-mode"),
    ({"return_token_ids": True, "prompt": "x" * (33 * 1024 * 1024)}, {}, 413, None),
    (b'{"model": "tiny", "prompt": "hi", "nvext": {"extra_fields": ["completion_token_ids"]', {}, 400, "body"),
    (b"\xff\xfe not json at all", {}, 400, "body"),
]


@pytest.mark.parametrize(
    ("body", "headers", "status", "param"), BAD_INPUTS, ids=[str(i) for i in range(len(BAD_INPUTS))]
)
def test_bad_input_matrix_on_the_real_server(mw, body, headers, status, param):
    if isinstance(body, bytes):
        resp = mw.post(COMPLETIONS, content=body, headers={"Content-Type": "application/json", **headers})
    else:
        resp = mw.post(COMPLETIONS, json={**_GOOD, **body}, headers=headers)
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] is not None and error["param"].startswith(param), error
    good = post(mw, COMPLETIONS, {**_GOOD, "return_token_ids": True})
    assert len(good["choices"][0]["token_ids"]) == 2, "the next good request is answered correctly"


def test_non_json_content_type_reaches_vllm_untouched(mw, raw):
    body = json.dumps({**_GOOD, "nvext": {"extra_fields": ["completion_token_ids"]}})
    got = mw.post(COMPLETIONS, content=body, headers={"Content-Type": "text/plain"})
    expected = raw.post(COMPLETIONS, content=body, headers={"Content-Type": "text/plain"})
    assert got.status_code == expected.status_code
    assert strip_volatile(got.json()) == strip_volatile(expected.json())

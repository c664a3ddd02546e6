"""Capture under load and failure (docs/capture.md, the store), on vLLM 0.32's real engine.

- 200 concurrent streams of one session, captured by the `--middleware` mount: the store holds 200
  turns, indexed 0-199, one per answer the clients got, none dropped.
- A full store (`VLLM_NVEXT_CAPTURE_MAX_BYTES=1`, `vllm-nvext proxy --capture` in front of a stock
  server): every turn is dropped and counted on /metrics
  (`vllm_nvext:capture_turns_dropped_total{reason="store_full"}`), and every client gets the answer the
  stock server behind it gives with capture off.
- A SIGKILLed server (the whole process group, streams in flight): the turns read back before the kill
  are in the SQLite file after it, read by `vllm-nvext sessions export`, and `PRAGMA integrity_check` is ok.

Marker e2e_parser: the parser group's pytest run (make test-e2e's second run).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import httpx
import pytest

from tests.e2e.capture_loops import read_session
from tests.helpers import API_KEY, CHAT, COMPLETIONS, MODEL_NAME, http_client, post, stream_digest, strip_volatile
from vllm_nvext.capture.sqlite_store import sqlite_path

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_parser]

STREAMS = 200
MAX = 8


def _metric(url: str, name: str, labels: str = "") -> float:
    """A `vllm_nvext:*` counter's value on the server's /metrics (0 before its first count)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*{re.escape(labels)}[^}}]*\}})? ([0-9.e+]+)$"
    return sum(float(v) for v in re.findall(pattern, text, re.M))


# --- 200 concurrent streams ------------------------------------------------------------------------------


async def _streams(url: str, session_id: str) -> list[list[dict[str, Any]]]:
    """STREAMS chat streams at once, each its events as the client read them."""
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=0)
    headers = {"Authorization": f"Bearer {API_KEY}", "x-nvext-session-id": session_id}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def one(n: int) -> list[dict[str, Any]]:
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Stream {n}."}], "max_tokens": MAX,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
            answer = await client.post(CHAT, json=body)
            assert answer.status_code == 200, answer.text
            return [json.loads(line[6:]) for line in answer.text.split("\n\n") if line.startswith("data: {")]

        return list(await asyncio.gather(*(one(n) for n in range(STREAMS))))


def test_200_concurrent_streams_lose_no_turn(capture_mw_server):
    url, session_id = capture_mw_server.url, f"load-{uuid.uuid4()}"
    recorded = _metric(url, "vllm_nvext:capture_turns_recorded_total")
    dropped = _metric(url, "vllm_nvext:capture_turns_dropped_total")
    streams = asyncio.run(_streams(url, session_id))
    answers = {events[0]["id"]: events for events in streams}
    assert len(answers) == STREAMS
    for events in streams:  # capture is invisible: no ids in what the clients read
        assert all(c.get("token_ids") is None for e in events for c in e.get("choices", []))
    turns = read_session(url, session_id, STREAMS, wait_s=120)["turns"]
    assert [t["index"] for t in turns] == list(range(STREAMS)), "every stream a turn, each index once"
    assert sorted(t["request_id"] for t in turns) == sorted(answers)
    for turn in turns:
        usage = answers[turn["request_id"]][-1]["usage"]
        assert len(turn["completion_token_ids"]) == usage["completion_tokens"]
        assert len(turn["prompt_token_ids"]) == usage["prompt_tokens"]
    assert _metric(url, "vllm_nvext:capture_turns_recorded_total") - recorded == STREAMS
    assert _metric(url, "vllm_nvext:capture_turns_dropped_total") == dropped, "no turn dropped"


# --- a full store --------------------------------------------------------------------------------------


BODIES = {
    "chat": (CHAT, {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hello."}]}),
    "completions": (COMPLETIONS, {"model": MODEL_NAME, "prompt": "Once upon a time"}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("route", sorted(BODIES))
def test_a_full_store_drops_and_counts_and_every_client_gets_its_answer(
    proxy_full_server, capture_stock_server, route, stream
):
    path, base = BODIES[route]
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = {**base, "max_tokens": MAX, "temperature": 0, **extra}
    headers = {"x-nvext-session-id": f"full-{uuid.uuid4()}"}
    url = proxy_full_server.url
    full = _metric(url, "vllm_nvext:capture_turns_dropped_total", 'reason="store_full"')
    recorded = _metric(url, "vllm_nvext:capture_turns_recorded_total")
    with http_client(url) as captured, http_client(capture_stock_server.url) as stock:
        for _ in range(3):
            got, want = post(captured, path, body, headers), post(stock, path, body, headers)
            if stream:
                assert stream_digest(got) == stream_digest(want)
            else:
                assert strip_volatile(got) == strip_volatile(want)
    deadline = time.monotonic() + 30
    while _metric(url, "vllm_nvext:capture_turns_dropped_total", 'reason="store_full"') - full < 3:
        assert time.monotonic() < deadline, "three turns dropped as store_full"
        time.sleep(0.2)
    assert _metric(url, "vllm_nvext:capture_turns_dropped_total", 'reason="store_full"') - full == 3
    assert _metric(url, "vllm_nvext:capture_turns_recorded_total") == recorded, "none recorded"
    with http_client(url) as client:
        assert client.get(f"/v1/nvext/sessions/{headers['x-nvext-session-id']}").status_code == 404


# --- a killed server -----------------------------------------------------------------------------------


def _in_flight(url: str, session_id: str, started: threading.Semaphore) -> None:
    """A long stream that is under way (its first chunk read) when the server is killed."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 500,
            "ignore_eos": True, "temperature": 0, "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}", "x-nvext-session-id": session_id}
    try:
        with httpx.stream("POST", url + CHAT, json=body, headers=headers, timeout=120) as answer:
            chunks = answer.iter_raw()
            next(chunks)
            started.release()
            for _ in chunks:
                pass
    except httpx.HTTPError:
        pass  # the server went away mid-stream, as it should


def _export(store: str) -> dict[str, list[dict[str, Any]]]:
    """Every session in the store, as `vllm-nvext sessions export` writes it for a trainer."""
    out = subprocess.run(
        [sys.executable, "-m", "vllm_nvext.tools.cli", "sessions", "export", "--store", store],
        capture_output=True,
        check=True,
        timeout=120,
    ).stdout
    return {doc["session_id"]: doc["turns"] for doc in map(json.loads, out.decode().splitlines())}


def test_a_killed_server_keeps_every_turn_read_back_before_the_kill(capture_kill_server):
    server, kept, flying = capture_kill_server, f"kept-{uuid.uuid4()}", f"flying-{uuid.uuid4()}"
    store = server.env["VLLM_NVEXT_CAPTURE"]
    with http_client(server.url) as client:
        for n in range(3):
            body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Turn {n}."}], "max_tokens": MAX}
            post(client, CHAT, {**body, "temperature": 0}, {"x-nvext-session-id": kept})
    before = read_session(server.url, kept, 3, wait_s=120)["turns"]
    assert len(before) == 3
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_in_flight, args=(server.url, flying, started)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for _ in threads:
        assert started.acquire(timeout=120), "every stream under way"
    os.killpg(server.proc.pid, signal.SIGKILL)  # the API server and its engine, at once
    server.proc.wait(30)
    for thread in threads:
        thread.join(60)
    db = sqlite3.connect(sqlite_path(store))
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        db.close()
    after = _export(store)
    assert after[kept] == before, "every turn read back before the kill, as it was"

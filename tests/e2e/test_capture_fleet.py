"""Capture in a fleet (docs/capture.md, Redis): several processes record one session into one real redis-server.

- Two vLLM replicas (the `--middleware` mount and the plugin), capturing to the same redis-server, behind
  vllm-router's round_robin: one session's turns land on both (each replica's own
  `vllm:request_success_total` says how many it served) and either replica's read API gives the whole
  session, every turn once, indexed in order.
- `vllm-nvext proxy --workers 2 --capture redis://...` in front of the stock server: the session's turns
  come from both worker processes (each worker's own counter file, PROMETHEUS_MULTIPROC_DIR) and are
  read back whole through the proxy.

Marker e2e_scaleout, in test_router.py's pytest run (`make test-e2e-scaleout`, which runs `make setup-redis`).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.capture_loops import read_session
from tests.helpers import API_KEY, CHAT, MODEL_NAME, http_client, post

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_scaleout, pytest.mark.reference]

TURNS = 6
MAX = 6


def _served(url: str) -> float:
    """How many requests this vLLM server finished (`vllm:request_success_total`, all reasons)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$", text, re.M))


def _assert_turn_is_the_answer(turn: dict[str, Any], answer: dict[str, Any], asked_ids: bool) -> None:
    """A captured turn holds what the client's answer says: its id, its finish, as many ids as vLLM counted."""
    choice = answer["choices"][0]
    assert turn["request_id"] == answer["id"]
    assert turn["finish_reason"] == choice["finish_reason"]
    assert len(turn["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
    assert len(turn["completion_token_ids"]) == answer["usage"]["completion_tokens"]
    if asked_ids:  # the client asked vLLM for the ids: the very ones it got
        assert turn["prompt_token_ids"] == answer["prompt_token_ids"]
        assert turn["completion_token_ids"] == choice["token_ids"]
    else:  # capture is invisible: no ids in the answer
        assert "prompt_token_ids" not in answer or answer["prompt_token_ids"] is None
        assert choice.get("token_ids") is None


@pytest.fixture(scope="module")
def fleet(router_fleet_server: Any, fleet_mw_server: Any, fleet_plugin_server: Any) -> Iterator[Any]:
    yield router_fleet_server, (fleet_mw_server, fleet_plugin_server)


def test_a_session_served_by_two_replicas_is_read_back_whole_from_either(fleet):
    router, replicas = fleet
    session_id = f"fleet-{uuid.uuid4()}"
    headers = {"x-nvext-session-id": session_id}
    before = [_served(r.url) for r in replicas]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Name a city."}]
    answers = []
    # Half the turns ask vLLM for ids (return_token_ids), half ask for nothing; round_robin alternates replicas.
    asked = [True, True, False, False, True, False]
    with http_client(router.url) as client:
        for turn in range(TURNS):
            body = {"model": MODEL_NAME, "messages": messages, "max_tokens": MAX, "temperature": 0}
            answer = post(client, CHAT, {**body, **({"return_token_ids": True} if asked[turn] else {})}, headers)
            answers.append(answer)
            reply = answer["choices"][0]["message"]["content"]
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"And turn {turn}?"}]
    served = [_served(r.url) - b for r, b in zip(replicas, before, strict=True)]
    assert sum(served) == TURNS and min(served) >= 1, f"the session's turns on both replicas: {served}"
    sessions = [read_session(r.url, session_id, TURNS) for r in replicas]
    assert sessions[0] == sessions[1], "either replica reads the same session from the shared store"
    turns = sessions[0]["turns"]
    assert [t["index"] for t in turns] == list(range(TURNS)) and sessions[0]["next_index"] is None
    by_request = {t["request_id"]: t for t in turns}
    assert len(by_request) == TURNS, "every turn once"
    for answer, asked_ids in zip(answers, asked, strict=True):
        turn = by_request[answer["id"]]
        assert (turn["session_id"], turn["session_source"]) == (session_id, "x-nvext-session-id")
        _assert_turn_is_the_answer(turn, answer, asked_ids)


# --- vllm-nvext proxy --workers 2 --capture redis://... ---------------------------------------------------


def _recorded_per_worker(folder: str) -> dict[int, float]:
    """Each proxy worker's own `vllm_nvext:capture_turns_recorded_total`, from its counter file (by pid)."""
    from prometheus_client.mmap_dict import MmapedDict

    counts: dict[int, float] = {}
    for path in Path(folder).glob("counter_*.db"):
        for key, value, _, _ in MmapedDict.read_all_values_from_file(str(path)):
            if json.loads(key)[1] == "vllm_nvext:capture_turns_recorded_total":
                pid = int(path.stem.removeprefix("counter_"))
                counts[pid] = counts.get(pid, 0.0) + value
    return counts


def _one_turn(url: str, session_id: str, n: int) -> tuple[dict[str, Any], bool]:
    """One turn on a connection of its own (`Connection: close`): the kernel hands it to either worker. Odd
    turns ask vLLM for ids; (the answer, whether it asked)."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Count to {n}."}], "max_tokens": MAX,
            "temperature": 0, **({"return_token_ids": True} if n % 2 else {})}  # fmt: skip
    headers = {"x-nvext-session-id": session_id, "Connection": "close"}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as client:
        return dict(post(client, CHAT, body, headers)), bool(n % 2)


def test_a_session_recorded_by_two_proxy_workers_is_read_back_whole(proxy_workers_server):
    folder = proxy_workers_server.env["PROMETHEUS_MULTIPROC_DIR"]
    session_id = f"workers-{uuid.uuid4()}"
    before = _recorded_per_worker(folder)
    answers: list[tuple[dict[str, Any], bool]] = []
    # Rounds of 8 concurrent turns, each on a new connection, until both workers have recorded some of them.
    with ThreadPoolExecutor(8) as pool:
        for _ in range(10):
            answers += pool.map(lambda n: _one_turn(proxy_workers_server.url, session_id, n), range(len(answers),
                                len(answers) + 8))  # fmt: skip
            deadline = time.monotonic() + 30
            while True:
                now = _recorded_per_worker(folder)
                delta = {pid: now[pid] - before.get(pid, 0.0) for pid in now}
                if sum(delta.values()) >= len(answers) or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if len([d for d in delta.values() if d > 0]) >= 2:
                break
    assert sum(delta.values()) == len(answers), "every turn recorded once"
    assert len([d for d in delta.values() if d > 0]) == 2, f"both workers recorded turns of the session: {delta}"
    session = read_session(proxy_workers_server.url, session_id, len(answers))
    turns = session["turns"]
    assert [t["index"] for t in turns] == list(range(len(answers))) and session["next_index"] is None
    by_request = {t["request_id"]: t for t in turns}
    assert sorted(by_request) == sorted(a["id"] for a, _ in answers), "every turn once"
    for answer, asked_ids in answers:
        _assert_turn_is_the_answer(by_request[answer["id"]], answer, asked_ids)

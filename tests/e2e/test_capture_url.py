"""Sessions by URL and agent threads on vLLM 0.32's real engine (docs/capture.md: Sessions by URL, Session keys).

A harness given the base URL `.../nvext/sessions/{id}/v1` reaches every route vLLM serves under it (`/v1/models`
too), its turns recorded in that session before any header names one, under the key check of the route it names:
on `--middleware`, on the plugin (vLLM's key check runs before it and sees the prefixed path), on both mounts, and
through `vllm-nvext proxy` (in front of a stock server). Marker e2e_parser: the capture servers' group.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.e2e.capture_loops import session_turns
from tests.helpers import CHAT, MODEL_NAME, http_client

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_parser]
BODY = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(params=["capture_mw", "capture_plugin", "capture_continue"])
def captured(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(f"{request.param}_server")


def _timeless(models: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{key: value for key, value in model.items() if key not in ("created", "permission")} for model in models]


def test_a_prefixed_base_url_serves_every_route_and_names_the_session(captured):
    session = f"rollout-{uuid.uuid4()}"
    with http_client(captured.url) as client:
        models = client.get(f"/nvext/sessions/{session}/v1/models")
        stock = client.get("/v1/models")
        # vLLM makes each answer's `created` and `permission` (a fresh id) anew per request: the rest the same.
        assert models.status_code == 200 and _timeless(models.json()["data"]) == _timeless(stock.json()["data"])
        answer = client.post(f"/nvext/sessions/{session}{CHAT}", json=BODY, headers={"x-nvext-session-id": "other"})
        assert answer.status_code == 200 and answer.json()["choices"][0].get("token_ids") is None, "stock's answer"
    (turn,) = session_turns(captured, session, 1)
    assert turn["session_source"] == "url" and turn["completion_token_ids"]


@pytest.mark.parametrize("kind", ["capture_mw", "capture_plugin", "capture_continue", "proxy_full"])
def test_a_keyless_prefixed_request_is_refused_as_the_route_it_names(kind, request):
    server = request.getfixturevalue(f"{kind}_server")
    with http_client(server.url, auth=False) as client:
        for method, path, body in (("GET", "/v1/models", None), ("POST", CHAT, BODY)):
            stock = client.request(method, path, json=body)
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                prefixed = client.request(method, f"/nvext/sessions/r-1{path}", json=body, headers=headers)
                assert (
                    (prefixed.status_code, prefixed.content)
                    == (stock.status_code, stock.content)
                    == (
                        401,
                        b'{"error":"Unauthorized"}',
                    )
                ), (kind, path, headers)
        assert client.get("/nvext/sessions/bad!id/v1/models").status_code == 401, "the key first"
    with http_client(server.url) as client:
        bad = client.get("/nvext/sessions/bad!id/v1/models")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "session_id"
        assert client.get("/nvext/sessions/r-1/v1/models").status_code == 200


def test_codex_subagent_threads_read_back_as_trajectories_of_their_own(capture_plugin_server):
    group, root = f"codex-{uuid.uuid4()}", f"thread-{uuid.uuid4()}"
    threads = [root, f"thread-{uuid.uuid4()}", f"thread-{uuid.uuid4()}"]
    with http_client(capture_plugin_server.url) as client:
        for thread in threads:
            headers = {"session-id": group, "thread-id": thread}
            if thread != root:
                headers |= {"x-codex-parent-thread-id": root, "x-openai-subagent": "collab_spawn"}
            assert client.post(CHAT, json=BODY, headers=headers).status_code == 200
        missing = client.get(f"/v1/nvext/sessions/{group}")
        assert missing.status_code == 404, "the group is no trajectory: each thread is"
    for thread in threads:
        (turn,) = session_turns(capture_plugin_server, thread, 1)
        assert (turn["group_id"], turn["parent_id"]) == (group, None if thread == root else root)


def test_a_codex_compaction_is_recorded_and_starts_a_new_segment(capture_plugin_server):
    thread = f"thread-{uuid.uuid4()}"
    with http_client(capture_plugin_server.url) as client:
        for kind in ("turn", "compaction", "turn"):
            headers = {"thread-id": thread, "x-codex-turn-metadata": json.dumps({"request_kind": kind})}
            assert client.post(CHAT, json=BODY, headers=headers).status_code == 200
    turns = session_turns(capture_plugin_server, thread, 3)
    assert [t["request_kind"] for t in turns] == ["turn", "compaction", "turn"]
    assert [t["extends_previous"] for t in turns] == [None, None, None]

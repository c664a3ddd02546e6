"""Capture of a client that asked for ids itself (docs/capture.md): it gets them as it asked, and the
turn is recorded all the same (found by tests/e2e/test_capture_fleet.py: a unary answer in vLLM's
placement went out untouched, past the tap)."""

from __future__ import annotations

import json

import pytest

from tests.helpers import sse_events
from tests.recorded import recording
from tests.unit.asgi import Upstream, call
from tests.unit.test_capture_tap import ID_CASES, JSON, _app, _turns


@pytest.mark.parametrize("pure", [False, True], ids=["c", "python"])
@pytest.mark.parametrize("name", ID_CASES)
async def test_a_client_that_asks_for_ids_gets_them_and_its_turn_is_recorded(name, pure, tmp_path):
    rec = recording(name)
    assert rec.request.get("return_token_ids") is True, "the client asks vLLM for ids"
    upstream = Upstream(content_type=rec.content_type, body=rec.body, cuts=(7, 200))
    app = _app(upstream, tmp_path, pure_python=pure)
    headers = (JSON, (b"x-nvext-session-id", b"asked"))
    result = await call(app, rec.path, json.dumps(rec.request).encode(), headers=headers)
    assert result.status == 200
    if rec.stream:
        sent = rec.events()
        assert sse_events(result.body) == sent, "vLLM's placement, as vLLM sent it"
        completion = [i for e in sent for c in e["choices"] if c["index"] == 0 for i in c.get("token_ids") or []]
        request_id = sent[0]["id"]
    else:
        sent = rec.json()
        assert json.loads(result.body) == sent, "vLLM's placement, as vLLM sent it"
        completion, request_id = sent["choices"][0]["token_ids"], sent["id"]
    (turn,) = _turns(app)
    record = turn.to_json()
    assert (record["session_id"], record["request_id"]) == ("asked", request_id)
    assert record["completion_token_ids"] == completion and record["prompt_token_ids"]

"""Capture seen from the client's side where it meets an upstream or a history it cannot serve with ids: the
client's answer is the one it gets without capture (docs/capture.md, "What the client sees")."""

from __future__ import annotations

import json
from typing import Any

from tests.unit.test_proxy import RESPONSES_BODY, _stop_what_started, call, proxy_over  # noqa: F401 (a fixture)
from vllm_nvext import Settings


def _vllm_rs_034(seen: list[dict[str, Any]]) -> Any:
    """vLLM 0.34's Rust frontend as docs/scaling-out.md saw it: /v1/responses refuses enable_response_messages."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def version(request: Request) -> JSONResponse:
        return JSONResponse({"version": "0.34.0", "rust_frontend_version": "0.34.0"})

    async def responses(request: Request) -> JSONResponse:
        body = await request.json()
        seen.append(body)
        if "enable_response_messages" in body:
            error = {"message": "enable_response_messages is not supported by this frontend.", "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        return JSONResponse({"id": "resp_1", "object": "response", "status": "completed", "output": []})

    return Starlette(routes=[Route("/version", version), Route("/v1/responses", responses, methods=["POST"])])


async def test_a_captured_responses_request_through_the_proxy_to_vllm_rs_is_answered_as_without_capture(tmp_path):
    """vllm-rs refuses `enable_response_messages`, where vLLM puts the ids capture needs: capture turning it on
    for a client that asked nothing made the client's 200 a 400."""
    answers = []
    for capture in (None, f"sqlite:///{tmp_path / 'capture.sqlite3'}"):
        seen: list[dict[str, Any]] = []
        app = await proxy_over(_vllm_rs_034(seen), settings=Settings(capture=capture))
        await app.forwarder._read_version()
        result = await call(app, "/v1/responses", json.dumps(RESPONSES_BODY).encode())
        assert seen == [RESPONSES_BODY], "the request reaches vllm-rs as the client sent it"
        answers.append((result.status, json.loads(result.body)))
    assert answers[0][0] == 200 and answers[1] == answers[0]

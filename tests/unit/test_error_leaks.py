"""Errors the middleware writes never carry exception text, reprs, addresses or paths (docs/protocol.md §9).

In vLLM's style (its sanitize_message tests): leak patterns, put into every place a client controls
that reaches a message the middleware writes, must not come back; and the middleware's sanitizer is
vLLM's own rule.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message as vllm_sanitize

from tests.helpers import CHAT, COMPLETIONS
from tests.unit.asgi import Upstream, call
from vllm_nvext import NvextMiddleware, Settings
from vllm_nvext.protocol import _pinned_sanitize, error_body, sanitize_message

LEAKS = {
    "address": "<object object at 0x7f3a2b1c9d80>",
    "traceback": '\n  File "/usr/lib/python3.11/site-packages/x.py", line 12, in read\n    raise ValueError',
    "system path": "/home/alice/.cache/model/weights",
    "file path": "/srv/app/config/secret.yaml",
}
MARKERS = ("0x7f3a2b1c9d80", 'File "', "/usr/lib", "/home/alice", "secret.yaml", "Traceback")


def _bodies(leak: str) -> list[tuple[str, dict[str, Any], tuple[tuple[bytes, bytes], ...]]]:
    """(route, body, extra headers) for every refusal the middleware writes, the leak where the client can put it."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    comp = {"model": "tiny", "prompt": "x"}
    trio = {"extra_fields": ["completion_token_ids"]}
    return [
        (COMPLETIONS, {**comp, "nvext": {leak: 1}}, ()),  # unknown nvext key
        (COMPLETIONS, {**comp, "nvext": {"extra_fields": leak}}, ()),  # wrong type
        (COMPLETIONS, {**comp, "nvext": {"metadata_upload": {leak: 1}}}, ()),
        (COMPLETIONS, {**comp, "nvext": leak}, ()),  # nvext not an object
        (COMPLETIONS, {**comp, "n": leak, "nvext": trio}, ()),  # a decision field vLLM refuses
        (COMPLETIONS, {**comp, "prompt": [leak, "y"], "nvext": trio}, ()),  # batch with the trio
        (COMPLETIONS, {**comp, "echo": True, "prompt_embeds": leak, "nvext": trio}, ()),
        (COMPLETIONS, {**comp, "nvext": {"token_data": []}}, ()),
        (COMPLETIONS, {**comp, "nvext": {"dp_rank": 1}}, ((b"x-data-parallel-rank", leak.encode()),)),
        (COMPLETIONS, {**comp, "nvext": trio}, ((b"x-nvext-mode", leak.encode()),)),
        (CHAT, {**chat, "n": 2, "nvext": trio}, ()),
        (
            "/v1/chat/completions/batch",
            {**chat, "messages": [[{"role": "user", "content": leak}]], "stream": True, "nvext": trio},
            (),
        ),  # fmt: skip
        ("/invocations", {**comp, "model": leak, "nvext": {"bogus": leak}}, ()),
    ]


@pytest.mark.parametrize("leak", list(LEAKS.values()), ids=list(LEAKS))
def test_no_error_the_middleware_writes_carries_a_leak(leak):
    written = 0
    for route, body, headers in _bodies(leak.replace("\n", " ")) + _bodies(leak):
        upstream = Upstream(body=b'{"choices": []}')
        app = NvextMiddleware(upstream, settings=Settings(max_body_bytes=1 << 20))
        result = asyncio.run(
            call(app, route, json.dumps(body).encode(), headers=((b"content-type", b"application/json"), *headers))
        )
        if upstream.calls:
            continue  # vLLM's own answer, sanitized by vLLM
        written += 1
        assert result.status in (400, 413), (route, body)
        message = json.loads(result.body)["error"]["message"]
        for marker in MARKERS:
            assert marker not in message, (route, body, message)
    assert written >= 20, "the refusals were reached"
    too_large = asyncio.run(
        call(
            NvextMiddleware(Upstream(), settings=Settings(max_body_bytes=64)),
            COMPLETIONS,
            json.dumps({"prompt": leak * 10, "nvext": {}}).encode(),
        )  # fmt: skip
    )
    assert too_large.status == 413 and not any(m in too_large.body.decode() for m in MARKERS)


@pytest.mark.parametrize("leak", list(LEAKS.values()), ids=list(LEAKS))
def test_the_sanitizer_is_vllms_own_rule(leak):
    message = f"`nvext.x` must be a string, got {leak} after it"
    assert _pinned_sanitize(message) == vllm_sanitize(message)
    assert sanitize_message(message) == vllm_sanitize(message), "vLLM's own, now that it is loaded"
    assert not any(m in json.loads(error_body(message, "nvext.x", 400))["error"]["message"] for m in MARKERS)


@pytest.mark.parametrize(
    ("release", "want"),
    [("0.30.0+cpu", "<a at 0xABCDEF>> <b>"), ("0.30.0", "<a at 0xABCDEF>> <b>"), ("0.31.0+cpu", "<a>> <b>"),
     ("0.34.0", "<a>> <b>"), (None, "<a>> <b>"), ("not a version", "<a>> <b>")],
)  # fmt: skip
def test_the_copy_of_the_rules_is_each_releases(release, want):
    """vLLM 0.30 rewrites lower-case hex addresses only; 0.31 on, either case (tests/e2e/test_versions.py
    compares every release's own sanitize_message)."""
    assert _pinned_sanitize("<a at 0xABCDEF> at 0xabcdef> <b at 0x1f>", release) == want


def test_the_middlewares_own_messages_pass_the_sanitizer_unchanged():
    """Routes the messages name (/v1/completions, /v1/chat/completions/batch) are no paths to hide."""
    from vllm_nvext.inbound.choices import ECHO_EMBEDS

    for message in (
        ECHO_EMBEDS,
        "`stream` is not supported on /v1/chat/completions/batch (vLLM would answer each conversation "
        "with its last token only); leave it out, or stream each conversation from /v1/chat/completions",
        "`nvext.token_data` on /v1/chat/completions needs a vLLM whose chat endpoint accepts "
        "`kv_transfer_params.prompt_token_ids`; send it to /v1/completions instead",
    ):
        assert sanitize_message(message) == message

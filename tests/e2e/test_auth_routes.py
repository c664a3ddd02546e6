"""End to end: vLLM's key check with vLLM's route rule, /invocations decided as vLLM decides it, echo after
the key check, and errors renamed only from vLLM's `param` (docs/protocol.md §9, §10).

The plugin mount sits inside vLLM's own key check: its auth answers are stock vLLM's. The
`--middleware` mount applies vLLM's rule itself, outermost, and must answer the same.
"""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import API_KEY, CHAT, COMPLETIONS, MODEL_NAME
from vllm_nvext.protocol import ENDPOINT_PATHS

pytestmark = pytest.mark.e2e

TRIO = {"extra_fields": ["completion_token_ids"]}
USER = [{"role": "user", "content": "Hi"}]
BODIES = {
    CHAT: {"model": MODEL_NAME, "messages": USER, "max_tokens": 2, "nvext": TRIO},
    COMPLETIONS: {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "nvext": TRIO},
    "/v1/chat/completions/batch": {"model": MODEL_NAME, "messages": [USER], "max_tokens": 2, "nvext": TRIO},
    "/invocations": {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "nvext": TRIO},
}
AUTH = {
    "no key": {},
    "wrong key": {"Authorization": "Bearer wrong"},
    "right key": {"Authorization": f"Bearer {API_KEY}"},
}


def _answer(url: str, path: str, method: str, headers: dict[str, str]) -> tuple[int, str | None]:
    if method == "OPTIONS":
        resp = httpx.options(url + path, headers=headers, timeout=60)
    else:
        resp = httpx.post(url + path, json=BODIES[path], headers=headers, timeout=60)
    body = resp.json() if resp.headers.get("content-type", "").startswith("application/json") else None
    shape = (
        "Unauthorized"
        if body == {"error": "Unauthorized"}
        else ("nvext" if isinstance(body, dict) and "nvext" in body else None)
    )
    return resp.status_code, shape


def test_every_translated_route_answers_the_key_check_as_stock(mw_server, plugin_server):
    table = []
    for path in ENDPOINT_PATHS:
        for method in ("POST", "OPTIONS"):
            for name, headers in AUTH.items():
                if method == "OPTIONS" and name == "wrong key":
                    continue
                stock = _answer(plugin_server.url, path, method, headers)  # vLLM's own check runs first
                ours = _answer(mw_server.url, path, method, headers)
                table.append(f"{path} {method} {name}: plugin {stock} mw {ours}")
                assert ours == stock, (path, method, name)
                guarded = path != "/invocations" and method == "POST" and name != "right key"
                assert (ours == (401, "Unauthorized")) is guarded, (path, method, name)
                if method == "POST" and not guarded:
                    assert ours == (200, "nvext"), "translated, with or without a key where vLLM does not guard"
    print("\n".join(table))


@pytest.mark.parametrize("server", ["mw_server", "plugin_server"])
def test_a_keyless_invocations_is_translated_by_one_rule(request, server):
    url = request.getfixturevalue(server).url + "/invocations"
    bad = {**BODIES["/invocations"], "nvext": {"extra_fields": "bogus"}}
    for headers in AUTH.values():
        resp = httpx.post(url, json=bad, headers=headers, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "nvext.extra_fields", headers


@pytest.mark.parametrize("model", ["nope", {"a": 1}], ids=["unknown model", "dict model"])
def test_a_keyless_echo_of_ids_gets_vllms_401(mw_server, model):
    body = {"model": model, "prompt": [72, 105], "echo": True, "max_tokens": 1, "nvext": TRIO}
    for headers in (AUTH["no key"], AUTH["wrong key"]):
        resp = httpx.post(mw_server.url + COMPLETIONS, json=body, headers=headers, timeout=60)
        assert (resp.status_code, resp.json()) == (401, {"error": "Unauthorized"})


def test_invocations_is_served_on_the_route_stock_picks(raw, translated):
    junk = {"model": MODEL_NAME, "messages": "junk", "prompt": ["Hello", "World wide"], "max_tokens": 2}
    refused = translated.post("/invocations", json={**junk, "nvext": TRIO})
    on_completions = translated.post(COMPLETIONS, json={**junk, "nvext": TRIO})
    assert refused.status_code == on_completions.status_code == 400
    assert refused.json()["error"]["param"] == on_completions.json()["error"]["param"] == "prompt"
    timed = translated.post("/invocations", json={**junk, "temperature": 0, "nvext": {"extra_fields": ["timing"]}})
    stock = raw.post("/invocations", json={**junk, "temperature": 0, "return_token_ids": True})
    assert timed.json()["object"] == stock.json()["object"] == "text_completion"
    assert [c["text"] for c in timed.json()["choices"]] == [c["text"] for c in stock.json()["choices"]]

    chat = {
        "model": MODEL_NAME,
        "messages": USER,
        "prompt": "Hello",
        "logprobs": True,
        "max_tokens": 3,
        "temperature": 0,
    }
    ours = translated.post("/invocations", json={**chat, "nvext": TRIO})
    theirs = raw.post("/invocations", json={**chat, "return_token_ids": True})
    assert ours.status_code == theirs.status_code == 200
    assert ours.json()["object"] == theirs.json()["object"] == "chat.completion"
    assert ours.json()["nvext"]["completion_token_ids"] == theirs.json()["choices"][0]["token_ids"]


def _error(resp: httpx.Response) -> tuple[int, str | None]:
    return resp.status_code, resp.json()["error"].get("param")


def test_errors_keep_stocks_param_when_the_client_wrote_the_fields_name(raw, translated):
    body = {"model": "my temperature model", "prompt": "x", "max_tokens": 1}
    ours = translated.post(COMPLETIONS, json={**body, "nvext": {"greed_sampling": True}})
    stock = raw.post(COMPLETIONS, json={**body, "temperature": 0})
    assert _error(ours) == _error(stock) and _error(stock)[0] == 404
    assert ours.json()["error"]["message"] == stock.json()["error"]["message"]


def test_ids_and_batches_vllm_refuses_get_stocks_own_error(raw, translated):
    huge = {"model": MODEL_NAME, "prompt": [2**63], "echo": True, "max_tokens": 1}
    ours, stock = (
        translated.post(COMPLETIONS, json={**huge, "nvext": TRIO}),
        raw.post(COMPLETIONS, json=huge),
    )
    assert _error(ours) == _error(stock) and ours.status_code == 400
    assert "body.tokens" not in ours.text, "never the internal /detokenize call's field"
    flat = {"model": MODEL_NAME, "messages": USER * 2, "max_tokens": 1}
    ours = translated.post("/v1/chat/completions/batch", json={**flat, "nvext": TRIO})
    stock = raw.post("/v1/chat/completions/batch", json=flat)
    assert _error(ours) == _error(stock) and ours.status_code == 400
    assert "exactly one generated choice" not in ours.text

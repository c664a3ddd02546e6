"""Client values that reach further than the request: request ids a kv connector joins into file
paths (docs/hidden-states.md), and the client's `kv_transfer_params` (docs/scaling-out.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.vllm_source import connector_address_keys, kv_params_routes
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings, _vllm_compat
from vllm_nvext.agent.responses import AGENT_PATHS
from vllm_nvext.inbound.client_params import REMOTE_ADDRESS_KEYS, is_plain_name, strip_remote_address
from vllm_nvext.inbound.nvext_schema import NVEXT_FIELDS
from vllm_nvext.inbound.request import plan, read_request
from vllm_nvext.protocol import ENDPOINT_PATHS, KV_PARAMS_PATHS, PATHS, REQUEST_ID_PATHS, Endpoint, RequestError

CHAT_PATH, COMPLETIONS_PATH = PATHS[Endpoint.CHAT], PATHS[Endpoint.COMPLETIONS]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
NVEXT_IDS = {"nvext": {"extra_fields": ["completion_token_ids"]}}
VLLM_HS = {
    "kv_connector": "ExampleHiddenStatesConnector",
    "kv_role": "kv_producer",
    "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"},
}
PROJECT_HS = {
    "kv_connector": "CPUHiddenStatesConnector",
    "kv_connector_module_path": "vllm_nvext.connectors.hidden_states",
    "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"},
}


def _args(kv_transfer_config: Any, **more: Any) -> SimpleNamespace:
    """`app.state.args` as `vllm serve` leaves it (`--kv-transfer-config` parsed into an object)."""
    config = None if kv_transfer_config is None else SimpleNamespace(**{"kv_connector_module_path": None,
                                                                       **kv_transfer_config})  # fmt: skip
    return SimpleNamespace(kv_transfer_config=config, api_key=None, **more)


def _send(body: Any, *, path: str = CHAT_PATH, headers=(), kv=VLLM_HS, **kwargs: Any):
    upstream = Upstream(body=b'{"choices": []}')
    app = NvextMiddleware(upstream, settings=Settings(**kwargs))
    scope_app = SimpleNamespace(state=SimpleNamespace(args=_args(kv)))
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    hdrs = ((b"content-type", b"application/json"), *headers)
    got = asyncio.run(call(app, path, raw, headers=hdrs, scope_extra={"app": scope_app}))
    return got, upstream


# --- request ids that reach file paths -------------------------------------------------------


@pytest.mark.parametrize(
    ("request_id", "plain"),
    [
        ("req-1", True),
        ("chat.2026-12-01_a", True),
        ("", True),
        ("x" * 128, True),
        ("é-latin-1", True),
        ("x" * 129, False),
        ("/../../target/evil", False),
        ("a/b", False),
        ("a\\b", False),
        ("..", False),
        ("a..b", False),
        ("a\x00b", False),
        ("a\nb", False),
        ("a\x7fb", False),
    ],
)
def test_a_plain_name_has_no_separator_no_dotdot_no_control_character_and_128_characters_at_most(request_id, plain):
    assert is_plain_name(request_id) is plain


@pytest.mark.parametrize(
    ("config", "builds_paths"),
    [
        (None, False),
        (VLLM_HS, True),
        (
            {
                **VLLM_HS,
                "kv_connector_module_path": (
                    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
                ),
            },
            True,
        ),  # fmt: skip
        (PROJECT_HS, False),  # names its files by a digest (docs/hidden-states.md)
        ({**VLLM_HS, "kv_connector_module_path": "my_company.connectors"}, False),  # someone else's class
        ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, False),
        ({"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [PROJECT_HS, VLLM_HS]}}, True),
        ({"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": [PROJECT_HS]}}, False),
        ({"kv_connector": "MultiConnector", "kv_connector_extra_config": {"connectors": "junk"}}, False),
    ],
)
def test_request_ids_are_guarded_exactly_where_vllms_own_hidden_states_connector_names_files(config, builds_paths):
    assert _vllm_compat.builds_paths_from_request_ids(_args(config)) is builds_paths
    assert _vllm_compat.builds_paths_from_request_ids(None) is False


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH, "/v1/responses", "/invocations"])
def test_an_x_request_id_that_is_not_a_plain_name_is_refused_naming_the_header(path):
    body = CHAT if path == CHAT_PATH else COMPLETION
    got, upstream = _send(body, path=path, headers=[(b"x-request-id", b"/../../target/evil")])
    assert got.status == 400 and upstream.calls == 0, "the request never reached vLLM's connector"
    error = json.loads(got.body)["error"]
    assert error["param"] == "x-request-id" and error["code"] == 400
    assert "target" not in error["message"], "the error never echoes the client's value"


def test_only_the_first_x_request_id_counts_as_in_vllm():
    got, upstream = _send(CHAT, headers=[(b"x-request-id", b"req-1"), (b"x-request-id", b"../evil")])
    assert got.status == 200 and upstream.calls == 1
    got, _ = _send(CHAT, headers=[(b"x-request-id", b"../evil"), (b"x-request-id", b"req-1")])
    assert got.status == 400


@pytest.mark.parametrize("opt_in", [{}, NVEXT_IDS])
@pytest.mark.parametrize("key", ['"request_id"', '"request\\u005fid"'])
def test_a_body_request_id_that_is_not_a_plain_name_is_refused_naming_the_field(opt_in, key):
    raw = json.dumps({**CHAT, **opt_in, "rid": "a/../b"}).encode().replace(b'"rid"', key.encode())
    got, upstream = _send(raw)
    assert got.status == 400 and upstream.calls == 0
    assert json.loads(got.body)["error"]["param"] == "request_id"
    # vLLM takes the header first: the body's request_id is then not used.
    got, upstream = _send(raw, headers=[(b"x-request-id", b"req-1")])
    assert got.status == 200 and json.loads(upstream.received)["request_id"] == "a/../b"


def test_plain_request_ids_and_other_connectors_pass_untouched():
    for kv, headers, body in (
        (VLLM_HS, [(b"x-request-id", b"req-1")], {**CHAT, "request_id": "req-2"}),
        (PROJECT_HS, [(b"x-request-id", b"/../../evil")], {**CHAT, "request_id": "a/../b"}),
        (None, [(b"x-request-id", b"/../../evil")], {**CHAT, "request_id": "a/../b"}),
    ):
        got, upstream = _send(body, kv=kv, headers=headers)
        assert got.status == 200 and upstream.received == json.dumps(body).encode()


GENERATE = {"model": "tiny", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}


@pytest.mark.parametrize("path", sorted(REQUEST_ID_PATHS))
def test_a_body_request_id_is_refused_on_the_routes_vllm_makes_the_engines_request_id_of_it(path):
    """/inference/v1/generate (`generate-tokens-{request_id}`), /generative_scoring, /v1/systemone:
    routes translated nowhere, whose body's `request_id` vLLM joins into the engine's request id."""
    got, upstream = _send({**GENERATE, "request_id": "/../../target/evil"}, path=path)
    assert got.status == 400 and upstream.calls == 0, "the request never reached vLLM's connector"
    error = json.loads(got.body)["error"]
    assert error["param"] == "request_id" and "target" not in error["message"]
    for headers, body in (([(b"x-request-id", b"req-1")], {**GENERATE, "request_id": "a/../b"}),
                          ([], {**GENERATE, "request_id": "req-2"})):  # fmt: skip
        got, upstream = _send(body, path=path, headers=headers)  # vLLM takes the header first
        assert got.status == 200 and upstream.received == json.dumps(body).encode()
    raw = json.dumps({**GENERATE, "request_id": "a/../b"}).encode()
    for kv in (PROJECT_HS, None):  # a connector that names no file after ids: the body as sent
        got, upstream = _send(raw, path=path, kv=kv)
        assert got.status == 200 and upstream.received == raw


def test_responses_takes_the_body_request_id_even_with_a_header_so_it_is_checked_then_too():
    body = {"model": "tiny", "input": "Hi", "request_id": "a/../b"}
    got, upstream = _send(body, path="/v1/responses", headers=[(b"x-request-id", b"req-1")])
    assert got.status == 400 and upstream.calls == 0
    assert json.loads(got.body)["error"]["param"] == "request_id"


def test_routes_that_take_no_body_request_id_pass_it_untouched():
    raw = json.dumps({"model": "tiny", "message": "Hi", "prompt": "Hi", "request_id": "a/../b"}).encode()
    for path in ("/cohere/v2/chat", "/tokenize", "/v1/messages/count_tokens"):
        got, upstream = _send(raw, path=path, strip_kv_remote_address=True)
        assert got.status == 200 and upstream.received == raw, path


def test_a_caller_without_the_key_gets_vllms_401_not_the_request_id_verdict(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    for headers, body in (([(b"x-request-id", b"../evil")], CHAT), ([], {**CHAT, "request_id": "../evil"})):
        got, upstream = _send(body, headers=headers)
        assert upstream.calls == 1, "vLLM's own key check answers"
        assert upstream.received == json.dumps(body).encode()
    got, upstream = _send(CHAT, headers=[(b"x-request-id", b"../evil"), (b"authorization", b"Bearer secret")])
    assert got.status == 400 and upstream.calls == 0


# --- kv_transfer_params from clients ---------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
KV_KEYS = st.sampled_from(["prompt_token_ids", "remote_host", "remote_port", "do_remote_decode", "prefill",
                           "hidden_states_path", "decode", "x", "remote_bootstrap_addr", "disagg_spec",
                           "remote_notify_port"])  # fmt: skip
CLIENT_KV = st.none() | st.dictionaries(KV_KEYS, JSON | st.dictionaries(KV_KEYS, JSON, max_size=3), max_size=4)
NVEXT_VALUE = JSON | st.lists(st.integers(0, 300), min_size=1, max_size=4) | st.dictionaries(KV_KEYS, JSON)
NVEXT = st.dictionaries(st.sampled_from(sorted(NVEXT_FIELDS)) | KV_KEYS, NVEXT_VALUE, max_size=4)


def _upstream_kv(body: dict[str, Any], endpoint: Endpoint, mode: Mode) -> Any:
    request = read_request(json.dumps(body).encode(), endpoint)
    if request is None:
        return body.get("kv_transfer_params")  # opts into nothing: reaches vLLM as sent
    p = plan(request, mode)
    return json.loads(p.body if p.body is not None else request.body).get("kv_transfer_params")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    nvext=NVEXT,
    kv=CLIENT_KV,
    endpoint=st.sampled_from([Endpoint.CHAT, Endpoint.COMPLETIONS]),
    mode=st.sampled_from(list(Mode)),
)
def test_no_nvext_field_puts_a_key_into_kv_transfer_params_the_client_could_not_put_itself(nvext, kv, endpoint, mode):
    base = CHAT if endpoint is Endpoint.CHAT else COMPLETION
    body = {**base, "nvext": nvext} if kv is None else {**base, "nvext": nvext, "kv_transfer_params": kv}
    try:
        sent = _upstream_kv(body, endpoint, mode)
    except RequestError:
        return  # refused: nothing reaches vLLM
    if sent is None:
        assert kv is None
        return
    client = kv or {}
    # vLLM's chat takes `kv_transfer_params.prompt_token_ids` from any client: the one key
    # `nvext.token_data` writes, with the very ids the client sent there.
    assert set(sent) <= set(client) | {"prompt_token_ids"}, sent
    assert {k: v for k, v in sent.items() if k != "prompt_token_ids"} == {
        k: v for k, v in client.items() if k != "prompt_token_ids"
    }
    if sent.get("prompt_token_ids") != client.get("prompt_token_ids"):
        assert endpoint is Endpoint.CHAT and sent["prompt_token_ids"] == nvext["token_data"]


def _without_remote(kv: Any) -> Any:
    if not isinstance(kv, dict):
        return kv
    out = {k: v for k, v in kv.items() if k not in REMOTE_ADDRESS_KEYS}
    for stage in ("prefill", "decode"):
        if isinstance(out.get(stage), dict):
            out[stage] = {k: v for k, v in out[stage].items() if k not in REMOTE_ADDRESS_KEYS}
    return out


@settings(max_examples=200, deadline=None)
@given(kv=CLIENT_KV, nvext=st.sampled_from([None, {"extra_fields": ["completion_token_ids"]}, {"token_data": [5]}]))
def test_the_strip_removes_the_remote_address_and_nothing_else(kv, nvext):
    body: dict[str, Any] = {**CHAT, "kv_transfer_params": kv}
    if nvext is not None:
        body["nvext"] = nvext
    raw = json.dumps(body).encode()
    stripped = strip_remote_address(raw, json.loads(raw))
    expected = {**body, "kv_transfer_params": _without_remote(kv)}
    if stripped is None:
        assert expected == body, "nothing to strip"
        return
    assert json.loads(stripped) == expected


@pytest.mark.parametrize("extra", [{}, NVEXT_IDS, {"return_token_ids": True}, {"nvext": {"token_data": [7, 8]}}])
def test_with_the_strip_on_vllm_never_gets_a_clients_remote_address_in_either_dialect(extra):
    kv = {
        "do_remote_prefill": True,
        "remote_host": "10.0.0.9",
        "remote_port": 5600,
        "remote_block_ids": [1, 2],
        "prefill": {"remote_host": "evil", "remote_port": 1, "engine": "p0"},
        "decode": {"remote_host": "evil", "keep": 1e400},
    }
    body = {**CHAT, **extra, "kv_transfer_params": kv}
    got, upstream = _send(body, kv=None, strip_kv_remote_address=True)
    assert got.status == 200 and upstream.received is not None
    sent = json.loads(upstream.received)["kv_transfer_params"]
    assert {k: v for k, v in sent.items() if k != "prompt_token_ids"} == {
        "do_remote_prefill": True,
        "remote_block_ids": [1, 2],
        "prefill": {"engine": "p0"},
        "decode": {"keep": float("inf")},
    }
    header = dict(upstream.received_headers)[b"content-length"]
    assert int(header) == len(upstream.received), "the length vLLM reads is the new body's"
    off, upstream = _send(body, kv=None)  # off by default: vLLM gets what the client sent
    assert json.loads(upstream.received)["kv_transfer_params"]["remote_host"] == "10.0.0.9"


# The routes vLLM hands a client's kv_transfer_params on from (`kv_params_routes` below reads them from
# its source; /invocations serves the body as chat or completions).
KV_ROUTES = ["/v1/chat/completions", "/v1/completions", "/invocations", "/v1/responses", "/v1/messages",
             "/inference/v1/generate", "/cohere/v2/chat"]  # fmt: skip
EVERY_ADDRESS = {
    "remote_host": "10.0.0.9",
    "remote_port": 5600,
    "remote_hosts": ["10.0.0.9", "10.0.0.10"],
    "remote_handshake_port": 6301,
    "remote_notify_port": 61005,
    "remote_bootstrap_addr": "10.0.0.9:8998",
    "disagg_spec": {"req_id": "r", "receiver_host": "10.0.0.9", "receiver_init_port": [1], "receiver_alloc_port": [2]},
}


@pytest.mark.parametrize("path", KV_ROUTES)
def test_the_strip_removes_every_connectors_address_on_every_route_vllm_reads_kv_transfer_params_from(path):
    """NIXL's, MoRIIO's, Mooncake's and LMCache's addresses, on chat and /inference/v1/generate alike."""
    kept = {"do_remote_prefill": True, "remote_engine_id": "e0", "remote_block_ids": [1, 2], "transfer_id": "t"}
    body = {**(CHAT if path != "/v1/completions" else COMPLETION), "kv_transfer_params": {**EVERY_ADDRESS, **kept}}
    got, upstream = _send(body, path=path, kv=None, strip_kv_remote_address=True)
    assert got.status == 200 and upstream.received is not None
    assert json.loads(upstream.received)["kv_transfer_params"] == kept, "no address reaches vLLM's connector"
    assert int(dict(upstream.received_headers)[b"content-length"]) == len(upstream.received)
    raw = json.dumps(body).encode().replace(b'"kv_transfer_params"', b'"kv\\u005ftransfer_params"')
    got, upstream = _send(raw, path=path, kv=None, strip_kv_remote_address=True)
    assert json.loads(upstream.received or b"")["kv_transfer_params"] == kept, "the key spelled with an escape"


def _installed_vllm() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("no vLLM installed")
    return Path(spec.origin).parent


def test_the_strip_names_every_address_key_the_installed_vllms_kv_connectors_read():
    """tests/e2e/test_versions.py walks every other supported release the same way."""
    found = connector_address_keys(_installed_vllm())
    assert {"remote_host", "remote_port", "remote_bootstrap_addr"} <= set(found), "the walk reads the connectors"
    missing = {key: sorted(found[key]) for key in set(found) - REMOTE_ADDRESS_KEYS}
    assert not missing, f"address keys vLLM's connectors dial that the strip leaves: {missing}"


def test_every_route_vllm_reads_kv_transfer_params_from_is_read_for_the_strip():
    # The render routes answer with what they would send on (a GenerateRequest): no engine runs there.
    routes = {route for route in kv_params_routes(_installed_vllm()) if not route.endswith("/render")}
    assert "/inference/v1/generate" in routes and set(KV_ROUTES) - {"/invocations"} == routes
    assert routes <= set(ENDPOINT_PATHS) | set(AGENT_PATHS) | KV_PARAMS_PATHS


def test_the_connector_walk_follows_names_bound_to_kv_transfer_params(tmp_path):
    connectors = tmp_path / "distributed/kv_transfer/kv_connector/v1"
    connectors.mkdir(parents=True)
    (connectors / "c.py").write_text(
        "def f(self, request):\n"
        "    params = request.kv_transfer_params or {}\n"
        "    spec = params['peer']\n"
        "    return params.get('remote_zmq_addr'), spec['receiver_host'], params.get('tp_size'), request.host\n"
    )
    assert connector_address_keys(tmp_path) == {"remote_zmq_addr": {"c.py"}, "peer": {"c.py"}}


def test_the_strip_leaves_a_body_without_a_remote_address_byte_for_byte():
    raw = json.dumps({**CHAT, "kv_transfer_params": {"do_remote_decode": True}}).encode()
    got, upstream = _send(raw, kv=None, strip_kv_remote_address=True)
    assert upstream.received == raw


def test_the_strip_is_a_setting_off_by_default(monkeypatch):
    monkeypatch.delenv("VLLM_NVEXT_STRIP_KV_REMOTE_ADDRESS", raising=False)
    assert Settings.from_env().strip_kv_remote_address is False
    monkeypatch.setenv("VLLM_NVEXT_STRIP_KV_REMOTE_ADDRESS", "1")
    assert NvextMiddleware(lambda *a: None).settings.strip_kv_remote_address is True
    assert NvextMiddleware(lambda *a: None, strip_kv_remote_address=False).settings.strip_kv_remote_address is False
    from vllm_nvext import ConfigError

    with pytest.raises(ConfigError, match="^strip_kv_remote_address: "):
        Settings(strip_kv_remote_address="yes")  # type: ignore[arg-type]
    monkeypatch.setenv("VLLM_NVEXT_STRIP_KV_REMOTE_ADDRESS", "maybe")
    with pytest.raises(ConfigError, match="VLLM_NVEXT_STRIP_KV_REMOTE_ADDRESS"):
        Settings.from_env()


def test_a_body_vllm_cannot_decode_reaches_it_as_sent_for_its_own_error():
    for raw in (b'{"kv_transfer_params": {"remote_host": "x"', b'{"request_id": "a/b", "nvext": }'):
        got, upstream = _send(raw, strip_kv_remote_address=True)
        assert upstream.received == raw

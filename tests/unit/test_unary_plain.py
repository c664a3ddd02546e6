"""A plain single-choice unary body (outbound/unary.py `plain_body`) gives the general path's bytes, or is left to it.

Under a plan that asks for the token-id trio and nothing else, a body whose JSON is plain is not
decoded: vLLM's copies of the ids go back to null in place and `nvext` goes at its end, every other
byte as vLLM wrote it, with either twin of the scanner (`plain_chunk`: the "python" and "c" arms).
Compared with decoding the whole body and reshaping it with `chunks.reshape_unary` (`_general`): every
recorded unary answer under every plan, bodies laid out with any value under any key, and each body the
shortcut must refuse.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recorded import recordings
from tests.unit.asgi import Upstream, call
from tests.unit.test_stream_finish import IDS, KEYS, VALUES, _dumps, _scanner
from tests.unit.test_unary import UNARY, _FrozenClock, _general, _plans
from vllm_nvext import NvextMiddleware, Settings
from vllm_nvext.config import Mode
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.outbound import unary
from vllm_nvext.protocol import Endpoint

# Single-choice answers with plain JSON (no floats, escapes or non-ASCII text): the shortcut takes them.
# (0.32's recorded texts hold escapes and replacement characters: those answers are decoded.)
PLAIN = [f"vllm-{v}/{kind}_unary_ids" for v in ("0.33", "0.33-rust", "0.34-rust") for kind in ("chat", "completions")]
SINGLE = [n for n in UNARY if "_n2" not in n]
NO_LOGPROBS = [n for n in SINGLE if "logprobs" not in n]  # floats: never plain
# Values the shortcut keeps as they are (plain) half the time, any value (test_stream_finish.VALUES) otherwise.
PLAIN_VALUES: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**15) + 1, 10**15 - 1),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E, exclude_characters='"\\'), max_size=6),
    st.sampled_from([{}, [], [1], {"a": None}, {"kv_transfer_params": None}]),
)
ANY_VALUE = st.one_of(PLAIN_VALUES, VALUES)
ANY_IDS = st.one_of(st.lists(st.integers(0, 10**6), max_size=4), IDS)


def _trio_plan(name: str, mode: Mode = Mode.NVEXT, vllm_ids: bool = False, selectors: list[str] | None = None) -> Any:
    rec = recordings()[name]
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    request["nvext"] = {"extra_fields": ["completion_token_ids"] if selectors is None else selectors}
    if vllm_ids:
        request["return_token_ids"] = True
    plan = plan_request(json.dumps(request).encode(), rec.endpoint, mode)
    assert plan is not None
    return plan


def _reshaped(body: bytes, plan: Any, compiled: bool) -> bytes | None:
    return unary.reshape_unary_body(body, plan, _FrozenClock(), _scanner(compiled))


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@pytest.mark.parametrize("name", UNARY)
def test_every_recorded_answer_under_every_plan_gives_the_general_paths_bytes(name, compiled):
    rec = recordings()[name]
    checked = 0
    for plan in _plans(rec):
        assert _reshaped(rec.body, plan, compiled) == _general(rec.body, plan)
        checked += 1
    assert checked


@pytest.mark.parametrize("vllm_ids", [False, True], ids=["nvext", "both"])
@pytest.mark.parametrize("name", PLAIN)
def test_a_plain_answer_is_not_decoded_and_carries_the_trio(name, vllm_ids, json_decodes):
    rec = recordings()[name]
    plan = _trio_plan(name, Mode.BOTH if vllm_ids else Mode.NVEXT, vllm_ids)
    got = _reshaped(rec.body, plan, True)
    assert json_decodes == [], "the answer was decoded"
    assert got == _general(rec.body, plan)
    assert got is not None
    answer, vllm = orjson.loads(got), orjson.loads(rec.body)
    choice = vllm["choices"][0]
    prompt = (choice if "prompt_token_ids" in choice else vllm)["prompt_token_ids"]
    assert answer["nvext"] == {"completion_token_ids": choice["token_ids"], "prompt_token_ids": prompt}
    kept = answer["choices"][0]["token_ids"]
    assert kept == (choice["token_ids"] if vllm_ids else None), "vLLM's copy of the ids is kept only when asked for"


def _edited(name: str, edit: Any) -> bytes:
    obj = orjson.loads(recordings()[name].body)
    edit(obj)
    return _dumps(obj)


def _set(path: tuple[Any, ...], value: Any) -> Any:
    def edit(obj: Any) -> None:
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value

    return edit


def _content(name: str) -> tuple[Any, ...]:
    chat = recordings()[name].endpoint is Endpoint.CHAT
    return ("choices", 0, "message", "content") if chat else ("choices", 0, "text")


def _laid_out(data: Any) -> tuple[bytes, Any]:
    """A recorded single-choice answer with any value under any key (root, choice, message) and a plan for it."""
    name = data.draw(st.one_of(st.sampled_from(NO_LOGPROBS), st.sampled_from(SINGLE)), label="name")
    rec = recordings()[name]
    plan = _trio_plan(name, data.draw(st.sampled_from([Mode.NVEXT, Mode.BOTH, Mode.AUTO]), label="mode"),
                      data.draw(st.booleans(), label="return_token_ids"))  # fmt: skip
    flags = ("strip_vllm_ids", "vllm_sends_prompt_ids", "vllm_placement", "kv_stays_at_root")
    plan = replace(plan, **{flag: data.draw(st.booleans(), label=flag) for flag in flags})
    obj = orjson.loads(rec.body)
    choice = obj["choices"][0]
    rare = st.integers(0, 5).map(lambda roll: roll == 0)
    if not data.draw(rare, label="the recorded text"):  # 0.32's recorded texts are not plain
        _set(_content(name), "plain text")(obj)
    owners = [obj, choice] + [choice[k] for k in ("message",) if isinstance(choice.get(k), dict)]
    for owner in owners:
        for key in data.draw(st.lists(st.sampled_from(KEYS), max_size=3, unique=True), label="keys"):
            owner[key] = data.draw(ANY_VALUE, label=key)
    for owner in (choice, obj):
        for key in ("token_ids", "prompt_token_ids"):
            what = data.draw(st.sampled_from(["kept", "other", "gone"]), label=key)
            if what == "other":
                owner[key] = data.draw(ANY_IDS, label=f"{key} value")
            elif what == "gone":
                owner.pop(key, None)
    if data.draw(rare, label="two choices"):
        obj["choices"].append({**choice, "index": 1})
    body = _dumps(obj)
    if data.draw(rare, label="a root key twice"):
        body = body.replace(b'"choices":', b'"model":"x","choices":', 1)
    return body, plan


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_an_answer_laid_out_any_way_gives_the_general_paths_bytes(compiled, data):
    body, plan = _laid_out(data)
    assert _reshaped(body, plan, compiled) == _general(body, plan)


def _kv_after_a_null_one(obj: Any) -> None:
    obj["choices"][0]["kv_transfer_params"] = None  # vLLM writes none there: a layout that does
    obj["kv_transfer_params"] = {"remote_block_ids": [1]}


# Bodies the shortcut must leave to the general path, each for a reason of its own.
REFUSED: dict[str, Any] = {
    "two choices (n > 1)": lambda n: _edited(n, lambda o: o["choices"].append({**o["choices"][0], "index": 1})),
    "a root nvext": lambda n: _edited(n, _set(("nvext",), {"a": 1})),
    "a root nvext before choices": lambda n: recordings()[n].body.replace(b'"choices":', b'"nvext":null,"choices":', 1),
    "kv_transfer_params": lambda n: _edited(n, _set(("kv_transfer_params",), {"remote_block_ids": [1]})),
    "kv_transfer_params after a null one": lambda n: _edited(n, _kv_after_a_null_one),
    "kv_transfer_params false": lambda n: _edited(n, _set(("kv_transfer_params",), False)),
    "logprobs": lambda n: _edited(n, _set(("choices", 0, "logprobs"), {"content": [{"logprob": -0.25}]})),
    "an escape in the text": lambda n: _edited(n, _set(_content(n), "a\nb")),
    "non-ASCII text": lambda n: _edited(n, _set(_content(n), "é")),
    "a float": lambda n: _edited(n, _set(("created",), 1.0)),
    "an exponent": lambda n: recordings()[n].body.replace(b'"created":', b'"created":1e5,"x":', 1),
    "an integer beyond 64 bits": lambda n: _edited(n, _set(("choices", 0, "token_ids"), [2**70])),
    "a key twice": lambda n: recordings()[n].body.replace(b'"choices":', b'"model":"x","choices":', 1),
    "whitespace": lambda n: recordings()[n].body.replace(b'"choices":', b'"choices": ', 1),
}


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_body_the_shortcut_cannot_serve_is_decoded_with_the_same_bytes(case, name, json_decodes):
    body = REFUSED[case](name)
    plan = _trio_plan(name)
    assert unary.serves(plan)
    json_decodes.clear()
    got = _reshaped(body, plan, True)
    assert body in json_decodes, "the shortcut served a body it cannot serve"
    assert got == _general(body, plan)


@pytest.mark.parametrize("handoff", [False, True], ids=["client", "orchestrator"])
@pytest.mark.parametrize("name", ["vllm-0.33/chat_unary_ids_kv", "vllm-0.33/completions_unary_ids_kv"])
def test_a_recorded_kv_transfer_params_goes_into_nvext_as_the_general_path_moves_it(name, handoff):
    # the recorded request carried a root kv_transfer_params (an orchestrator's handoff): its answer's stays
    # at the root too; a client's request without one gets it in nvext alone (docs/protocol.md §3.4)
    rec = recordings()[name]
    plan = replace(_trio_plan(name), kv_stays_at_root=handoff)
    got = _reshaped(rec.body, plan, True)
    assert got == _general(rec.body, plan)
    assert got is not None
    answer, kv = orjson.loads(got), orjson.loads(rec.body)["kv_transfer_params"]
    assert answer["nvext"]["kv_transfer_params"] == kv
    assert answer["kv_transfer_params"] == (kv if handoff else None)


# Plans the shortcut must leave to the general path: each asks for something it does not write.
PLANS: dict[str, Any] = {
    "another selector": lambda n: _trio_plan(n, selectors=["completion_token_ids", "stop_reason"]),
    "the prompt's ids alone": lambda n: _trio_plan(n, selectors=["prompt_token_ids"]),
    "an echoed prompt to put back": lambda n: replace(_trio_plan(n), echo_prompts=("Hi ",)),
}


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("case", sorted(PLANS))
def test_a_plan_the_shortcut_cannot_serve_decodes_the_body(case, name, json_decodes):
    rec = recordings()[name]
    plan = PLANS[case](name)
    assert not unary.serves(plan)
    got = _reshaped(rec.body, plan, True)
    assert rec.body in json_decodes
    assert got == _general(rec.body, plan)


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@pytest.mark.parametrize("name", ["completions_unary_ids", "vllm-0.33/completions_unary_ids"])
def test_prompt_ids_vllm_sends_by_itself_stay_in_a_completions_choice(name, compiled):
    rec = recordings()[name]
    plan = replace(_trio_plan(name), vllm_sends_prompt_ids=True)
    got = _reshaped(rec.body, plan, compiled)
    assert got == _general(rec.body, plan)
    assert got is not None
    choice = orjson.loads(got)["choices"][0]
    assert choice["prompt_token_ids"] == orjson.loads(rec.body)["choices"][0]["prompt_token_ids"]
    assert choice["token_ids"] is None


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@pytest.mark.parametrize("ids", [None, "x", 5, [], "gone"])
@pytest.mark.parametrize("name", PLAIN)
def test_ids_that_are_not_a_list_are_not_reported(name, ids, compiled):
    def edit(obj: Any) -> None:
        choice = obj["choices"][0]
        if ids == "gone":
            del choice["token_ids"]
        else:
            choice["token_ids"] = ids

    body = _edited(name, edit)
    plan = _trio_plan(name)
    got = _reshaped(body, plan, compiled)
    assert got == _general(body, plan)
    assert got is not None
    answer = orjson.loads(got)
    assert answer["nvext"]["completion_token_ids"] == (ids if isinstance(ids, list) else None)


@pytest.mark.parametrize("pure_python", [False, True], ids=["compiled", "python"])
@pytest.mark.parametrize("name", PLAIN)
async def test_the_middleware_answers_a_plain_answer_with_the_general_paths_bytes(name, pure_python, json_decodes):
    if not pure_python:
        _scanner(True)  # the compiled path must be built (fails under VLLM_NVEXT_REQUIRE_EXTENSION)
    rec = recordings()[name]
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=rec.body)
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    request["nvext"] = {"extra_fields": ["completion_token_ids"]}
    app = NvextMiddleware(upstream, settings=Settings(pure_python=pure_python))
    result = await call(app, rec.path, json.dumps(request).encode())
    assert result.status == 200
    # The compiled path answers without decoding vLLM's answer; the pure-Python path decodes it (its scanner, the
    # Python twin, would decode it too: `Kernels.scans_plain`).
    answer_decoded = rec.body in json_decodes
    assert answer_decoded is pure_python
    assert result.body == _general(rec.body, _trio_plan(name))
    assert result.header(b"content-length") == str(len(result.body)).encode()


@pytest.mark.parametrize("compiled", [False, True], ids=["python", "c"])
@pytest.mark.parametrize(
    "body", [b"[1]", b'"x"', b"{}", b'{"choices":{}}', b'{"choices":[]}', b'{"choices":[1]}', b'{"choices":[[]]}']
)
def test_an_answer_without_a_choice_object_is_forwarded_as_vllm_sent_it(body, compiled):
    plan = _trio_plan("vllm-0.33/chat_unary_ids")
    assert _general(body, plan) is None
    assert _reshaped(body, plan, compiled) is None

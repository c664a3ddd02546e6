"""The middleware reads every request exactly as vLLM reads it.

vLLM decodes a body with `json.loads(bytes)` (starlette's `Request.json()`) and validates it with
its pydantic request models (lax coercion). Each test here compares the middleware's decision
with that reading: vLLM 0.32's own `CompletionRequest` / `ChatCompletionRequest` on the same
bytes. Regression tests name the finding they pin down.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.kernels import kernels_for
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings
from vllm_nvext import _json as nvjson
from vllm_nvext.inbound import fields as fields_module
from vllm_nvext.inbound import nvext_schema
from vllm_nvext.inbound import request as request_module
from vllm_nvext.inbound.fields import DECISION_FIELDS, DecisionFields, field_reader, read_fields, replica_model
from vllm_nvext.inbound.optin import OptInScan, might_opt_in, opts_in_whole
from vllm_nvext.inbound.plan import Plan
from vllm_nvext.inbound.request import plan, plan_request, read_request
from vllm_nvext.protocol import PATHS, Endpoint, RequestError

vllm_completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
from pydantic import ValidationError  # noqa: E402  (vLLM brings pydantic)

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS
VLLM_MODELS = {COMPLETIONS: vllm_completion.CompletionRequest, CHAT: vllm_chat.ChatCompletionRequest}
JSON = ((b"content-type", b"application/json"),)
NVEXT_IDS = {"extra_fields": ["completion_token_ids"]}
BASE = {
    COMPLETIONS: {"model": "tiny", "prompt": "Hello", "max_tokens": 4},
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4},
}
SLOW = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same(a: Any, b: Any) -> bool:
    """Equality that counts NaN equal to NaN and tells 1 from 1.0 and True."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def vllm_reads(body: bytes, endpoint: Endpoint) -> tuple[dict | None, Any]:
    """What vLLM itself makes of `body`: the decoded JSON and its validated request (or the error)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, None
    try:
        return data, VLLM_MODELS[endpoint].model_validate(data)
    except ValidationError as exc:
        return data, exc
    except Exception as exc:  # vLLM's model validators raise their own error type: a 400 from vLLM
        return data, exc


# --- the replica's field definitions are vLLM's ------------------------------------------------

FIELD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.sampled_from([2**64, 2.0, 2.5, 1.0, 0.0, -1.0, float("nan"), float("inf"), 1e400, 72.0]),
    st.sampled_from(["2", "2.0", " 2 ", "true", "True", "false", "yes", "no", "on", "off", "1", "0", "t", "x", ""]),
    st.lists(st.sampled_from([72, 105, 72.0, "a", -1, True, [1, 2], [1.0], "Hello"]), max_size=3),
    st.dictionaries(st.sampled_from(["include_usage", "prompt_token_ids", "x"]), st.booleans(), max_size=2),
)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_replica_declares_exactly_vllms_fields(endpoint):
    replica, theirs = replica_model(endpoint), VLLM_MODELS[endpoint]
    for name, info in replica.model_fields.items():
        assert name in theirs.model_fields, name
        vinfo = theirs.model_fields[name]
        assert str(info.annotation).replace("typing.", "") == str(vinfo.annotation).replace("typing.", ""), name
        assert repr(info.default) == repr(vinfo.default), name


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
@SLOW
@given(field=st.sampled_from(sorted(replica_model(COMPLETIONS).model_fields)), value=FIELD_VALUES)
def test_replica_coerces_every_value_as_vllms_model(endpoint, field, value):
    replica = replica_model(endpoint)
    if field not in replica.model_fields:
        return
    data = {**BASE[endpoint], field: value}
    ours = theirs = None
    try:
        ours = getattr(replica.model_validate(data), field)
    except ValidationError:
        ours = "refused"
    try:
        theirs = getattr(VLLM_MODELS[endpoint].model_validate(data), field)
    except ValidationError as exc:
        # Errors without a field (vLLM's model validators) refuse the whole request for vLLM's own
        # reasons; only the field's own coercion is the replica's to match.
        theirs = "refused" if any(e["loc"][:1] == (field,) for e in exc.errors()) else "other"
    except Exception:  # a model validator comparing a wrong type: vLLM answers 400 for the request
        theirs = "other"
    if theirs == "other":
        return
    if ours == "refused" or theirs == "refused":
        assert ours == theirs, (field, value)
    else:
        assert _same(ours, theirs) or (isinstance(ours, list) and ours == theirs), (field, value, ours, theirs)


def test_inside_vllm_the_reader_takes_vllms_own_field_definitions():
    for endpoint, model in VLLM_MODELS.items():
        reader = field_reader(endpoint)
        assert reader is not replica_model(endpoint)
        for name in reader.model_fields:
            assert reader.model_fields[name].annotation == model.model_fields[name].annotation


# --- bodies with every hazard: the decision matches vLLM's own parse ---------------------------

HAZARDS = st.sampled_from(
    [b"NaN", b"Infinity", b"-Infinity", b"1e400", b'"\\ud800"', b'"\\udfff x"', b"123456789012345678901234567890",
     b"-0.0", b"[[[[[[[[[[]]]]]]]]]]", b'"\\u00e9t\\u00e9"', b'"nvext"', b"1.5e-400"]
)  # fmt: skip
DECISIONS = st.fixed_dictionaries(
    {},
    optional={
        "return_token_ids": st.sampled_from([True, False, "true", "false", 1, 0, "yes", 1.0, None, "maybe", 2]),
        "n": st.sampled_from([1, 2, "2", 2.0, "1", 1.0, None, 2.5, "x"]),
        "echo": st.sampled_from([True, False, "true", 1, 0, None]),
        "logprobs": st.sampled_from([None, 0, 2, True, "1"]),
        "stream": st.sampled_from([False, "false", 0]),
        "prompt_logprobs": st.sampled_from([None, 1]),
        "nvext": st.sampled_from(
            [
                None,
                {},
                NVEXT_IDS,
                {"extra_fields": ["engine_data"]},
                {"extra_fields": ["prompt_token_ids"]},
                {"token_data": [72, 105]},
                {"greed_sampling": True, "cache_salt": "s\ud800"},
                {"token_data": [-1]},
                5,
            ]
        ),  # fmt: skip
    },
)
PROMPTS = st.sampled_from(["Hello", [72.0, 105.0], [72, 105], ["a", "b"], [[1, 2], [3]], ["a", 1], [1.5]])
ENCODINGS = st.sampled_from(["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-be"])


def _spell(key: str, escape: list[bool]) -> str:
    return "".join(f"\\u{ord(c):04X}" if e else c for c, e in zip(key, escape, strict=False))


@st.composite
def hazardous_bodies(draw) -> tuple[bytes, Endpoint]:
    endpoint = draw(st.sampled_from([COMPLETIONS, CHAT]))
    fields = {**BASE[endpoint], **draw(DECISIONS)}
    if endpoint is COMPLETIONS:
        fields["prompt"] = draw(PROMPTS)
    members = [json.dumps(k, ensure_ascii=False) + ":" + json.dumps(v, ensure_ascii=False) for k, v in fields.items()]
    members = [m.replace('"\\ud800"', '"\\ud800"') for m in members]
    for hazard in draw(st.lists(HAZARDS, max_size=3)):
        members.insert(draw(st.integers(0, len(members))), f'"x{len(members)}":{hazard.decode()}')
    text = "{" + ",".join(members) + "}"
    for key in ("nvext", "return_token_ids"):  # keys spelled with escapes read the same to vLLM
        if f'"{key}"' in text and draw(st.booleans()):
            text = text.replace(f'"{key}"', '"' + _spell(key, draw(st.lists(st.booleans(), min_size=16))) + '"', 1)
    encoding = draw(ENCODINGS)
    body = text.encode(encoding, "surrogatepass")
    return body, endpoint


def _expected_opt_in(data: dict) -> bool:
    rti = data.get("return_token_ids")
    try:
        reads_true = replica_model(COMPLETIONS).model_validate({"return_token_ids": rti}).return_token_ids is True
    except ValidationError:
        reads_true = True  # an invalid value is refused, never ignored
    return "nvext" in data or reads_true


@SLOW
@given(case=hazardous_bodies(), mode=st.sampled_from(list(Mode)))
def test_decision_matches_vllms_own_parse(case, mode):
    body, endpoint = case
    data, validated = vllm_reads(body, endpoint)
    try:
        plan = plan_request(body, endpoint, mode)
    except RequestError as exc:
        # Refused: only for a body vLLM reads, that opts in, and is wrong for a dialect or for vLLM.
        assert data is not None and _expected_opt_in(data), exc.message
        assert exc.status == 400 and exc.param
        if isinstance(validated, Exception):
            return  # vLLM refuses this request too: a 400 either way, never a different answer
        assert exc.param.startswith("nvext") or exc.param in {"n", "prompt", "echo", "x-nvext-mode"}, exc.message
        return
    if data is None or not isinstance(data, dict):
        assert plan is None, "a body vLLM cannot decode goes to vLLM, which answers its own 400"
        return
    assert (plan is not None) == _expected_opt_in(data), "opts in exactly when vLLM sees nvext or true ids"
    if plan is None:
        return
    assert not isinstance(validated, ValidationError) or not any(
        e["loc"][:1] in (("n",), ("return_token_ids",), ("prompt",), ("echo",)) for e in validated.errors()
    ), "a decision field vLLM refuses is never planned on"
    upstream = data if plan.body is None else json.loads(plan.body)
    assert "nvext" not in upstream
    touched = {"nvext", "return_token_ids", "temperature", "cache_salt", "prompt", "kv_transfer_params"}
    for key, value in data.items():
        if key not in touched:
            assert key in upstream and _same(upstream[key], value), f"{key} changed on the way to vLLM"
    n = None if isinstance(validated, Exception) else validated.n
    if plan.nvext_trio and n is not None:
        assert n == 1
    nvext = data.get("nvext") or {}
    if plan.strip_vllm_ids or plan.vllm_placement:
        assert VLLM_MODELS[endpoint].model_fields["return_token_ids"].annotation  # vLLM has the field
        reads = replica_model(endpoint).model_validate({"return_token_ids": upstream.get("return_token_ids")})
        assert reads.return_token_ids is True, "vLLM is asked for ids whenever the plan relies on them"
    if endpoint is COMPLETIONS and nvext.get("token_data"):
        assert upstream["prompt"] == nvext["token_data"]


@SLOW
@given(case=hazardous_bodies(), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_streamed_opt_in_scan_equals_the_whole_body_test(case, cuts):
    body, _ = case
    scan = OptInScan()
    prev = 0
    for cut in [*sorted(set(cuts)), len(body)]:
        scan.feed(body[prev:cut])
        prev = max(prev, cut)
    assert scan.found == might_opt_in(body)


@SLOW
@given(
    body=hazardous_bodies().map(lambda case: case[0])
    | st.binary(max_size=40)
    | st.sampled_from([b"", b"{", b"\xef\xbb", b"\x00{", b"{}\x00", b'"nvext"', b'{"\\u006evext":1}', b"\xff\xfe{\x00"])
)
def test_a_whole_body_opts_in_as_the_scan_of_its_one_piece_decides(body):
    """The middleware's test for a body that comes in one message is the scan's, for any bytes."""
    assert opts_in_whole(body) is OptInScan().feed(body)


# Heads json.detect_encoding tells apart (BOMs, NULs) and pieces of every spelling of the keys.
_HEADS = st.sampled_from([b"", b"{", b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff", b"\x00", b"{\x00", b"\x00\x00", b" "])
_PIECES = st.sampled_from(
    [b'"nvext"', b'"return_token_ids"', b"nvext", b"return_token_ids", b'"', b"\\u", b"\x00", b"x", b":1", b"\xff"]
    + [b'"\\u006evext"', b'"nvex\\u0074"', b'"return_token_id\\u0073"']
)


@SLOW
@given(head=_HEADS, pieces=st.lists(_PIECES, max_size=6))
def test_the_one_piece_opt_in_test_is_the_scan_split_at_every_boundary(head, pieces):
    """`opts_in_whole`, the one function an opt-out request enters, decides as the general scan does
    however the same bytes are split (and as `might_opt_in` for a body of four bytes or more)."""
    body = head + b"".join(pieces)
    whole = opts_in_whole(body)
    for cut in range(len(body) + 1):
        scan = OptInScan()
        scan.feed(body[:cut])
        scan.feed(body[cut:])
        assert scan.found is whole, (body, cut)
    if len(body) >= 4:
        assert whole is might_opt_in(body)


@SLOW
@given(case=hazardous_bodies())
def test_a_body_that_does_not_look_in_never_opts_in(case):
    body, endpoint = case
    if not might_opt_in(body):
        data, _ = vllm_reads(body, endpoint)
        assert data is None or not isinstance(data, dict) or not _expected_opt_in(data)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@SLOW
@given(
    obj=st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=6),
    drop=st.sets(st.text(max_size=5), max_size=3),
    indent=st.sampled_from([None, 1, "\t"]),
)
def test_splice_keeps_every_other_member_exactly(obj, drop, indent):
    text = " " + json.dumps(obj, indent=indent, ensure_ascii=False) + "\n"
    members, end = nvjson.object_members(text, 1)
    assert [m.key for m in members] == list(obj) and end == len(text) - 1
    assert all(json.loads(text[m.value_start : m.end]) == obj[m.key] for m in members), "each value ends where it does"
    out = nvjson.splice_object(text, 1, frozenset(drop), [("added", "true")])
    expected = {k: v for k, v in obj.items() if k not in drop and k != "added"}
    expected["added"] = True
    assert json.loads(out) == expected
    for m in members:
        if m.key not in drop and m.key != "added":
            assert text[m.start : m.end] in out


@SLOW
@given(
    obj=st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=6),
    gaps=st.lists(st.sampled_from(["", " ", "\t", "\n ", "\r\n", "  "]), min_size=40, max_size=40),
)
def test_members_are_found_whatever_whitespace_sits_in_any_gap(obj, gaps):
    # whitespace before and after every key, colon and comma, where json.dumps never puts it
    it = iter(gaps * 4)
    members_text = [f"{next(it)}{json.dumps(k)}{next(it)}:{next(it)}{json.dumps(v)}{next(it)}" for k, v in obj.items()]
    text = "{" + next(it) + ",".join(members_text) + "}" if members_text else "{" + next(it) + "}"
    members, end = nvjson.object_members(text, 0)
    assert [m.key for m in members] == list(obj) and end == len(text), "a member was missed or the end misread"
    assert all(json.loads(text[m.value_start : m.end]) == obj[m.key] for m in members), "a value was misread"
    assert all(text[m.start] == '"' and text[m.value_start] not in " \t\r\n" for m in members)


# --- regressions: each finding, as a unit test --------------------------------------------------


def _plan(body: bytes | dict, endpoint=COMPLETIONS, mode=Mode.AUTO, **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return plan_request(raw, endpoint, mode, **kw)


def test_nan_body_is_read_and_its_nan_kept():
    body = (
        b'{"model":"tiny","prompt":"Hello","max_tokens":4,'
        b'"nvext":{"token_data":[72,105],"extra_fields":["completion_token_ids"]},"x":NaN}'
    )
    plan = _plan(body)
    assert plan is not None and plan.nvext_trio
    assert plan.body is not None and b'"x":NaN' in plan.body
    assert json.loads(plan.body)["prompt"] == [72, 105]


@pytest.mark.parametrize(
    "prefix,encoding", [(b"", "utf-16"), (b"", "utf-32"), (b"\xef\xbb\xbf", "utf-8"), (b"", "utf-16-le")]
)
def test_bom_and_utf16_32_bodies_are_read(prefix, encoding):
    body = prefix + json.dumps({**BASE[COMPLETIONS], "nvext": {"greed_sampling": True}}).encode(encoding)
    plan = _plan(body)
    assert plan is not None and plan.body is not None
    assert json.loads(plan.body)["temperature"] == 0.0 and "nvext" not in json.loads(plan.body)


@pytest.mark.parametrize("n", ["2", 2.0, " 2"])
def test_n_as_vllm_coerces_it_counts_as_two_choices(n):
    with pytest.raises(RequestError) as err:
        _plan({**BASE[COMPLETIONS], "n": n, "nvext": NVEXT_IDS})
    assert err.value.param == "n"


def test_n_vllm_refuses_is_refused_naming_it():
    with pytest.raises(RequestError) as err:
        _plan({**BASE[COMPLETIONS], "n": 2.5, "nvext": NVEXT_IDS})
    assert err.value.param == "n" and err.value.status == 400


@pytest.mark.parametrize("value", [True, "true", 1, "yes", "True"])
def test_return_token_ids_as_vllm_coerces_it(value):
    plan = _plan({**BASE[COMPLETIONS], "return_token_ids": value})
    assert plan is not None and plan.vllm_placement and plan.body is None, "vLLM already reads it as true: no rewrite"


@pytest.mark.parametrize("value", [False, "false", 0, "no"])
def test_return_token_ids_false_as_vllm_reads_it_opts_into_nothing(value):
    assert _plan({**BASE[COMPLETIONS], "return_token_ids": value}) is None


def test_float_token_ids_are_one_prompt_not_a_batch():
    plan = _plan({**BASE[COMPLETIONS], "prompt": [72.0, 105.0], "nvext": NVEXT_IDS})
    assert plan is not None and plan.nvext_trio


def test_echo_with_ids_the_middleware_turns_on_puts_the_prompt_back():
    plan = _plan({**BASE[COMPLETIONS], "echo": True, "nvext": NVEXT_IDS})
    assert plan is not None and plan.echo_prompts == (BASE[COMPLETIONS]["prompt"],)
    ids = _plan({**BASE[COMPLETIONS], "prompt": [72.0, 105.0], "echo": True, "nvext": NVEXT_IDS})
    assert ids is not None and ids.echo_prompts == ((72, 105),), "id prompts are decoded by vLLM before going upstream"
    batch = _plan({**BASE[COMPLETIONS], "prompt": ["a", "b"], "n": 2, "echo": True, "nvext": NVEXT_IDS},
                  mode=Mode.VLLM)  # fmt: skip
    assert batch is not None and batch.echo_prompts == ("a", "b") and batch.n == 2
    own = _plan({**BASE[COMPLETIONS], "echo": "true", "return_token_ids": True}, mode=Mode.NVEXT)
    assert own is not None and own.echo_prompts == (), "the client's own return_token_ids: stock vLLM drops it too"
    with pytest.raises(RequestError) as refused:
        _plan({**BASE[COMPLETIONS], "prompt": None, "prompt_embeds": "AAAA", "echo": True, "nvext": NVEXT_IDS})
    assert refused.value.param == "echo", "embeddings have no text to put back"


def test_unary_echo_never_keeps_prompt_ids_the_client_did_not_ask_for():
    unary = _plan({**BASE[COMPLETIONS], "echo": True, "return_token_ids": True}, mode=Mode.NVEXT)
    stream = _plan({**BASE[COMPLETIONS], "echo": True, "stream": "true", "return_token_ids": True}, mode=Mode.NVEXT)
    assert unary is not None and not unary.vllm_sends_prompt_ids and unary.strip_vllm_ids
    assert stream is not None and stream.vllm_sends_prompt_ids, "vLLM sends prompt ids itself only on echo streams"


@pytest.mark.parametrize("depth", [100, 900])
def test_deep_nesting_is_planned_without_re_encoding_it(depth):
    nested = b"[" * depth + b"]" * depth
    body = b'{"model":"tiny","prompt":"Hello","x":' + nested + b',"nvext":{"greed_sampling":true}}'
    plan = _plan(body)
    assert plan is not None and plan.body is not None and nested in plan.body


def test_nesting_too_deep_to_decode_goes_to_vllm_which_refuses_it():
    body = b'{"return_token_ids":true,"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert read_request(body, COMPLETIONS) is None


def test_lone_surrogate_with_a_long_digit_run_is_kept_exactly():
    body = b'{"model":"tiny","prompt":"Hello \\ud800 12345678901234567890123","seed":1,"nvext":{"greed_sampling":true}}'
    plan = _plan(body)
    assert plan is not None and plan.body is not None
    assert b'"Hello \\ud800 12345678901234567890123"' in plan.body


def test_out_of_range_number_is_never_rewritten():
    body = b'{"model":"tiny","prompt":"x","presence_penalty":1e400,"seed":123456789012345678901234,"nvext":{}}'
    plan = _plan(body)
    assert plan is not None and plan.body is not None
    assert b'"presence_penalty":1e400' in plan.body and b'"seed":123456789012345678901234' in plan.body


def test_token_data_error_names_the_bad_element():
    with pytest.raises(RequestError) as err:
        _plan({**BASE[COMPLETIONS], "nvext": {"token_data": [5, -1]}})
    assert err.value.param == "nvext.token_data" and "-1 at index 1" in err.value.message


def test_dp_rank_conflicting_with_the_clients_header_is_refused():
    body = {**BASE[COMPLETIONS], "nvext": {"dp_rank": 1}}
    with pytest.raises(RequestError) as err:
        _plan(body, dp_rank_header=b"0")
    assert err.value.param == "nvext.dp_rank"
    with pytest.raises(RequestError):
        _plan(body, dp_rank_header=b"one")  # vLLM reads no rank from it: it would ignore ours
    same = _plan(body, dp_rank_header=b" 1")
    assert same is not None and same.headers == (), "the client's header already says it"
    alone = _plan(body)
    assert alone is not None and alone.headers == ((b"x-data-parallel-rank", b"1"),)


# --- the middleware's reading of headers and of the body's size ---------------------------------


def _upstream_app(**settings_kw) -> tuple[NvextMiddleware, Upstream]:
    upstream = Upstream(body=b'{"choices":[]}')
    return NvextMiddleware(upstream, settings=Settings(**settings_kw)), upstream


async def test_first_content_type_decides_as_in_vllm():
    app, upstream = _upstream_app()
    body = json.dumps({**BASE[COMPLETIONS], "nvext": {"greed_sampling": True}}).encode()
    await call(app, PATHS[COMPLETIONS], body, headers=((b"content-type", b"application/json"), (b"content-type", b"x")))
    assert upstream.received is not None and json.loads(upstream.received)["temperature"] == 0.0
    app, upstream = _upstream_app()
    await call(app, PATHS[COMPLETIONS], body, headers=((b"content-type", b"text/plain"), *JSON))
    assert upstream.received == body, "vLLM does not read it as JSON: it reaches vLLM untouched"


@pytest.mark.parametrize("mode", [b"", b"  ", b"bogus"])
async def test_mode_header_never_fails_a_request_that_opts_into_nothing(mode):
    app, upstream = _upstream_app()
    body = json.dumps(BASE[COMPLETIONS]).encode()
    result = await call(app, PATHS[COMPLETIONS], body, headers=(*JSON, (b"x-nvext-mode", mode)))
    assert result.status == 200 and upstream.received == body


async def test_empty_mode_header_counts_as_absent_and_differing_repeats_are_refused():
    body = json.dumps({**BASE[COMPLETIONS], "return_token_ids": True}).encode()
    app, upstream = _upstream_app(mode=Mode.VLLM)
    assert (await call(app, PATHS[COMPLETIONS], body, headers=(*JSON, (b"x-nvext-mode", b"")))).status == 200
    same = (*JSON, (b"x-nvext-mode", b"nvext"), (b"x-nvext-mode", b"NVEXT"))
    assert (await call(app, PATHS[COMPLETIONS], body, headers=same)).status == 200
    app, upstream = _upstream_app()
    differ = (*JSON, (b"x-nvext-mode", b"nvext"), (b"x-nvext-mode", b"vllm"))
    result = await call(app, PATHS[COMPLETIONS], body, headers=differ)
    assert result.status == 400 and upstream.calls == 0
    assert json.loads(result.body)["error"]["param"] == "x-nvext-mode"


async def test_echo_with_ids_the_middleware_turns_on_is_served():
    # The echoed prompt is put back in the answer (tests/e2e/test_edges.py compares it with stock vLLM).
    app, upstream = _upstream_app()
    body = json.dumps({**BASE[COMPLETIONS], "echo": True, "nvext": NVEXT_IDS}).encode()
    result = await call(app, PATHS[COMPLETIONS], body)
    assert result.status == 200 and upstream.calls == 1
    assert upstream.received is not None and json.loads(upstream.received)["return_token_ids"] is True


@pytest.mark.parametrize("cuts", [(), (10, 500, 1500)])
async def test_body_over_the_cap_that_opts_into_nothing_streams_through_byte_for_byte(cuts):
    app, upstream = _upstream_app(max_body_bytes=1000)
    body = json.dumps({**BASE[COMPLETIONS], "prompt": "\\u00e9 nvext " * 400}).encode()
    result = await call(app, PATHS[COMPLETIONS], body, request_cuts=cuts)
    assert result.status == 200 and upstream.received == body


async def test_body_over_the_cap_that_opts_in_late_is_a_413_and_vllm_is_told_the_client_left():
    app, upstream = _upstream_app(max_body_bytes=1000)
    body = json.dumps({**BASE[COMPLETIONS], "user": "x" * 3000, "nvext": NVEXT_IDS}).encode()
    result = await call(app, PATHS[COMPLETIONS], body, request_cuts=(500, 1500, 2500))
    assert result.status == 413 and "1000" in json.loads(result.body)["error"]["message"]
    assert upstream.received is not None and b"nvext" not in upstream.received


async def test_body_over_the_cap_that_opts_in_early_is_a_413_without_vllm():
    app, upstream = _upstream_app(max_body_bytes=1000)
    body = json.dumps({"nvext": NVEXT_IDS, **BASE[COMPLETIONS], "user": "x" * 3000}).encode()
    result = await call(app, PATHS[COMPLETIONS], body, request_cuts=(500, 1500))
    assert result.status == 413 and upstream.calls == 0


@SLOW
@given(value=JSON_VALUES)
def test_dumps_text_writes_what_json_dumps_writes(value):
    # dumps_text builds its encoder once; json.dumps builds the same one on every call
    try:
        want = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except ValueError as exc:  # an infinity: refused alike, with the same words
        with pytest.raises(ValueError) as got:
            nvjson.dumps_text(value)
        assert str(got.value) == str(exc)
        return
    assert nvjson.dumps_text(value) == want


# --- what read_fields and plan keep: the same as made anew ----------------------------------


def _outcome(make: Any) -> Any:
    try:
        made = make()
    except RequestError as exc:
        return ("refused", exc.message, exc.param, exc.status)
    if isinstance(made, Plan):  # what the ASGI layer and the response side read of it, too
        return made, made.reshapes_answer, made.reshapes_response
    return made


def _made_anew(make: Any) -> Any:
    """`make()` with nothing kept: read_fields validates, plan plans."""
    fields_module._READ.clear()
    nvext_schema._READ.clear()
    request_module._READINGS.clear()
    return _outcome(make)


SCALARS = st.none() | st.booleans() | st.integers(-3, 3) | st.integers(2**63, 2**70) | st.sampled_from(
    ["", "1", "2", "true", "false", "yes", "0", "x", "1.0", " 1", "-1", "None"])  # fmt: skip


@SLOW
@given(
    data=st.dictionaries(st.sampled_from(sorted(DECISION_FIELDS | {"model", "max_tokens"})), SCALARS, max_size=6),
    endpoint=st.sampled_from([COMPLETIONS, CHAT, Endpoint.CHAT_BATCH]),
    names=st.sampled_from([None, ("return_token_ids",)]),
)
def test_a_kept_reading_is_the_reading_made_anew(data, endpoint, names):
    """Scalar decision fields are read once and kept: the kept reading is what vLLM's reading gives."""
    first = _outcome(lambda: read_fields(data, endpoint, names))
    again = _outcome(lambda: read_fields(dict(data), endpoint, names))
    assert again == first == _made_anew(lambda: read_fields(data, endpoint, names))
    if isinstance(first, DecisionFields):
        assert again is first, "kept: the same reading"


def test_only_plain_fields_are_kept():
    """Plain values are read once and handed out again; a prompt of ids is read anew each time."""
    scalar = read_fields({"n": 2, "stream": True}, COMPLETIONS)
    assert read_fields({"stream": True, "n": 2}, COMPLETIONS) is scalar
    ids = read_fields({"prompt": [1, 2], "n": 2}, COMPLETIONS)
    assert read_fields({"prompt": [1, 2], "n": 2}, COMPLETIONS) is not ids
    assert DecisionFields(n=2, stream=True) == scalar


@pytest.mark.parametrize(("one", "other"), [(True, 1), ("1", 1), (0, False), ("true", True), (2, "2")])
def test_values_equal_in_python_but_of_other_types_are_read_apart(one, other):
    def validated(value: Any) -> Any:
        try:
            return DecisionFields(**field_reader(CHAT).model_validate({"n": value, "echo": value}).__dict__)
        except ValidationError:
            return "refused"

    for value in (other, one, other, one):
        read = _outcome(lambda v=value: read_fields({"n": v, "echo": v}, CHAT))
        assert (read[0] if isinstance(read, tuple) else read) == validated(value), value


@SLOW
@given(case=hazardous_bodies(), mode=st.sampled_from(list(Mode)), hides=st.booleans())
def test_a_kept_plan_is_the_plan_made_anew(case, mode, hides):
    """vLLM-dialect plans are kept per reading of the fields: each is the plan made anew."""
    body, endpoint = case

    def make() -> Any:
        request = read_request(body, endpoint)
        return None if request is None else plan(request, mode, hides_reasoning_ids=hides)

    first = _outcome(make)
    assert _outcome(make) == first == _made_anew(make)


PLAIN_NVEXT = st.fixed_dictionaries(
    {},
    optional={
        "extra_fields": st.lists(
            st.sampled_from(["completion_token_ids", "prompt_token_ids", "engine_data", "timing", "worker_id", "x", 1]),
            max_size=3,
        ),
        "greed_sampling": st.sampled_from([True, False, None, 1, "true"]),
        "cache_salt": st.sampled_from(["", "s", "s\ud800", "\u00e9", None, 5, "x" * 70]),
        "annotations": st.sampled_from([[], ["a"], ["a", "b"], None]),
        "backend_instance_id": st.sampled_from([0, 3, -1, True, None]),
        "dp_rank": st.sampled_from([None, 0, 1]),
        "max_thinking_tokens": st.sampled_from([None, 0, 8]),
        "token_data": st.sampled_from([None, [1, 2]]),
        "request_timestamp_ms": st.sampled_from([0.0, -0.0, 5, None]),
        "agent_hints": st.sampled_from([{"priority": 1}, None]),
        "unknown": st.just(1),
    },
)
OTHER_MEMBERS = st.fixed_dictionaries(
    {},
    optional={
        "user": st.sampled_from(["u", "\u00e9", "x" * 100]),
        "temperature": st.sampled_from([0, 0.5, None]),
        "cache_salt": st.just("root"),
        "thinking_token_budget": st.sampled_from([4, None]),
        "max_tokens": st.integers(1, 9),
    },
)


@st.composite
def nvext_bodies(draw, nvext: dict[str, Any], decisions: dict[str, Any], endpoint: Endpoint) -> bytes:
    """A body with these decision fields and this nvext, and any other members, in any order and encoding."""
    members = {**BASE[endpoint], **draw(OTHER_MEMBERS), **decisions, "nvext": nvext}
    if endpoint is CHAT:
        members["messages"] = [{"role": "user", "content": draw(st.sampled_from(["Hi", "x" * 80, "\u00e9"]))}]
    items = draw(st.permutations(list(members.items())))
    text = json.dumps(dict(items), ensure_ascii=draw(st.booleans()))
    return text.encode(draw(st.sampled_from(["utf-8", "utf-8", "utf-16"])), "surrogatepass")


@SLOW
@given(
    data=st.data(),
    endpoint=st.sampled_from([COMPLETIONS, CHAT]),
    nvext=PLAIN_NVEXT,
    decisions=DECISIONS.map(lambda d: {k: v for k, v in d.items() if k != "nvext"}),
    mode=st.sampled_from(list(Mode)),
    hides=st.booleans(),
    header=st.sampled_from([None, b"1", b"x"]),
    compiled=st.booleans(),
)
def test_a_kept_nvext_plan_is_the_plan_made_anew(data, endpoint, nvext, decisions, mode, hides, header, compiled):
    """nvext plans are kept per reading of the fields and of `nvext` (each request's body spliced
    anew): for another body with the same readings the kept plan is the plan made anew."""
    splice_root = kernels_for("c").splice_root if compiled else None
    first, other = (data.draw(nvext_bodies(nvext, decisions, endpoint)) for _ in range(2))

    def make(body: bytes) -> Any:
        request = read_request(body, endpoint)
        kw = {"dp_rank_header": header, "hides_reasoning_ids": hides, "splice_root": splice_root}
        return None if request is None else plan(request, mode, **kw)

    _made_anew(lambda: make(first))  # what is kept now: the readings and plan of `first`
    kept = _outcome(lambda: make(other))
    assert kept == _outcome(lambda: make(other)) == _made_anew(lambda: make(other))


def test_an_nvext_plan_is_kept_with_each_requests_own_body():
    bodies = [
        json.dumps({"nvext": NVEXT_IDS, **BASE[CHAT], "stream": True, "user": user}).encode() for user in ("a", "bc")
    ]
    requests = [read_request(body, CHAT) for body in bodies]
    plans = [plan(request, Mode.AUTO) for request in requests]  # type: ignore[arg-type]
    reading = requests[1].reading  # type: ignore[union-attr]
    assert reading is not None and requests[0].reading is reading, "one reading for both bodies"
    template, _, _ = reading.plans[(Mode.AUTO, False)]
    assert template.body is None, "no body is kept"
    assert [json.loads(p.body)["user"] for p in plans] == ["a", "bc"]  # type: ignore[arg-type]
    assert _outcome(lambda: plans[1]) == _made_anew(lambda: plan(read_request(bodies[1], CHAT), Mode.AUTO))  # type: ignore[arg-type]


def test_an_nvext_reading_is_kept_only_when_valid_and_made_of_plain_values():
    one, again = ({"extra_fields": ["timing"], "greed_sampling": True} for _ in range(2))
    reading = nvext_schema.read_nvext(one)
    assert type(reading) is nvext_schema.KeptNvext and reading == one and list(reading) == list(one)
    assert nvext_schema.read_nvext(again) is reading, "the same value: the kept reading"
    assert nvext_schema.read_nvext({"greed_sampling": True, "extra_fields": ["timing"]}) is not reading, "in order"
    one["extra_fields"].append("engine_data")
    assert reading["extra_fields"] == ["timing"], "the body that was read cannot change the kept reading"
    long = {"extra_fields": ["timing"] * 17}, {"cache_salt": "s" * 65}
    for fresh in ({"request_timestamp_ms": -0.0}, {"token_data": [1]}, {"agent_hints": {"osl": 2}}, *long):
        assert type(nvext_schema.read_nvext(fresh)) is dict, "read anew each time: " + repr(fresh)
    with pytest.raises(RequestError):
        nvext_schema.read_nvext({"greed_sampling": "true"})
    assert not any(key[:2] == ("greed_sampling", str) for key in nvext_schema._READ), "a refusal is never kept"


def test_a_vllm_dialect_plan_is_kept_per_mode_and_server():
    body = json.dumps({**BASE[CHAT], "return_token_ids": True, "stream": True, "include_reasoning": False}).encode()
    request = read_request(body, CHAT)
    assert request is not None
    kept_plan = plan(request, Mode.AUTO)
    assert plan(read_request(body, CHAT), Mode.AUTO) is kept_plan  # type: ignore[arg-type]
    assert _outcome(lambda: plan(request, Mode.NVEXT)) == _made_anew(lambda: plan(request, Mode.NVEXT))
    assert plan(request, Mode.NVEXT) != kept_plan
    hidden = plan(request, Mode.AUTO, hides_reasoning_ids=True)
    assert hidden.ids_withheld and not kept_plan.ids_withheld


def test_what_is_kept_stays_bounded_whatever_clients_send(monkeypatch):
    """Made-up values (a `cache_salt`, an `n`) cannot grow what the request side keeps."""
    monkeypatch.setattr(fields_module, "_READ_MAX", 4)
    monkeypatch.setattr(nvext_schema, "_READ_MAX", 4)
    monkeypatch.setattr(request_module, "_READINGS_MAX", 4)
    for n in range(1, 12):
        body = json.dumps({**BASE[COMPLETIONS], "return_token_ids": True, "n": n, "logprobs": n}).encode()
        request = read_request(body, COMPLETIONS)
        assert request is not None and request.fields.n == n
        assert plan(request, Mode.AUTO).n == n
        salted = json.dumps({**BASE[COMPLETIONS], "nvext": {**NVEXT_IDS, "cache_salt": f"s{n}"}}).encode()
        assert json.loads(plan(read_request(salted, COMPLETIONS), Mode.AUTO).body)["cache_salt"] == f"s{n}"  # type: ignore[arg-type]
        assert len(fields_module._READ) <= 4 and len(nvext_schema._READ) <= 4 and len(request_module._READINGS) <= 4


def test_a_reader_that_reads_other_keys_is_never_kept():
    """A field read under an alias would make the kept key wrong: such a reader always validates."""
    from pydantic import ConfigDict, Field, create_model

    aliased = create_model("Aliased", __config__=ConfigDict(extra="ignore"), n=(int, Field(1, alias="count")))
    assert fields_module._scalar_key(aliased, {"count": 2}) is None
    assert fields_module._scalar_key(replica_model(CHAT), {"n": 2}) is not None


NVEXT_VALUES = (
    st.none()
    | PLAIN_NVEXT
    | st.sampled_from(
        [5, "x", [1], {"agent_hints": {"osl": 1}}, {"extra_fields": ["timing"] * 17}, {"annotations": ["a" * 65]}]
    )
)


@SLOW
@given(
    data=st.dictionaries(st.sampled_from(sorted(DECISION_FIELDS | {"model", "max_tokens"})), SCALARS, max_size=6),
    nvext=st.just(None) | NVEXT_VALUES.map(lambda v: {"nvext": v}),
    endpoint=st.sampled_from([COMPLETIONS, CHAT]),
)
def test_one_reading_per_body_is_the_two_readings(data, nvext, endpoint):
    """`reading_key` (one reading per body) is made of exactly the fields' key and `nvext`'s plain key
    (each proven by the kept-reading tests above), and is None when either is."""
    data = {**data, **(nvext or {})}
    reader = field_reader(endpoint)
    scalar = fields_module._scalar_key(reader, data)
    if "nvext" not in data:
        tail: tuple[Any, ...] | None = ()
    elif data["nvext"] is None:
        tail = (fields_module._NULL_NVEXT,)
    elif isinstance(data["nvext"], dict):
        plain = nvext_schema._plain_key(data["nvext"])
        tail = None if plain is None else (fields_module._NVEXT, *plain)
    else:
        tail = None
    want = None if scalar is None or tail is None else (*scalar, *tail)
    assert fields_module.reading_key(data, endpoint) == want


@SLOW
@given(data=st.data(), case=hazardous_bodies(), nvext=PLAIN_NVEXT, mode=st.sampled_from(list(Mode)))
def test_a_kept_reading_of_a_body_is_the_request_read_anew(data, case, nvext, mode):
    """The request read from a kept reading (a body read before with the same readings) is the one read anew."""
    body, endpoint = case
    if data.draw(st.booleans()):
        body = data.draw(nvext_bodies(nvext, {}, endpoint))
    first = _outcome(lambda: read_request(body, endpoint))
    again = _outcome(lambda: read_request(body, endpoint))
    assert again == first == _made_anew(lambda: read_request(body, endpoint))
    if isinstance(again, request_module.Request) and again.reading is not None:
        assert again.fields is again.reading.fields and again.nvext is again.reading.nvext
        kept = _outcome(lambda: plan(again, mode))
        anew = _made_anew(lambda: plan(read_request(body, endpoint), mode))  # type: ignore[arg-type]
        assert kept == _outcome(lambda: plan(again, mode)) == anew


def test_a_reader_that_reads_other_keys_keeps_no_reading(monkeypatch):
    """Under an aliased reader a body's key would be wrong: no reading is kept for it, each is read anew."""
    from pydantic import ConfigDict, Field, create_model

    aliased = create_model("Aliased", __config__=ConfigDict(extra="ignore"), n=(int, Field(1, alias="count")))
    monkeypatch.setitem(fields_module._readers, (CHAT, True), aliased)
    assert fields_module.reading_key({"count": 2, "nvext": NVEXT_IDS}, CHAT) is None


def test_without_vllms_serving_code_the_fields_are_read_by_the_replica(monkeypatch):
    """Outside a vLLM server (the CLI, the proxy's tests) the replica reads the fields, until vLLM's models load."""
    monkeypatch.delitem(fields_module._readers, (CHAT, True), raising=False)
    for module_name, _ in fields_module._VLLM_MODELS[CHAT]:
        monkeypatch.delitem(sys.modules, module_name, raising=False)
    assert field_reader(CHAT) is replica_model(CHAT)
    monkeypatch.undo()
    assert field_reader(CHAT) is not replica_model(CHAT), "vLLM's own field definitions once loaded"

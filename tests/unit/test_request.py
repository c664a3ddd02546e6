"""Request normalization: both dialects fold into one nvext form; bad input is named."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_nvext.config import Mode
from vllm_nvext.inbound.optin import might_opt_in
from vllm_nvext.inbound.request import plan_request, read_request
from vllm_nvext.protocol import Endpoint, RequestError

CHAT, COMPLETIONS = Endpoint.CHAT, Endpoint.COMPLETIONS


def _body(**fields) -> bytes:
    return json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def _upstream(plan) -> dict:
    assert plan is not None and plan.body is not None
    return json.loads(plan.body)


def test_request_without_opt_in_passes_untouched():
    body = _body(max_tokens=3)
    assert not might_opt_in(body)
    assert plan_request(body, CHAT, Mode.NVEXT) is None


def test_escaped_key_spelling_still_triggers_a_parse():
    body = b'{"\\u0072eturn_token_ids": true}'
    assert might_opt_in(body)
    plan = plan_request(body, COMPLETIONS, Mode.NVEXT)
    assert plan is not None and plan.nvext_trio and not plan.vllm_ids


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'"nvext"', b'{"nvext": {}} x', b'{"nvext": {}'])
def test_unparseable_or_non_object_bodies_pass_through(body):
    assert plan_request(body, CHAT, Mode.AUTO) is None


def test_vllm_dialect_in_auto_mode_needs_no_response_work():
    plan = plan_request(_body(return_token_ids=True), CHAT, Mode.AUTO)
    assert plan is not None
    assert plan.vllm_ids and not plan.nvext_trio and not plan.reshapes_response
    assert plan.body is None  # vLLM gets the client's bytes


def test_nvext_dialect_becomes_return_token_ids_without_nvext():
    plan = plan_request(_body(nvext={"extra_fields": ["completion_token_ids"]}), CHAT, Mode.AUTO)
    up = _upstream(plan)
    assert up["return_token_ids"] is True and "nvext" not in up
    assert plan.nvext_trio and not plan.vllm_ids and plan.strip_vllm_ids


def test_alias_folds_idempotently_into_extra_fields():
    both = plan_request(
        _body(return_token_ids=True, nvext={"extra_fields": ["completion_token_ids", "completion_token_ids"]}),
        CHAT,
        Mode.AUTO,
    )
    assert both is not None and both.vllm_ids and both.nvext_trio and not both.strip_vllm_ids
    assert _upstream(both)["return_token_ids"] is True


@pytest.mark.parametrize(
    ("mode", "fields", "vllm_ids", "trio"),
    [
        (Mode.AUTO, {"return_token_ids": True}, True, False),
        (Mode.AUTO, {"nvext": {"extra_fields": ["completion_token_ids"]}}, False, True),
        (Mode.AUTO, {"return_token_ids": True, "nvext": {"extra_fields": ["completion_token_ids"]}}, True, True),
        (Mode.VLLM, {"nvext": {"extra_fields": ["completion_token_ids"]}}, True, False),
        (Mode.VLLM, {"return_token_ids": True}, True, False),
        (Mode.NVEXT, {"return_token_ids": True}, False, True),
        (Mode.NVEXT, {"nvext": {"extra_fields": ["completion_token_ids"]}}, False, True),
        (Mode.BOTH, {"return_token_ids": True}, True, True),
        (Mode.BOTH, {"nvext": {"extra_fields": ["completion_token_ids"]}}, True, True),
    ],
)
def test_mode_decides_placement(mode, fields, vllm_ids, trio):
    plan = plan_request(_body(**fields), CHAT, mode)
    assert plan is not None
    assert (plan.vllm_ids, plan.nvext_trio) == (vllm_ids, trio)
    assert plan.strip_vllm_ids == (not vllm_ids)


def test_prompt_token_ids_selector_alone_is_not_the_trio():
    plan = plan_request(_body(nvext={"extra_fields": ["prompt_token_ids"]}), CHAT, Mode.AUTO)
    assert plan is not None and plan.nvext_prompt_ids and not plan.nvext_trio


def test_unknown_extra_fields_strings_are_ignored():
    plan = plan_request(_body(nvext={"extra_fields": ["no_such_selector"]}), CHAT, Mode.NVEXT)
    assert plan is not None and not plan.reshapes_response
    assert "nvext" not in _upstream(plan)


def test_return_token_ids_false_in_vllm_mode_asks_nothing():
    plan = plan_request(_body(return_token_ids=False), CHAT, Mode.BOTH)
    assert plan is None


@pytest.mark.parametrize(
    ("fields", "endpoint", "param"),
    [
        ({"n": 2, "nvext": {"extra_fields": ["completion_token_ids"]}}, CHAT, "n"),
        ({"n": 2, "nvext": {"extra_fields": ["engine_data", "completion_token_ids"]}}, COMPLETIONS, "n"),
        ({"prompt": ["a", "b"], "nvext": {"extra_fields": ["completion_token_ids"]}}, COMPLETIONS, "prompt"),
    ],
)
def test_completion_token_ids_with_more_than_one_choice_is_refused(fields, endpoint, param):
    with pytest.raises(RequestError) as err:
        plan_request(_body(**fields), endpoint, Mode.AUTO)
    assert err.value.param == param, "the field the client sent that makes several choices"
    assert "requires exactly one generated choice" in err.value.message


@pytest.mark.parametrize(
    "selectors",
    [["engine_data"], ["stop_reason"], ["detailed_finish_reason"], ["timing"], ["prompt_token_ids"]],
)
@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_other_selectors_with_n_greater_than_one_are_answered(selectors, endpoint):
    # Dynamo 1.6.1 answers these with n > 1 (one prompt): only the trio needs one choice.
    plan = plan_request(_body(n=2, nvext={"extra_fields": selectors}), endpoint, Mode.AUTO)
    assert plan is not None and plan.reshapes_response


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"nvext": {"extra_fields": ["prompt_token_ids"]}}, "prompt_token_ids"),
        ({"nvext": {"extra_fields": ["engine_data"]}}, "engine_data"),
        ({"nvext": {"extra_fields": ["prompt_logprobs"]}, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"nvext": {"extra_fields": ["timing", "engine_data"]}}, "engine_data"),
    ],
)
@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]]])
def test_single_prompt_selectors_on_a_completions_batch_are_refused(fields, name, prompt):
    with pytest.raises(RequestError) as err:
        plan_request(_body(prompt=prompt, **fields), COMPLETIONS, Mode.AUTO)
    assert err.value.status == 400 and err.value.param == "prompt"
    assert f'["{name}"]' in err.value.message and "single prompt" in err.value.message


@pytest.mark.parametrize(
    "fields",
    [
        {"nvext": {"extra_fields": ["timing", "stop_reason", "detailed_finish_reason"]}},
        {"nvext": {"extra_fields": ["prompt_logprobs"]}},  # inert without vLLM's prompt_logprobs
        {"return_token_ids": True},  # vLLM placement: per-choice prompt ids, as raw vLLM
    ],
)
def test_a_completions_batch_is_served_when_nothing_describes_one_prompt(fields):
    plan = plan_request(_body(prompt=["a", "b"], **fields), COMPLETIONS, Mode.AUTO)
    assert plan is not None


def test_prompt_token_ids_in_vllm_placement_allows_a_batch():
    body = _body(prompt=["a", "b"], nvext={"extra_fields": ["prompt_token_ids"]})
    plan = plan_request(body, COMPLETIONS, Mode.VLLM)
    assert plan is not None and plan.vllm_ids and not plan.nvext_prompt_ids


def test_dynamo_message_for_completion_token_ids_with_n():
    with pytest.raises(RequestError) as err:
        plan_request(_body(n=3, return_token_ids=True), CHAT, Mode.NVEXT)
    assert err.value.message == '`nvext.extra_fields=["completion_token_ids"]` requires exactly one generated choice'


def test_n_greater_than_one_in_vllm_placement_is_allowed():
    plan = plan_request(_body(n=2, return_token_ids=True), CHAT, Mode.VLLM)
    assert plan is not None and plan.vllm_ids


def test_single_prompt_as_token_list_is_one_choice():
    body = json.dumps({"prompt": [1, 2, 3], "nvext": {"extra_fields": ["completion_token_ids"]}}).encode()
    plan = plan_request(body, COMPLETIONS, Mode.AUTO)
    assert plan is not None and plan.nvext_trio


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"return_token_ids": "maybe"}, "return_token_ids"),
        ({"return_token_ids": 2}, "return_token_ids"),
        ({"nvext": 5}, "nvext"),
        ({"nvext": []}, "nvext"),
        ({"nvext": "completion_token_ids"}, "nvext"),
        ({"nvext": {"extra_fields": "completion_token_ids"}}, "nvext.extra_fields"),
        ({"nvext": {"extra_fields": [1]}}, "nvext.extra_fields"),
        ({"nvext": {"bogus": 1}}, "nvext.bogus"),
        ({"nvext": {"greed_sampling": "true"}}, "nvext.greed_sampling"),
        ({"nvext": {"token_data": [1, -2]}}, "nvext.token_data"),
        ({"nvext": {"token_data": "1 2"}}, "nvext.token_data"),
        ({"nvext": {"dp_rank": 1.5}}, "nvext.dp_rank"),
        ({"nvext": {"cache_salt": 5}}, "nvext.cache_salt"),
        ({"nvext": {"agent_hints": {"priority": "high"}}}, "nvext.agent_hints.priority"),
        ({"nvext": {"agent_hints": {"mood": 1}}}, "nvext.agent_hints.mood"),
        ({"nvext": {"metadata_upload": {"url": " "}}}, "nvext.metadata_upload.url"),
        ({"nvext": {"router": []}}, "nvext.router"),
    ],
)
def test_bad_fields_are_refused_naming_the_field(fields, param):
    with pytest.raises(RequestError) as err:
        plan_request(_body(**fields), CHAT, Mode.AUTO)
    assert err.value.status == 400 and err.value.param == param
    assert param.split(".")[-1] in err.value.message


def test_nvext_request_fields_map_to_vllm():
    plan = plan_request(
        _body(
            temperature=0.9,
            cache_salt="root",
            nvext={"greed_sampling": True, "cache_salt": "salt", "max_thinking_tokens": 16, "dp_rank": 1},
        ),
        CHAT,
        Mode.AUTO,
    )
    up = _upstream(plan)
    assert up["temperature"] == 0.0 and up["cache_salt"] == "salt" and up["thinking_token_budget"] == 16
    assert (b"x-data-parallel-rank", b"1") in plan.headers


def test_token_data_becomes_the_completions_prompt():
    body = json.dumps({"prompt": "placeholder", "nvext": {"token_data": [5, 6, 7]}}).encode()
    assert _upstream(plan_request(body, COMPLETIONS, Mode.AUTO))["prompt"] == [5, 6, 7]


def test_token_data_on_chat_becomes_the_prompt_ids_vllm_takes_for_chat():
    up = _upstream(plan_request(_body(nvext={"token_data": [5, 6, 7]}), CHAT, Mode.AUTO))
    assert up["kv_transfer_params"]["prompt_token_ids"] == [5, 6, 7] and "nvext" not in up


IMAGE = [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "http://host/a.png"}}]


@pytest.mark.parametrize(
    "fields",
    [{"echo": True}, {"messages": [{"role": "user", "content": IMAGE}]}],
    ids=["echo", "non-text-content"],
)
def test_token_data_on_chat_is_refused_where_vllm_would_ignore_the_ids(fields):
    # vLLM would render the messages (echo, an image) and silently drop the ids: a 400 instead.
    with pytest.raises(RequestError) as err:
        plan_request(_body(**fields, nvext={"token_data": [5, 6, 7]}), CHAT, Mode.AUTO)
    assert err.value.status == 400 and err.value.param == "nvext.token_data"
    assert "echo" in err.value.message and "non-text" in err.value.message


def test_big_integers_survive_the_rewrite_exactly():
    body = b'{"prompt": "x", "seed": 123456789012345678901234567890, "nvext": {"extra_fields": []}}'
    up = _upstream(plan_request(body, COMPLETIONS, Mode.AUTO))
    assert up["seed"] == 123456789012345678901234567890


def _two_reads(body: bytes, endpoint):
    """read_request's field reads as they were: return_token_ids alone (the opt-in test), then all."""
    from vllm_nvext.inbound.fields import read_fields

    data = json.loads(body)
    rti = read_fields(data, endpoint, ("return_token_ids",)).return_token_ids
    if rti is not True and "nvext" not in data:
        return None
    return read_fields(data, endpoint)


@pytest.mark.parametrize(
    "extra",
    [
        {"return_token_ids": "x", "n": "many"},
        {"return_token_ids": "x"},
        {"n": "many", "max_tokens": "lots"},
        {"return_token_ids": True, "max_tokens": "lots"},
        {"return_token_ids": [], "temperature": "hot", "n": 0.5},
        {"max_tokens": 3},
    ],
)
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_nvext_dialect_names_the_field_the_two_reads_named(extra, endpoint):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} if endpoint is Endpoint.CHAT else {
        "model": "m", "prompt": "hi"}  # fmt: skip
    body = json.dumps({**base, "nvext": {"extra_fields": ["completion_token_ids"]}, **extra}).encode()
    try:
        want = _two_reads(body, endpoint)
    except RequestError as exc:
        with pytest.raises(RequestError) as got:
            read_request(body, endpoint)
        assert (got.value.param, str(got.value)) == (exc.param, str(exc)), "the client would be told of another field"
        return
    request = read_request(body, endpoint)
    assert request is not None and request.fields == want


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([b'"nvext"', b'"return_token_ids"', b"nvext", b"\\u006e", b'"\\u006evext"', b'"',
                                 b"return_token_ids", b"x", b":", b'"nvex"', b"\\u"]), max_size=8))  # fmt: skip
def test_the_opt_in_scan_reads_the_plain_key_spelling_as_the_pattern_does(pieces):
    from vllm_nvext.inbound import optin

    data = b"".join(pieces)
    pattern = any(m in data for m in optin._KEY_MARKERS) and optin._KEY_TOKEN.search(data) is not None
    assert optin._mentions_key(data) == pattern, f"{data!r}: the opt-in test and the key pattern disagree"

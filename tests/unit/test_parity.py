"""`vllm-nvext parity`'s verdicts, judged on answers recorded from a real vLLM.

The vLLM-dialect answers are the recordings under tests/fixtures (the recorded requests are
exactly the ones parity sends); the nvext-dialect answers are the same recordings passed
through the middleware, as a vllm-nvext server answers the nvext request.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import CHAT, COMPLETIONS
from tests.recorded import Recording, recording, recordings
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings
from vllm_nvext.client import TokenIds, extract
from vllm_nvext.tools import cli, parity
from vllm_nvext.tools.parity_checks import (
    FAIL,
    NVEXT_DIALECT,
    PASS,
    REQUESTS,
    SKIP,
    VLLM_DIALECT,
    Case,
    Outcome,
    Prompt,
    Row,
    UsageError,
    build_cases,
    builtin_prompts,
    compare,
    compare_to_sent,
    counts,
    error_message,
    format_table,
    judge_case,
    load_prompts,
    parse_prompt,
    read_answer,
    request_body,
    request_row,
    token_data_unsupported,
)
from vllm_nvext.tools.parity_hidden_states import judge_hidden_states

CHAT_TEXT = Case(Prompt(1, text="Tell me about token ids."), "chat", "text")
COMPLETIONS_TEXT = Case(Prompt(2, text="Token ids are"), "completions", "text")
TOKEN_PROMPT = [84, 111, 107, 101, 110]
# Recordings of the requests parity sends for the two text cases above (greedy, max_tokens 8).
RECORDED = {
    CHAT_TEXT: {False: "chat_unary_ids", True: "chat_stream_ids"},
    COMPLETIONS_TEXT: {False: "completions_unary_ids", True: "completions_stream_ids"},
}


def vllm_answer(rec: Recording) -> Outcome:
    """What parity reads from vLLM's answer (the body split in small chunks, as a network does)."""
    chunks = [rec.body[i : i + 50] for i in range(0, len(rec.body), 50)]
    return read_answer(rec.status, rec.content_type, chunks if rec.stream else rec.body, rec.stream)


async def nvext_answer(rec: Recording) -> Outcome:
    """What parity reads from a vllm-nvext server answering the same request in the nvext dialect."""
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    request["nvext"] = {"extra_fields": ["completion_token_ids"]}
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=rec.body)
    app = NvextMiddleware(upstream, settings=Settings(mode=Mode.AUTO))
    result = await call(app, rec.path, json.dumps(request).encode())
    content_type = (result.header(b"content-type") or b"").decode()
    return read_answer(result.status, content_type, result.body_messages, rec.stream)


async def answers(case: Case) -> dict[tuple[str, bool], Outcome]:
    names = RECORDED[case]
    return {
        (dialect, stream): vllm_answer(recording(names[stream]))
        if dialect == VLLM_DIALECT
        else await nvext_answer(recording(names[stream]))
        for dialect, stream in REQUESTS
    }


def with_ids(outcome: Outcome, **changes: Any) -> Outcome:
    assert outcome.ids is not None
    return Outcome(ids=dataclasses.replace(outcome.ids, **changes), status=outcome.status)


# --- the request matrix ------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(RECORDED), ids=lambda c: c.label)
@pytest.mark.parametrize("stream", [False, True])
def test_vllm_dialect_request_is_the_recorded_request(case, stream):
    rec = recording(RECORDED[case][stream])
    assert request_body(case, VLLM_DIALECT, stream, "tiny", 8) == (rec.path, rec.request)


@pytest.mark.parametrize("case", list(RECORDED), ids=lambda c: c.label)
def test_nvext_dialect_request_differs_only_in_the_opt_in(case):
    path, vllm_body = request_body(case, VLLM_DIALECT, True, "tiny", 8)
    nvext_path, nvext_body = request_body(case, NVEXT_DIALECT, True, "tiny", 8)
    assert nvext_path == path
    assert nvext_body.pop("nvext") == {"extra_fields": ["completion_token_ids"]}
    assert vllm_body.pop("return_token_ids") is True
    assert nvext_body == vllm_body


def test_builtin_prompts_cover_every_kind_on_both_endpoints():
    cases = build_cases(builtin_prompts())
    kinds = {(c.endpoint, c.kind) for c in cases}
    assert kinds == {
        ("chat", "text"),
        ("completions", "text"),
        ("chat", "messages"),
        ("completions", "ids"),
        ("chat", "token_data"),
    }
    assert len({c.label for c in cases}) == len(cases)


def test_token_data_case_sends_ids_to_completions_in_vllm_and_to_chat_in_nvext():
    case = Case(Prompt(4, token_ids=TOKEN_PROMPT), "chat", "token_data")
    path, body = request_body(case, VLLM_DIALECT, False, "m", 16)
    assert path == COMPLETIONS and body["prompt"] == TOKEN_PROMPT and body["return_token_ids"] is True
    path, body = request_body(case, NVEXT_DIALECT, False, "m", 16)
    assert path == CHAT and body["nvext"]["token_data"] == TOKEN_PROMPT
    assert "prompt" not in body and body["messages"]


def test_a_prompts_own_max_tokens_wins():
    case = Case(Prompt(1, messages=[{"role": "user", "content": "hi"}], max_tokens=3), "chat", "messages")
    assert request_body(case, NVEXT_DIALECT, False, "m", 16)[1]["max_tokens"] == 3


# --- answers -----------------------------------------------------------------------------------


async def test_every_check_passes_on_the_recorded_answers():
    for case in RECORDED:
        rows = judge_case(case, await answers(case))
        assert [(r.check, r.status) for r in rows] == [
            ("vllm unary", PASS),
            ("vllm stream", PASS),
            ("nvext unary", PASS),
            ("nvext stream", PASS),
            ("prompt ids: vllm == nvext", PASS),
            ("completion ids: vllm == nvext", PASS),
            ("vllm: stream == unary", PASS),
            ("nvext: stream == unary", PASS),
        ], format_table(rows)
        assert "8 completion ids identical" in rows[-1].detail


async def test_a_stream_coalesced_by_a_lagging_server_gives_the_same_verdict():
    """vLLM merges deltas when its API server lags: only the per-stream concatenation is compared."""
    rec = recording("completions_stream_ids")
    events = rec.events()
    deltas = [e for e in events if e["choices"] and e["choices"][0].get("token_ids")]
    merged = copy.deepcopy(deltas[1])
    for e in deltas[2:5]:
        merged["choices"][0]["text"] += e["choices"][0]["text"]
        merged["choices"][0]["token_ids"] += e["choices"][0]["token_ids"]
    coalesced = [e for e in events if e is not deltas[1] and not any(e is d for d in deltas[2:5])]
    coalesced.insert(events.index(deltas[1]), merged)
    body = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in coalesced) + b"data: [DONE]\n\n"
    outcomes = await answers(COMPLETIONS_TEXT)
    outcomes[(VLLM_DIALECT, True)] = vllm_answer(dataclasses.replace(rec, body=body))
    rows = judge_case(COMPLETIONS_TEXT, outcomes)
    assert len(coalesced) == len(events) - 3
    assert counts(rows) == {PASS: 8, FAIL: 0, SKIP: 0}, format_table(rows)


async def test_a_changed_completion_id_fails_naming_the_first_difference():
    outcomes = await answers(CHAT_TEXT)
    ids = outcomes[(NVEXT_DIALECT, False)].ids
    assert ids is not None
    changed = [list(ids.completion_token_ids[0])]
    changed[0][3] += 1
    outcomes[(NVEXT_DIALECT, False)] = with_ids(outcomes[(NVEXT_DIALECT, False)], completion_token_ids=changed)
    failed = {r.check: r.detail for r in judge_case(CHAT_TEXT, outcomes) if r.status == FAIL}
    was, now = ids.completion_token_ids[0][3], changed[0][3]
    assert failed == {
        "completion ids: vllm == nvext": f"completion ids index 3: {was} != {now}",
        "nvext: stream == unary": f"completion ids index 3: {was} != {now}",
    }


async def test_a_changed_prompt_id_fails_the_prompt_check_only():
    outcomes = await answers(COMPLETIONS_TEXT)
    ids = outcomes[(VLLM_DIALECT, False)].ids
    assert ids is not None and ids.prompt_token_ids is not None
    prompt = [*ids.prompt_token_ids[:-1], 99999]
    outcomes[(VLLM_DIALECT, False)] = with_ids(outcomes[(VLLM_DIALECT, False)], prompt_token_ids=prompt)
    failed = {r.check for r in judge_case(COMPLETIONS_TEXT, outcomes) if r.status == FAIL}
    assert failed == {"prompt ids: vllm == nvext", "vllm: stream == unary"}


async def test_a_longer_stream_than_its_unary_answer_fails_with_both_lengths():
    outcomes = await answers(CHAT_TEXT)
    outcomes[(VLLM_DIALECT, True)] = vllm_answer(recording("chat_stream_ids_long"))
    row = next(r for r in judge_case(CHAT_TEXT, outcomes) if r.check == "vllm: stream == unary")
    assert row.status == FAIL
    assert row.detail.startswith("completion ids index 8: ") and row.detail.endswith(" != <end> (lengths 400 and 8)")


async def test_ids_in_the_wrong_placement_fail_naming_where_they_were():
    """A stock vLLM behind --url ignores `nvext` and answers only in its own placement."""
    outcomes = await answers(CHAT_TEXT)
    outcomes[(NVEXT_DIALECT, False)] = vllm_answer(recording("chat_unary_ids"))
    row = request_row(CHAT_TEXT, NVEXT_DIALECT, False, outcomes[(NVEXT_DIALECT, False)])
    assert row.status == FAIL
    assert row.detail == "ids under vllm placement, expected nvext (43 prompt + 8 completion ids)"


async def test_both_placements_pass_and_say_so():
    rec = recording("chat_unary_ids")
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    request["nvext"] = {"extra_fields": ["completion_token_ids"]}
    app = NvextMiddleware(Upstream(body=rec.body), settings=Settings(mode=Mode.BOTH))
    result = await call(app, rec.path, json.dumps(request).encode())
    outcome = read_answer(result.status, "application/json", result.body, False)
    row = request_row(CHAT_TEXT, NVEXT_DIALECT, False, outcome)
    assert (row.status, row.detail) == (PASS, "43 prompt + 8 completion ids under nvext; also under vllm")


def test_an_answer_without_ids_fails_and_its_comparisons_are_skipped():
    plain = vllm_answer(recording("chat_unary_plain"))
    assert plain.ids is None and plain.error is not None and "return_token_ids" in plain.error
    row = request_row(CHAT_TEXT, VLLM_DIALECT, False, plain)
    assert (row.status, row.detail) == (FAIL, plain.error)
    assert compare(CHAT_TEXT, "vllm: stream == unary", None, extract(recording("chat_unary_ids").json())).status == SKIP


def test_an_error_answer_carries_the_servers_message():
    outcome = vllm_answer(recording("error_max_tokens"))
    assert outcome.status == 400 and outcome.ids is None
    assert outcome.error == "HTTP 400: " + recording("error_max_tokens").json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"error": {"message": "bad", "code": 400}}', "bad"),
        (b'{"error": "flat"}', "flat"),
        (b'{"message": "dynamo says no", "code": 422}', "dynamo says no"),
        (b"[1, 2]", "[1, 2]"),
        (b"<html>gateway timeout</html>", "<html>gateway timeout</html>"),
    ],
)
def test_error_message_of_each_error_shape(body, message):
    assert error_message(body) == message


def test_a_stream_answer_that_is_not_an_event_stream_fails():
    rec = recording("chat_unary_ids")
    outcome = read_answer(200, "application/json", [rec.body], True)
    assert outcome.ids is None and outcome.error == "expected text/event-stream, got 'application/json'"


def test_returned_prompt_ids_equal_the_sent_token_prompt():
    answer = extract(recording("completions_unary_ids_token_prompt").json())
    case = Case(Prompt(3, token_ids=TOKEN_PROMPT), "completions", "ids")
    assert compare_to_sent(case, {"vllm unary": answer, "nvext unary": None}) == Row(
        case.label, "prompt ids == sent ids", PASS, "5 ids"
    )
    sent_other = Case(Prompt(3, token_ids=[84, 111, 7, 101, 110]), "completions", "ids")
    row = compare_to_sent(sent_other, {"vllm unary": answer})
    assert (row.status, row.detail) == (FAIL, "vllm unary: index 2: 107 != 7 (returned != sent)")
    assert compare_to_sent(case, {"vllm unary": None}).status == SKIP


def test_token_data_case_is_skipped_when_the_server_refuses_or_ignores_it():
    case = Case(Prompt(4, token_ids=TOKEN_PROMPT), "chat", "token_data")
    refused = vllm_answer(recording("error_max_tokens"))
    assert "refused nvext.token_data" in (token_data_unsupported(case, refused) or "")
    placeholder = vllm_answer(recording("chat_unary_ids"))  # prompt ids of a chat message
    assert "placeholder" in (token_data_unsupported(case, placeholder) or "")
    honoured = with_ids(placeholder, prompt_token_ids=TOKEN_PROMPT)
    assert token_data_unsupported(case, honoured) is None
    assert token_data_unsupported(case, Outcome(error="request failed: ConnectError")) is None
    assert token_data_unsupported(CHAT_TEXT, refused) is None


# --- hidden states -----------------------------------------------------------------------------


@dataclasses.dataclass
class _Loaded:
    path: str
    hidden_states: Any


def _hidden_ids(path: str | None) -> TokenIds:
    ids = extract(recording("completions_unary_ids_token_prompt").json())
    return dataclasses.replace(ids, kv_transfer_params={"hidden_states_path": path} if path else None)


def test_hidden_states_equal_within_atol_pass_and_report_the_difference():
    torch = pytest.importorskip("torch")
    tensors = {"a": torch.zeros(5, 2, 4), "b": torch.full((5, 2, 4), 0.25)}
    seen = []

    def load(path, *, expect_token_ids):
        seen.append((path, expect_token_ids))
        return _Loaded(path, tensors[path])

    case = Case(Prompt(3, token_ids=TOKEN_PROMPT), "completions", "ids")
    rows, report = judge_hidden_states(case, _hidden_ids("a"), _hidden_ids("a"), load, 0.0)
    assert [(r.check, r.status) for r in rows] == [("hidden states load", PASS), ("hidden states equal", PASS)]
    assert report == {"vllm": {"path": "a", "shape": [5, 2, 4]}, "nvext": {"path": "a", "shape": [5, 2, 4]},
                      "max_abs_diff": 0.0}  # fmt: skip
    assert seen == [("a", TOKEN_PROMPT), ("a", TOKEN_PROMPT)]
    rows, report = judge_hidden_states(case, _hidden_ids("a"), _hidden_ids("b"), load, 0.1)
    assert rows[1].status == FAIL and rows[1].detail == "max abs diff 0.25 (atol 0.1)"
    rows, _ = judge_hidden_states(case, _hidden_ids("a"), _hidden_ids("b"), load, 0.25)
    assert rows[1].status == PASS


def test_hidden_states_problems_fail_clearly():
    torch = pytest.importorskip("torch")
    case = Case(Prompt(3, token_ids=TOKEN_PROMPT), "completions", "ids")
    shapes = {"a": torch.zeros(5, 2, 4), "b": torch.zeros(5, 3, 4)}

    def load(path, *, expect_token_ids):
        if path == "broken":
            raise ValueError("broken: token_ids differ from the expected ids at index 0")
        return _Loaded(path, shapes[path])

    rows, report = judge_hidden_states(case, _hidden_ids(None), _hidden_ids("broken"), load, 0.0)
    assert report is None and rows[0].status == FAIL
    assert "vllm: no kv_transfer_params.hidden_states_path" in rows[0].detail
    assert "nvext: broken: token_ids differ" in rows[0].detail
    rows, _ = judge_hidden_states(case, _hidden_ids("a"), _hidden_ids("b"), load, 0.0)
    assert (rows[1].status, rows[1].detail) == (FAIL, "shapes [5, 2, 4] != [5, 3, 4]")
    rows, report = judge_hidden_states(case, None, _hidden_ids("a"), load, 0.0)
    assert [r.status for r in rows] == [SKIP] and report is None
    refused = dataclasses.replace(
        _hidden_ids(None), kv_transfer_params={"hidden_states_error": "no hidden states captured: outside"}
    )
    rows, _ = judge_hidden_states(case, refused, _hidden_ids("a"), load, 0.0)
    assert "vllm: no hidden states captured: outside" in rows[0].detail, "the connector's own reason is shown"


# --- prompts and the table ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ([], "expected a JSON object"),
        ({"prompt": "a", "extra": 1}, "unknown key"),
        ({"prompt": "a", "messages": []}, "exactly one of"),
        ({}, "exactly one of"),
        ({"prompt": ""}, "non-empty string"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens must be a positive integer"),
        ({"prompt_token_ids": [1, -2]}, "non-negative integers"),
        ({"prompt_token_ids": []}, "non-negative integers"),
        ({"messages": [{"content": "no role"}]}, "{role, content}"),
    ],
)
def test_bad_prompt_lines_are_refused_naming_the_problem(obj, message):
    with pytest.raises(UsageError, match="^here: .*" + message.replace("{", r"\{").replace("}", r"\}")):
        parse_prompt(obj, 1, "here")


def test_prompts_file_numbers_prompts_and_skips_blank_lines(tmp_path: Path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt_token_ids": [1, 2], "max_tokens": 2}\n')
    prompts = load_prompts(path)
    assert prompts == [Prompt(1, text="a"), Prompt(2, token_ids=[1, 2], max_tokens=2)]
    path.write_text("\n\n")
    with pytest.raises(UsageError, match="no prompts"):
        load_prompts(path)
    with pytest.raises(UsageError, match="cannot read --prompts"):
        load_prompts(tmp_path / "missing.jsonl")


def test_previews_are_short_and_name_the_prompt():
    assert Prompt(1, text="x" * 50).preview == "x" * 37 + "..."
    assert Prompt(1, token_ids=list(range(8))).preview == "8 ids [0, 1, 2, 3, 4, 5]..."
    assert Prompt(1, messages=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]).preview == "a | b"


def test_table_columns_are_aligned():
    rows = [Row("#1 chat text", "vllm unary", PASS, "8 ids"), Row("#2", "x", FAIL)]
    assert format_table(rows).splitlines() == [
        "CASE          CHECK       RESULT  DETAIL",
        "#1 chat text  vllm unary  PASS    8 ids",
        "#2            x           FAIL",
    ]


# --- the whole command, over the recordings served through the middleware ----------------------


def _replaying_server(settings: Settings | None = None) -> httpx.MockTransport:
    """A vllm-nvext server made of the recordings: each request is answered by the recording of
    the same upstream request, through the real middleware; others get vLLM's 400 shape."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny", "object": "model"}]})
        body = json.loads(request.content)
        upstream = {k: v for k, v in body.items() if k != "nvext"} | {"return_token_ids": True}
        rec = next(
            (r for r in recordings().values() if r.path == request.url.path and r.request == upstream),
            None,
        )
        if rec is None or "token_data" in body.get("nvext", {}):
            error = {"message": "no recording of this request", "type": "BadRequestError", "param": None, "code": 400}
            return httpx.Response(400, json={"error": error})
        app = NvextMiddleware(Upstream(rec.status, rec.content_type, rec.body), settings=settings or Settings())
        headers = [(k.lower(), v) for k, v in request.headers.raw if k.lower() != b"content-length"]  # ASGI's form
        result = asyncio.run(call(app, rec.path, request.content, headers=headers))
        return httpx.Response(result.status, headers=result.headers, content=result.body)

    return httpx.MockTransport(handle)


def _run_parity(tmp_path: Path, prompts: list[dict[str, Any]], *argv: str, settings: Settings | None = None):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    args = cli.build_parser().parse_args(["parity", "--prompts", str(path), "--max-tokens", "8", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = parity.run(args, stdout=out, stderr=err, transport=_replaying_server(settings))
    return status, out.getvalue(), err.getvalue()


def test_parity_passes_on_the_recorded_answers_and_writes_its_report(tmp_path):
    report = tmp_path / "report.json"
    chat = {"messages": [{"role": "user", "content": "Tell me about token ids."}]}
    status, table, progress = _run_parity(tmp_path, [chat], "--json", str(report))
    assert status == 0, table
    assert table.rstrip().endswith("OK: 8 checks, 8 passed, 0 failed, 0 skipped")
    assert "[4/4] #1 chat messages 'Tell me about token ids.': vllm stream" in progress
    saved = json.loads(report.read_text())
    assert saved["passed"] is True and saved["model"] == "tiny" and saved["summary"]["checks"] == 8
    requests = saved["cases"][0]["requests"]
    assert requests["nvext unary"]["placements"] == ["nvext"] and requests["vllm unary"]["placements"] == ["vllm"]
    assert requests["nvext stream"]["completion_token_ids"] == requests["vllm unary"]["completion_token_ids"]


def test_parity_fails_when_the_server_answers_nvext_in_the_vllm_placement(tmp_path):
    chat = {"messages": [{"role": "user", "content": "Tell me about token ids."}]}
    status, table, _ = _run_parity(tmp_path, [chat], settings=Settings(mode=Mode.VLLM, allow_mode_header=False))
    assert status == 1
    assert "nvext unary                    FAIL    ids under vllm placement, expected nvext (43 prompt" in table


def test_parity_skips_token_data_the_server_refuses_and_fails_unanswered_requests(tmp_path):
    status, table, progress = _run_parity(tmp_path, [{"prompt_token_ids": TOKEN_PROMPT, "max_tokens": 1}])
    assert status == 1
    assert "#1 chat token_data  nvext.token_data on chat       SKIP    the server refused nvext.token_data" in table
    assert "vllm stream                    FAIL    HTTP 400: no recording of this request" in table
    assert progress.rstrip().endswith("[5/8] #1 chat token_data '5 ids [84, 111, 107, 101, 110]': nvext unary")


def test_parity_usage_errors_are_exit_2(tmp_path):
    args = cli.build_parser().parse_args(["parity", "--max-tokens", "0"])
    err = io.StringIO()
    assert parity.run(args, stdout=io.StringIO(), stderr=err, transport=_replaying_server()) == 2
    assert err.getvalue() == "vllm-nvext parity: error: --max-tokens must be at least 1, got 0\n"
    status, _, progress = _run_parity(tmp_path, [{"prompt": "x"}], "--model", "other")
    assert status == 2 and "does not serve model 'other' (it serves tiny)" in progress


def _models_answer(status: int, body: Any) -> httpx.MockTransport:
    return httpx.MockTransport(lambda request: httpx.Response(status, json=body))


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (401, {"error": "Unauthorized"}, "refused the request (HTTP 401): pass its key with --api-key"),
        (500, {"error": {"message": "engine dead"}}, "/v1/models answered HTTP 500: engine dead"),
        (200, {"object": "list"}, "/v1/models did not list models"),
        (200, {"data": []}, "serves no model"),
    ],
)
def test_a_server_that_cannot_be_checked_is_exit_2_saying_why(status, body, message):
    args = cli.build_parser().parse_args(["parity", "--url", "http://server:1/"])
    err = io.StringIO()
    assert parity.run(args, stdout=io.StringIO(), stderr=err, transport=_models_answer(status, body)) == 2
    assert err.getvalue().startswith("vllm-nvext parity: error: http://server:1") and message in err.getvalue()


def test_baseline_gets_the_vllm_dialect_without_the_mode_header(tmp_path):
    seen: list[tuple[str, str | None, str | None]] = []
    replay = _replaying_server()

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.headers.get("x-nvext-mode"), request.headers.get("authorization")))
        return replay.handle_request(request)

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Tell me about token ids."}]}) + "\n")
    argv = ["parity", "--url", "http://mw", "--baseline-url", "http://stock", "--api-key", "k", "--prompts", str(path)]
    args = cli.build_parser().parse_args([*argv, "--max-tokens", "8"])
    out = io.StringIO()
    assert parity.run(args, stdout=out, stderr=io.StringIO(), transport=httpx.MockTransport(handle)) == 0, out
    requests = seen[2:]  # after both /v1/models
    assert sorted(set(requests)) == [("mw", "nvext", "Bearer k"), ("stock", None, "Bearer k")]


def test_hidden_states_without_paths_fail_and_an_unwritable_report_is_exit_2(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    chat = {"messages": [{"role": "user", "content": "Tell me about token ids."}]}
    status, table, _ = _run_parity(tmp_path, [chat], "--hidden-states")
    assert status == 1
    assert "hidden states load             FAIL    vllm: no kv_transfer_params.hidden_states_path" in table
    status, _, progress = _run_parity(tmp_path, [chat], "--json", str(tmp_path / "missing" / "r.json"))
    assert status == 2 and "cannot write the JSON report" in progress


def test_an_answer_with_prompt_ids_only_fails_naming_the_missing_ids():
    echo = vllm_answer(recording("completions_stream_echo"))  # `echo`, no `return_token_ids`: prompt ids only
    row = request_row(COMPLETIONS_TEXT, VLLM_DIALECT, True, echo)
    assert (row.status, row.detail) == (FAIL, "no completion ids in the vllm placement")


def test_a_request_the_network_drops_fails_saying_so(tmp_path):
    replay = _replaying_server()

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return replay.handle_request(request)
        raise httpx.ReadError("connection reset by peer", request=request)

    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    args = cli.build_parser().parse_args(["parity", "--prompts", str(path)])
    out = io.StringIO()
    assert parity.run(args, stdout=out, stderr=io.StringIO(), transport=httpx.MockTransport(handle)) == 1
    assert "FAIL    request failed: ReadError: connection reset by peer" in out.getvalue()

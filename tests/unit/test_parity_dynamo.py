"""`vllm-nvext parity --dynamo-url` and `vllm_nvext.tools.dynamo_conformance`, without servers.

The answers here are constructed to the shape a case needs (the real comparison against a real
Dynamo is tests/e2e/test_parity.py and tests/e2e/test_dynamo_conformance.py): an allowed
difference passes, an unlisted one fails naming the first difference, and the exit statuses.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from vllm_nvext.tools import cli, parity
from vllm_nvext.tools.dynamo_conformance import (
    CHAT,
    COMPLETIONS,
    SIX,
    Answer,
    AnswerError,
    Case,
    cases,
    f32,
    facts,
    json_shape,
    parse_answer,
    set_aside,
    unexplained_differences,
)
from vllm_nvext.tools.parity_checks import FAIL, PASS
from vllm_nvext.tools.parity_dynamo import DYNAMO_CHECK, judge_dynamo_case, read_conformance_answer

IDS_CASE = Case(
    "completions-ids-unary",
    COMPLETIONS,
    {"model": "m", "prompt": "x", "nvext": {"extra_fields": ["completion_token_ids"]}},
)


def _sse(*events: Any) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


# --- a server's answer, constructed from the request --------------------------------------------


def fake_answer(body: dict[str, Any], *, ids: tuple[int, ...] = (5, 6), trio: bool = False) -> tuple[int, bytes]:
    """A minimal answer with the selected `nvext` keys; `trio` adds what vllm-nvext adds to the ids."""
    nv_request = body.get("nvext") or {}
    selectors = nv_request.get("extra_fields", [])
    if not isinstance(selectors, list):
        return 400, json.dumps({"message": "extra_fields must be a list", "type": "invalid_request_error"}).encode()
    chat = "messages" in body
    n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    final: dict[str, Any] = {}
    if "completion_token_ids" in selectors and n == 1:
        final["completion_token_ids"] = list(ids)
        if trio and "prompt_token_ids" not in selectors:
            final["prompt_token_ids"] = [1, 2]
    if "timing" in selectors:
        final["timing"] = {"request_received_ms": 1, "total_time_ms": 2.5}

    def choice(i: int, text: str, finish: str | None) -> dict[str, Any]:
        content = {"delta": {"content": text}} if chat else {"text": text}
        if not body.get("stream") and chat:
            content = {"message": {"role": "assistant", "content": text}}
        return {"index": i, **content, "finish_reason": finish}

    if not body.get("stream"):
        obj: dict[str, Any] = {"id": "x", "choices": [choice(i, "ab", "length") for i in range(n)]}
        if final:
            obj["nvext"] = final
        return 200, json.dumps(obj).encode()
    events: list[dict[str, Any]] = []
    for i in range(n):
        first: dict[str, Any] = {"choices": [choice(i, "a", None)]}
        last: dict[str, Any] = {"choices": [choice(i, "b", "length")]}
        if "completion_token_ids" in final:
            first["nvext"] = {"completion_token_ids": final["completion_token_ids"][:1]}
            last["nvext"] = {**final, "completion_token_ids": final["completion_token_ids"][1:]}
        elif final:
            last["nvext"] = final
        events += [first, last]
    if body.get("stream_options"):
        events.append({"choices": [], "usage": {"prompt_tokens": 2}})
    return 200, _sse(*events)


def _answer(case: Case, **kwargs: Any) -> Answer:
    status, content = fake_answer(case.body, **kwargs)
    return parse_answer(status, content, case.stream)


# --- the pure comparison ------------------------------------------------------------------------


def test_the_case_matrix_names_the_model_and_covers_both_endpoints_and_transports():
    matrix = cases("my-model")
    assert len(matrix) == 79 and len({c.name for c in matrix}) == 79
    assert all(c.body["model"] == "my-model" and next(iter(c.body)) == "model" for c in matrix)
    assert {c.path for c in matrix} == {CHAT, COMPLETIONS}
    assert {c.name.rsplit("-", 1)[-1] for c in matrix if "-six-" in c.name} == {"unary", "stream", "usage"}
    sampled = [c for c in matrix if "-n2-" in c.name]
    assert len(sampled) == 2 * len(SIX) * 2 and all(c.body["seed"] == 11 and c.body["temperature"] > 0 for c in sampled)
    assert all(c.body["temperature"] == 0 for c in matrix if "-n2-" not in c.name)
    assert json.loads(matrix[0].content()) == matrix[0].body


def test_parse_answer_reads_unary_errors_and_streams():
    assert parse_answer(200, b'{"a": 1}', False).body == {"a": 1}
    assert parse_answer(400, b"not json", True) == Answer(400, body="not json")
    stream = parse_answer(200, b'data: {"a": 1}\r\n\r\n: comment\n\ndata: [DONE]\r\n\r\n', True)
    assert stream.events == [{"a": 1}] and stream.body is None
    for content, stream_flag, message in [
        (b"[1]", False, "not a JSON object"),
        (b'data: {"a": 1}\n\n', True, r"does not end with data: \[DONE\]"),
        (b"data: {oops\n\ndata: [DONE]\n\n", True, "not JSON"),
        (b"data: [1]\n\ndata: [DONE]\n\n", True, "not a JSON object"),
    ]:
        with pytest.raises(AnswerError, match=message):
            parse_answer(200, content, stream_flag)


def test_set_aside_drops_paths_and_what_they_leave_empty():
    answer = Answer(200, {"nvext": {"engine_data": {"kv_cache_hit": 1}, "timing": {"ttft_ms": 1, "x": 2}}})
    kept = set_aside(answer, ["engine_data.kv_cache_hit", "timing.ttft_ms", "absent.key"])
    assert kept.body == {"nvext": {"timing": {"x": 2}}}
    assert answer.body["nvext"]["engine_data"] == {"kv_cache_hit": 1}, "the original is untouched"
    assert set_aside(answer, ["engine_data", "timing"]).body == {}
    assert set_aside(answer, []) is answer


def test_shapes_and_f32():
    assert json_shape({"b": [1, 2, 1.5], "a": {"c": True, "d": None, "e": "s"}}) == {
        "b": ["list", "int", "float"],
        "a": {"c": "bool", "d": "NoneType", "e": "str"},
    }
    assert f32([0.1, None]) == [pytest.approx(0.1, abs=1e-8), None] and f32([0.1])[0] != 0.1
    assert f32("x") == "x"


def test_stream_facts_judge_chunks_by_content_not_boundaries():
    case = next(c for c in cases("m") if c.name == "chat-six-usage")
    facts_one = facts(case, _answer(case))
    # The same tokens cut at other boundaries, with an empty role chunk first: the same facts.
    events = parse_answer(*fake_answer(case.body), True).events
    recut = Answer(
        200, events=[{"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}, *events]
    )
    assert facts(case, recut) == facts_one
    assert facts_one["choice0.nvext.completion_token_ids(concatenated)"] == [5, 6]
    assert "usage.nvext" in facts_one and facts_one["choice0.finish_reason"] == "length"
    error = Answer(200, events=[{"error": {"message": "boom"}}])
    assert facts(case, error)["error.nvext"] == [[None, "NoneType"]]  # no nvext on an error event
    inside = Answer(200, events=[{"choices": [{"index": 0, "text": "a", "finish_reason": None, "nvext": {}}]}])
    assert facts(case, inside)["nvext_inside_choice"] is True


def test_an_allowed_difference_passes():
    for case in cases("m"):
        dynamo, ours = _answer(case), _answer(case, trio=True)
        assert unexplained_differences(case, dynamo, ours) == [], case.name
    # A refusal the allow-list names (a batch with engine_data) is not compared further.
    batch = next(c for c in cases("m") if c.name == "completions-batch-engine_data")
    refused = Answer(400, body={"error": {"message": "no", "type": "BadRequestError", "param": "nvext", "code": 400}})
    assert unexplained_differences(batch, _answer(batch), refused) == []


def test_an_unlisted_difference_fails_naming_it_first():
    case = next(c for c in cases("m") if c.name == "completions-ids-stream")
    differences = unexplained_differences(case, _answer(case), _answer(case, ids=(5, 7), trio=True))
    assert differences == ["choice0.nvext.completion_token_ids(concatenated): Dynamo [5, 6] vs vllm-nvext [5, 7]"]
    # A key no listed difference allows (worker_id is allowed only on Dynamo's side) fails.
    theirs = Answer(200, {"choices": [], "nvext": {"completion_token_ids": [5, 6]}})
    extra = Answer(200, {"choices": [], "nvext": {"completion_token_ids": [5, 6], "worker_id": 3}})
    got = unexplained_differences(IDS_CASE, theirs, extra)
    assert got[0] == 'nvext.keys: Dynamo ["completion_token_ids"] vs vllm-nvext ["completion_token_ids", "worker_id"]'
    assert got[-1] == 'nvext.worker_id: Dynamo "<absent>" vs vllm-nvext 3'


def test_a_stop_string_finish_agrees_whichever_way_dynamos_cancel_race_went():
    # Dynamo 1.6.1 cancels its worker on a stop string: engine_data is answered only when the
    # worker's final chunk beats the cancel, then with the ids generated past the stop string.
    case = next(c for c in cases("m") if c.name == "completions-stop-string-usage")
    lost = _answer(case)
    won = _answer(case)
    assert won.events is not None and lost.events is not None
    finish = next(e for e in won.events if e["choices"] and e["choices"][0]["finish_reason"])
    finish["nvext"] = {"engine_data": {"completion_token_ids": [5, 6, 7, 8], "finished": True}, **finish["nvext"]}
    ours = _answer(case)
    assert ours.events is not None
    ours_finish = next(e for e in ours.events if e["choices"] and e["choices"][0]["finish_reason"])
    ours_finish["nvext"] = {"engine_data": {"completion_token_ids": [5, 6], "finished": True}, **ours_finish["nvext"]}
    assert unexplained_differences(case, won, ours) == unexplained_differences(case, lost, ours) == []
    # Everything else on that finish is still compared.
    ours_finish["nvext"]["stop_reason"] = "other"
    assert unexplained_differences(case, won, ours)[0].startswith("finish.nvext: Dynamo")
    # Without a stop string, engine_data is compared as ever.
    plain = next(c for c in cases("m") if c.name == "completions-six-usage")
    assert unexplained_differences(plain, _answer(plain), _answer(plain)) == []
    theirs = _answer(plain)
    assert theirs.events is not None
    plain_finish = next(e for e in theirs.events if e["choices"] and e["choices"][0]["finish_reason"])
    plain_finish["nvext"] = {"engine_data": {"finished": True}, **plain_finish["nvext"]}
    assert any("engine_data" in d for d in unexplained_differences(plain, theirs, _answer(plain)))


def test_a_unary_stop_string_answer_agrees_in_either_of_dynamos_key_orders():
    # Dynamo 1.6.1's unary nvext is the last chunk's: its own (ids first) or, when its worker's
    # final chunk wins the race with the stop-string cancel, that chunk's (timing first).
    case = next(c for c in cases("m") if c.name == "completions-stop-string-unary")
    ours = _answer(case)
    assert isinstance(ours.body, dict) and list(ours.body["nvext"])[0] == "completion_token_ids"
    won = _answer(case)
    assert isinstance(won.body, dict)
    nv = won.body["nvext"]
    won.body["nvext"] = {
        **{k: v for k, v in nv.items() if k != "completion_token_ids"},
        **{"completion_token_ids": nv["completion_token_ids"]},
    }
    assert list(won.body["nvext"])[0] != "completion_token_ids"
    assert unexplained_differences(case, won, ours) == []
    # A key one side leaves out still differs; so does the order where no stop string ends the answer.
    del ours.body["nvext"]["timing"]
    assert any(d.startswith("nvext.types: ") for d in unexplained_differences(case, won, ours))
    plain = next(c for c in cases("m") if c.name == "completions-six-unary")
    reordered = _answer(plain)
    assert isinstance(reordered.body, dict)
    nv = reordered.body["nvext"]
    reordered.body["nvext"] = {
        **{k: v for k, v in nv.items() if k != "completion_token_ids"},
        **{"completion_token_ids": nv["completion_token_ids"]},
    }
    assert unexplained_differences(plain, reordered, _answer(plain))[0].startswith("nvext.keys: ")


def test_judge_dynamo_case_rows():
    same = _answer(IDS_CASE)
    row, differences = judge_dynamo_case(IDS_CASE, same, same)
    assert (row.case, row.check, row.status, row.detail, differences) == (
        "completions-ids-unary",
        DYNAMO_CHECK,
        PASS,
        "HTTP 200 both",
        [],
    )
    refused = Answer(400, body={"error": {}})
    batch = next(c for c in cases("m") if c.name == "completions-batch-engine_data")
    assert judge_dynamo_case(batch, _answer(batch), refused)[0].detail == "HTTP 200 Dynamo, 400 vllm-nvext (allowed)"
    row, differences = judge_dynamo_case(IDS_CASE, same, Answer(500, body="boom"))
    assert row.status == FAIL and row.detail == f"{differences[0]} (+{len(differences) - 1} more)"
    assert differences[0] == "status: Dynamo 200 vs vllm-nvext 500"
    row, differences = judge_dynamo_case(
        IDS_CASE, "request failed: ReadError: x", read_conformance_answer(200, b"[]", False)
    )
    assert row.status == FAIL and row.detail == "Dynamo: request failed: ReadError: x (+1 more)"
    assert differences[1] == "vllm-nvext: HTTP 200, the 200 answer is not a JSON object: '[]'"


# --- the command, over a mock transport ---------------------------------------------------------

Seen = list[tuple[str, str, str | None, str | None, bytes]]


def _servers(seen: Seen, nvext_edit: Callable[[dict[str, Any], tuple[int, bytes]], tuple[int, bytes]] | None = None):
    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-model"}]})
        seen.append(
            (
                host,
                request.url.path,
                request.headers.get("x-nvext-mode"),
                request.headers.get("authorization"),
                request.content,
            )
        )
        body = json.loads(request.content)
        status, content = fake_answer(body, trio=host == "nvext")
        if host == "nvext" and nvext_edit is not None:
            status, content = nvext_edit(body, (status, content))
        return httpx.Response(status, content=content)

    return httpx.MockTransport(handle)


def _row(table: str, case: str) -> tuple[str, str, str]:
    """(check, result, detail) of a case's row in the printed table."""
    for line in table.splitlines():
        if line.startswith(case + " "):
            _, check, result, *detail = re.split(r"\s{2,}", line, maxsplit=3)
            return check, result, detail[0] if detail else ""
    raise AssertionError(f"no row for {case}")


def _run(transport: httpx.BaseTransport, *argv: str) -> tuple[int, str, str]:
    args = cli.build_parser().parse_args(["parity", "--url", "http://nvext/", "--dynamo-url", "http://dynamo", *argv])
    out, err = io.StringIO(), io.StringIO()
    status = parity.run(args, stdout=out, stderr=err, transport=transport)
    return status, out.getvalue(), err.getvalue()


def test_dynamo_parity_passes_sending_the_same_bytes_and_writes_its_report(tmp_path):
    seen: Seen = []
    report = tmp_path / "r.json"
    status, table, progress = _run(_servers(seen), "--api-key", "k", "--json", str(report))
    assert status == 0, table
    assert table.rstrip().endswith("OK: 79 cases, 79 agree, 0 differ")
    assert _row(table, "chat-ids-unary") == (DYNAMO_CHECK, PASS, "HTTP 200 both")
    assert "79 conformance cases, model 'served-model', Dynamo http://dynamo vs vllm-nvext http://nvext" in progress
    assert "[79/79] completions-batch-timing" in progress
    dynamo = [s for s in seen if s[0] == "dynamo"]
    ours = [s for s in seen if s[0] == "nvext"]
    assert (
        [(p, b) for _, p, _, _, b in dynamo]
        == [(p, b) for _, p, _, _, b in ours]
        == [(c.path, c.content()) for c in cases("served-model")]
    )
    assert {(mode, auth) for _, _, mode, auth, _ in dynamo} == {(None, None)}, "Dynamo gets no key, no mode header"
    assert {(mode, auth) for _, _, mode, auth, _ in ours} == {("nvext", "Bearer k")}
    saved = json.loads(report.read_text())
    assert saved["passed"] is True and saved["dynamo_url"] == "http://dynamo" and saved["model"] == "served-model"
    assert saved["summary"] == {"checks": 79, "passed": 79, "failed": 0, "skipped": 0}
    assert saved["cases"][0]["status"] == {"dynamo": 200, "nvext": 200} and saved["cases"][0]["differences"] == []


def test_dynamo_parity_fails_naming_the_first_unlisted_difference(tmp_path):
    def bump_last_id(body: dict[str, Any], answer: tuple[int, bytes]) -> tuple[int, bytes]:
        if body.get("stream") or "completion_token_ids" not in answer[1].decode():
            return answer
        obj = json.loads(answer[1])
        obj["nvext"]["completion_token_ids"][-1] += 1
        return answer[0], json.dumps(obj).encode()

    report = tmp_path / "r.json"
    status, table, _ = _run(_servers([], bump_last_id), "--json", str(report))
    assert status == 1
    detail = "nvext.completion_token_ids: Dynamo [5, 6] vs vllm-nvext [5, 7]"
    assert _row(table, "chat-ids-unary") == (DYNAMO_CHECK, FAIL, detail)
    assert _row(table, "chat-ids-stream")[1] == PASS
    assert "FAILED: 79 cases, " in table
    saved = json.loads(report.read_text())
    assert saved["passed"] is False
    failed = [c for c in saved["cases"] if c["result"] == FAIL]
    assert failed and all(c["differences"] for c in failed)
    # A differing case keeps what each server said; an agreeing one does not.
    ids_case = next(c for c in failed if c["case"] == "chat-ids-unary")
    dynamo_said, we_said = (json.loads(ids_case["bodies"][side]) for side in ("dynamo", "nvext"))
    assert dynamo_said["nvext"]["completion_token_ids"] == [5, 6] and we_said["nvext"]["completion_token_ids"] == [5, 7]
    assert all("bodies" not in c for c in saved["cases"] if c["result"] == PASS)


def test_dynamo_parity_report_keeps_a_long_or_undecodable_body_readable():
    from vllm_nvext.tools.parity_dynamo import _body_text

    assert _body_text(None) is None
    assert _body_text(b"caf\xc3\xa9 \xff") == "caf\u00e9 \ufffd"
    cut = _body_text(b"x" * 70000)
    assert cut is not None and cut.startswith("x" * 65536) and "x" * 65537 not in cut
    assert cut.endswith("[... cut at 64 KiB]")


def test_dynamo_parity_usage_errors_and_unreachable_servers_are_exit_2(tmp_path, capsys):
    status, table, progress = _run(_servers([]), "--hidden-states")
    assert (status, table) == (2, "") and "--hidden-states does not apply with --dynamo-url" in progress
    status, _, progress = _run(_servers([]), "--prompts", str(tmp_path / "p.jsonl"))
    assert status == 2 and "--prompts does not apply with --dynamo-url" in progress
    status, _, progress = _run(_servers([]), "--model", "other")
    assert status == 2 and "does not serve model 'other'" in progress

    def dynamo_down(request: httpx.Request) -> httpx.Response:
        if request.url.host == "dynamo":
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"data": [{"id": "served-model"}]})

    status, _, progress = _run(httpx.MockTransport(dynamo_down))
    assert status == 2 and "cannot reach http://dynamo" in progress
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["parity", "--dynamo-url", "http://d", "--baseline-url", "http://b"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_a_dropped_request_fails_the_case_saying_so():
    def drop_dynamo_posts(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "served-model"}]})
        if request.url.host == "dynamo":
            raise httpx.ReadError("connection reset by peer", request=request)
        status, content = fake_answer(json.loads(request.content))
        return httpx.Response(status, content=content)

    status, table, _ = _run(httpx.MockTransport(drop_dynamo_posts))
    assert status == 1
    assert _row(table, "chat-ids-unary") == (
        DYNAMO_CHECK,
        FAIL,
        "Dynamo: request failed: ReadError: connection reset by peer",
    )


def test_a_stream_whose_deltas_were_merged_into_the_finish_chunk_still_compares():
    """A lagging server sends one choice's tokens in its finish chunk: no content-only chunk."""
    case = next(c for c in cases("m") if c.name == "completions-ids-stream")
    events = _answer(case).events
    merged = {
        "choices": [{"index": 0, "text": "ab", "finish_reason": "length"}],
        "nvext": {"completion_token_ids": [5, 6]},
    }
    assert unexplained_differences(case, _answer(case), Answer(200, events=[merged])) == []
    assert "delta.nvext" in facts(case, Answer(200, events=events))
    # Merged or not, the ids still have to agree.
    wrong = {**merged, "nvext": {"completion_token_ids": [5, 7]}}
    assert unexplained_differences(case, _answer(case), Answer(200, events=[wrong])) != []

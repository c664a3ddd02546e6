"""The capture's trainer formats (docs/capture.md "Trainer formats"; docs/trainer-formats.md): ATIF v1.7 with each
subagent embedded and the decoded text, and NeMo Gym's `TokenEntry` (record schema 3) as JSON lines, each checked
against its authors' own definition vendored in tests/fixtures/formats/ (the JSON schema, and beside it the
validators a JSON schema cannot carry; the digest vectors and the records Gym's own store wrote)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.support.capture import make_turn
from tests.unit.test_capture_api import KEY, _mount, _sink_of, call
from vllm_nvext.capture import api, nemo_gym
from vllm_nvext.capture.atif import trajectory
from vllm_nvext.capture.record import Turn
from vllm_nvext.tools import cli

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
ATIF = json.loads((FORMATS / "atif-v1.7.schema.json").read_text())
ENTRY = json.loads((FORMATS / "nemo-gym-token-entry-v3.schema.json").read_text())
DIGESTS = json.loads((FORMATS / "nemo-gym-token-digests-v3.json").read_text())
GYM_LINES = (FORMATS / "nemo-gym-token-entries-v3.jsonl").read_text(encoding="utf-8").splitlines(keepends=True)


def check_atif(doc: dict[str, Any]) -> None:
    """Harbor's schema, and the validators of its models the schema leaves out (fixtures/formats/README.md)."""
    jsonschema.validate(doc, ATIF)
    assert doc["schema_version"] == "ATIF-v1.7"
    subagents = doc.get("subagent_trajectories", [])
    ids = [s["trajectory_id"] for s in subagents]
    assert None not in ids and len(set(ids)) == len(ids)
    for trajectory_doc in (doc, *subagents):
        assert [s["step_id"] for s in trajectory_doc["steps"]] == list(range(1, len(trajectory_doc["steps"]) + 1))
        for made in trajectory_doc["steps"]:
            if made.get("llm_call_count") == 0:
                assert "metrics" not in made and "reasoning_content" not in made


def check_entry(record: dict[str, Any]) -> None:
    """Gym's schema, and its `TokenEntry` validator and `stamp_lineage` (fixtures/formats/README.md)."""
    jsonschema.validate(record, ENTRY)
    assert record["schema_version"] == DIGESTS["schema_version"] == 3
    assert len(record["generation_token_ids"]) == len(record["generation_log_probs"])
    assert record["parent_resolution"] in DIGESTS["parent_resolution"]
    assert (record["parent_call_id"] is not None) == (record["parent_resolution"] == "resolved")
    cumulative = record["prompt_token_ids"] + record["generation_token_ids"]
    assert record["cum_len"] == len(cumulative) and record["digest"] == nemo_gym.compute_digest(cumulative)


# --- NeMo Gym: TokenEntry, record schema 3 ---


def test_cum_len_and_digest_are_gyms_on_its_own_vectors():
    for vector in DIGESTS["vectors"]:
        assert nemo_gym.compute_digest(vector["token_ids"]) == vector["digest"], vector["token_ids"][:8]
        if vector.get("encoding_hex") is not None:
            assert nemo_gym.encode_token_ids(vector["token_ids"]).hex() == vector["encoding_hex"]
    for refused in DIGESTS["refused"]:  # Gym raises on these; a record is never written with a wrapped id
        with pytest.raises(ValueError):
            nemo_gym.compute_digest(refused["token_ids"])


def _gym_sample_turns() -> list[dict[str, Any]]:
    """The three calls of Gym's sample rollout (its fixture), as the store keeps them."""
    kw: dict[str, Any] = {"model": "tiny"}
    turns = [
        make_turn("run-1", [1, 2, 3], [4, 5], logprobs=[-0.5, -0.25], request_id="chatcmpl-a", time=1767225600.0, **kw),
        make_turn(
            "run-1", [1, 2, 3, 4, 5, 6], [7], logprobs=[-0.125], request_id="chatcmpl-b", time=1767225601.0, **kw
        ),
        make_turn(
            "run-1", [1, 2, 9], [10, 11], logprobs=[-1.0, -2.0], request_id="chatcmpl-c", time=1767225602.0, **kw
        ),
    ]
    placed: list[Turn] = []
    for turn in turns:
        placed.append(turn.placed(len(placed), placed[-1] if placed else None))
    return [t.to_json() for t in placed]


def test_a_session_is_the_records_gyms_own_store_wrote_byte_for_byte():
    """Root, a child resolved to it (`extends_previous`), a call that left the ids (`unresolved`, `no_match`):
    the lines are those Gym's `TokenCaptureStore` wrote for the same calls."""
    made, skipped = nemo_gym.records("run-1", _gym_sample_turns())
    assert skipped.total == 0
    assert [nemo_gym.line(r) for r in made] == GYM_LINES
    for record in made:
        check_entry(record)


def test_a_turn_without_one_logprob_per_id_is_left_out_and_counted_never_written_empty():
    turns = [
        make_turn("s", [1, 2], [3, 4], logprobs=[-0.5, -0.5]),
        make_turn("s", [1, 2, 3, 4, 5], [6, 7]),  # the request asked for no logprobs
        make_turn("s", [1, 2, 3, 4, 5, 6, 7, 8], [9], logprobs=[None]),  # a gap
        make_turn("s", None, [9], logprobs=[-1.0]),  # no prompt ids reported
        make_turn("s", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11], logprobs=[-1.0]),
    ]
    placed: list[Turn] = []
    for turn in turns:
        placed.append(turn.placed(len(placed), placed[-1] if placed else None))
    made, skipped = nemo_gym.records("s", [t.to_json() for t in placed])
    assert [r["generation_token_ids"] for r in made] == [[3, 4], [11]]
    assert skipped.reasons == {"no_logprobs": 2, "no_ids": 1}
    assert all(r["generation_log_probs"] for r in made)
    # The last one continues the first (its prompt starts with the first's ids), over the turns left out.
    assert (made[1]["parent_resolution"], made[1]["parent_call_id"]) == ("resolved", made[0]["model_call_id"])
    for record in made:
        check_entry(record)


def test_each_agent_of_a_session_starts_its_own_chain_and_completions_prompts_get_their_own_ids():
    lp = {"logprobs": [-0.5]}
    turns = [
        make_turn("s", [1], [2], request_id="chatcmpl-main", **lp),
        make_turn("s", [5], [6], request_id="chatcmpl-sub", agent_id="explore", **lp),
        make_turn("s", [1, 2, 3], [4], request_id="chatcmpl-main2", **lp),
        make_turn("s", [7], [8], request_id="cmpl-x", route="/v1/completions", **lp),
        make_turn("s", [9], [8], request_id="cmpl-x", route="/v1/completions", **lp),
    ]
    placed: list[Turn] = []
    for turn in turns:
        placed.append(turn.placed(len(placed), placed[-1] if placed else None))
    made, _ = nemo_gym.records("s", [t.to_json() for t in placed])
    assert [(r["model_call_id"], r["parent_resolution"], r["parent_call_id"]) for r in made] == [
        ("chatcmpl-main", "root", None),
        ("chatcmpl-sub", "root", None),  # the subagent's first call: a chain of its own
        ("chatcmpl-main2", "resolved", "chatcmpl-main"),  # not extends_previous (the subagent's turn was between)
        ("cmpl-x:3", "unresolved", None),
        ("cmpl-x:4", "unresolved", None),
    ]
    assert len({r["model_call_id"] for r in made}) == len(made)  # Gym refuses a repeated call id in a rollout


@pytest.fixture(params=["middleware", "plugin"])
def served(request, store_url, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    mounted = _mount(request.param, store_url)
    sink = _sink_of(mounted)
    yield mounted, sink
    sink.close()


def test_the_read_api_answers_a_session_as_gym_records_with_the_left_out_turns_counted(served):
    app, sink = served
    for turn in _gym_sample_turns():
        sink.submit(Turn.from_json(turn))
    sink.submit(make_turn("run-1", [1, 2, 9, 10, 11, 12], [13]))  # no logprobs asked for
    sink.submit(make_turn("no-lp", [1], [2]))
    assert sink.flush()
    answer = call(app, "GET", "/v1/nvext/sessions/run-1?format=nemo-gym")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/x-ndjson"
    assert answer.headers["content-length"] == str(len(answer.content))
    assert answer.text.splitlines(keepends=True) == GYM_LINES
    assert answer.headers["x-nvext-skipped-turns"] == "1"
    assert answer.headers["x-nvext-skipped-reasons"] == "no_logprobs=1"
    refused = call(app, "GET", "/v1/nvext/sessions/no-lp?format=nemo-gym")
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "logprobs"
    assert "1 without logprobs" in refused.json()["error"]["message"]


def test_a_later_page_of_gym_records_never_calls_a_continuing_turn_a_root(served, monkeypatch):
    app, sink = served
    for turn in _gym_sample_turns():
        sink.submit(Turn.from_json(turn))
    assert sink.flush()
    monkeypatch.setattr(api, "READ_MAX_BYTES", 1)  # one turn a page
    first = call(app, "GET", "/v1/nvext/sessions/run-1?format=nemo-gym")
    assert first.headers["x-nvext-next-index"] == "1"
    assert json.loads(first.text)["parent_resolution"] == "root"
    later = call(app, "GET", "/v1/nvext/sessions/run-1?format=nemo-gym&start=1")
    record = json.loads(later.text)
    assert (record["parent_resolution"], record["parent_resolution_reason"]) == ("unresolved", "not_attempted")
    check_entry(record)


def test_export_writes_gym_records_a_line_and_counts_the_turns_left_out(store_url, tmp_path, capsys):
    from vllm_nvext.capture.store import open_sink

    sink = open_sink(store_url)
    for turn in _gym_sample_turns():
        sink.submit(Turn.from_json(turn))
    sink.submit(make_turn("other", [1], [2]))
    assert sink.flush()
    sink.close()
    out = tmp_path / "tokens.jsonl"
    assert cli.main(["sessions", "export", "--store", store_url, "--format", "nemo-gym", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8").splitlines(keepends=True) == GYM_LINES
    err = capsys.readouterr().err
    assert "1 sessions exported" in err
    assert "1 turns left out, no NeMo Gym record: 1 without logprobs" in err


# --- ATIF v1.7 ---


def _agents_session() -> list[dict[str, Any]]:
    """The main agent, a subagent (`explore`) between its turns, the main agent again; spans of text and
    reasoning."""
    spans = [
        {"kind": "reasoning", "start": 0, "end": 2, "tool_call_id": None, "name": None},
        {"kind": "text", "start": 2, "end": 4, "tool_call_id": None, "name": None},
    ]
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}
    turns = [
        make_turn("claude-1", [1, 2, 3], [10, 11, 12, 13], spans=spans, usage=usage),
        make_turn("claude-1", [5], [14], agent_id="explore", model="small"),
        make_turn("claude-1", [1, 2, 3, 10, 11, 12, 13, 6], [15], usage=usage),
        make_turn("claude-1", [7], [16], agent_id="explore", route="/v1/responses", model="small"),
    ]
    placed: list[Turn] = []
    for turn in turns:
        placed.append(turn.placed(len(placed), placed[-1] if placed else None))
    return [t.to_json() for t in placed]


def _decode(ids: Any) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_atif_v17_embeds_each_subagent_as_a_trajectory_of_its_own():
    doc = trajectory("claude-1", _agents_session())
    check_atif(doc)
    assert doc["trajectory_id"] == "claude-1"
    assert [s["metrics"]["completion_token_ids"] for s in doc["steps"]] == [[10, 11, 12, 13], [15]]
    assert doc["final_metrics"] == {
        "total_steps": 2,
        "total_prompt_tokens": 6,
        "total_completion_tokens": 8,
        "total_cached_tokens": 4,
    }
    (sub,) = doc["subagent_trajectories"]
    assert sub["trajectory_id"] == "claude-1:explore" and sub["session_id"] == "claude-1"
    assert sub["agent"]["model_name"] == "small"
    assert [(s["step_id"], s["extra"]["index"]) for s in sub["steps"]] == [(1, 1), (2, 3)]
    assert [s.get("llm_call_count") for s in sub["steps"]] == [1, None]  # a Responses turn's rounds: not tracked
    assert all(s["message"] == "" and "reasoning_content" not in s for s in doc["steps"])  # no tokenizer


def test_atif_steps_carry_the_decoded_text_where_the_server_has_a_tokenizer():
    doc = trajectory("claude-1", _agents_session(), decode=_decode)
    check_atif(doc)
    first = doc["steps"][0]
    assert (first["reasoning_content"], first["message"]) == ("kl", "mn")  # the spans' ids, decoded apart
    assert doc["subagent_trajectories"][0]["steps"][0]["message"] == "o"  # no spans: all the ids


def test_the_read_api_serves_atif_v17_in_pieces_byte_for_byte_with_subagents_and_text(served, monkeypatch):
    app, sink = served
    sink.tokenizer_sought, sink.decode = True, _decode  # what the mount finds in a vLLM server with a tokenizer
    turns = _agents_session()
    for turn in turns:
        sink.submit(Turn.from_json(turn))
    assert sink.flush()
    monkeypatch.setattr(api, "READ_PIECE_BYTES", 1)  # a step of one turn at a time
    answer = call(app, "GET", "/v1/nvext/sessions/claude-1?format=atif")
    assert answer.status_code == 200, answer.text
    assert answer.content == json.dumps(trajectory("claude-1", turns, decode=_decode), separators=(",", ":")).encode()
    check_atif(answer.json())
    monkeypatch.setattr(api, "READ_MAX_BYTES", 1)  # a later page: a trajectory id of its own
    later = call(app, "GET", "/v1/nvext/sessions/claude-1?format=atif&start=1").json()
    check_atif(later)
    assert later["trajectory_id"] == "claude-1@1" and later["extra"] == {"next_index": 2}
    assert later["steps"][0]["extra"]["agent_id"] == "explore" and "subagent_trajectories" not in later


def test_the_read_api_gives_a_subagent_threads_document_its_nesting_byte_for_byte(served):
    app, sink = served
    turns = [make_turn("cc-2:agent-x", [1, 2], [3], index=n, group_id="cc-2", agent_id="agent-x", parent_id="lead",
                       session_source="x-claude-code-session-id").to_json() for n in range(2)]  # fmt: skip
    for turn in turns:
        sink.submit(Turn.from_json(turn))
    assert sink.flush()
    stored = call(app, "GET", "/v1/nvext/sessions/cc-2:agent-x").json()["turns"]  # as the store keeps them
    answer = call(app, "GET", "/v1/nvext/sessions/cc-2:agent-x?format=atif")
    assert answer.status_code == 200, answer.text
    assert answer.content == json.dumps(trajectory("cc-2:agent-x", stored), separators=(",", ":")).encode()
    check_atif(answer.json())
    assert answer.json()["extra"] == {"group_id": "cc-2", "parent_session_id": "cc-2:lead"}

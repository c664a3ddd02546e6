"""The real Codex CLI and Claude Code, from npm, for 3 turns each (docs/agents.md, docs/capture.md).

Each CLI is set up as docs/agents.md says (tests/support/agent_clis.py) and run against vLLM 0.33's serving
code with both mounts, capture and continue ids (as `vllm-nvext serve --capture URL --continue-ids`), and
against a stock server on the same scripted engine. Every turn, the CLI calls its shell tool, runs it, sends
the result back and prints the answer: two model calls a turn, six a session. What a trainer relies on:
the session filed under the CLI's own id, one turn a model call with the ids the client's text came from,
each turn extending the one before (the tool call and its result included), and the client seeing what
stock's client sees. Marker e2e_clients: a pytest run of its own (`make test-e2e-clients`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.capture_loops import session_turns
from tests.support.agent_clis import (  # noqa: F401  (fixtures)
    ANSWER,
    MARKER,
    TOOL_CALLS,
    ClaudeCode,
    Codex,
    clients_nvext_server,
    clients_stock_server,
)
from tests.support.servers import tiny_model_dir

pytestmark = [pytest.mark.e2e, pytest.mark.e2e_clients]
PROMPTS = ("Print the marker.", "Print it again.", "Once more, please.")
CLIS = {"codex": (Codex, "thread-id", "/v1/responses"), "claude-code": (ClaudeCode, "x-claude-code-session-id",
        "/v1/messages")}  # fmt: skip


@functools.cache
def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir())


def _text(ids: list[int]) -> str:
    return str(_tokenizer().decode(ids, skip_special_tokens=True))


def _session(cli: type, server: Any, home: Path) -> list[dict[str, Any]]:
    run = cli(home=home, url=server.url)
    return [run.turn(prompt) for prompt in PROMPTS]


@pytest.fixture(scope="module", params=list(CLIS))
def sessions(request, clients_nvext_server, clients_stock_server, tmp_path_factory):  # noqa: F811
    """One 3-turn session of the CLI on each server: (name, nvext's turns, stock's turns)."""
    cli = CLIS[request.param][0]
    home = tmp_path_factory.mktemp(request.param)
    nvext = _session(cli, clients_nvext_server, home / "nvext")
    stock = _session(cli, clients_stock_server, home / "stock")
    return request.param, nvext, stock


def test_the_client_sees_what_it_sees_on_stock(sessions):
    name, nvext, stock = sessions
    assert len({t["session"] for t in nvext}) == 1, f"{name}: every turn in the session it started"
    assert all(t["message"] == ANSWER for t in nvext), f"{name} printed the scripted answer each turn"
    if name == "codex":
        assert all(t["commands"] and t["commands"][0][1:] == (f"{MARKER}\n", 0) for t in nvext), "the tool ran"
    else:
        assert all(t["model_calls"] == 2 for t in nvext), "a tool call and the answer after its result"
    strip = [{k: v for k, v in t.items() if k != "session"} for t in stock]
    assert [{k: v for k, v in t.items() if k != "session"} for t in nvext] == strip


def test_each_model_call_is_a_turn_of_the_clis_own_session_that_extends_the_one_before(sessions, clients_nvext_server):  # noqa: F811
    name, nvext, _ = sessions
    _, source, route = CLIS[name]
    turns = session_turns(clients_nvext_server, nvext[0]["session"], 6)
    assert len(turns) == 6, "two model calls a turn, nothing else filed under the session"
    assert {(t["route"], t["session_source"], t["group_id"]) for t in turns} == {(route, source, nvext[0]["session"])}
    assert [t["extends_previous"] for t in turns] == [None] + [True] * 5, "every boundary, tool calls included"
    call = dict(TOOL_CALLS)["Codex" if name == "codex" else "Claude Code"]
    for index, turn in enumerate(turns):
        # The ids decode to what the client acted on: its tool call, then the answer it printed.
        assert _text(turn["completion_token_ids"]) == (call if index % 2 == 0 else nvext[index // 2]["message"])
        if index % 2:
            assert MARKER in _text(turn["prompt_token_ids"][len(turns[index - 1]["prompt_token_ids"]) :]), (
                "the tool's output, as the client ran it, in the prompt of the call after it"
            )
    if name == "codex":
        assert {t["request_kind"] for t in turns} == {"turn"}, "Codex's x-codex-turn-metadata"
        assert all(t["spans"] is None for t in turns), "/v1/responses reports ids per round, not per item"
    else:  # each call's ids one span: the tool call (the tags and pieces the parser held back in it), the text
        for index, turn in enumerate(turns):
            whole = ("text", None) if index % 2 else ("tool_call", "Bash")
            spans = [(s["kind"], s["start"], s["end"], s["name"]) for s in turn["spans"]]
            assert spans == [(whole[0], 0, len(turn["completion_token_ids"]), whole[1])], (index, spans)

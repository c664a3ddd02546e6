"""`VLLM_NVEXT_CONTINUE_IDS` (docs/capture.md "Continuing the ids"): a captured session's next prompt is the
previous turn's prompt + completion ids + what is new, and exactly the chat template's rendering where the
previous answer's text round-trips to its ids.

On the tiny model's real tokenizer and chat template, and on conversations recorded from vLLM 0.32
(tests/fixtures/conversations, by scripts/record_conversations.py): every turn after the first is
continued, and its continued ids equal vLLM's own rendering exactly, except where the recorded
completion ids decode to a text that does not encode back to them (the drift this setting removes).
"""

from __future__ import annotations

import json
from array import array
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_nvext.capture import continuation, render_hook
from vllm_nvext.capture.continuation import ANSWER, HISTORY, Kept, Memory, continued
from vllm_nvext.capture.keys import SessionKey
from vllm_nvext.capture.tap import Collector

CONVERSATIONS = Path(__file__).resolve().parent.parent / "fixtures" / "conversations"


@cache
def _tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from vllm_nvext.tools import tiny_model

    return transformers.AutoTokenizer.from_pretrained(tiny_model.ensure())


def _render(messages: list[dict[str, Any]], generation: bool = True) -> list[int]:
    ids = _tokenizer().apply_chat_template(messages, add_generation_prompt=generation, tokenize=True, return_dict=False)
    return list(ids)


def _splice(
    prompt: list[int], completion: list[int], rendered: list[int], before: list[int] | None = None
) -> tuple[list[int] | None, str]:
    tokenizer = _tokenizer()
    stops = render_hook.stop_ids(None, tokenizer)
    return continued(prompt, completion, rendered, stops, render_hook.decoder(tokenizer), before)


TEXT = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(system=TEXT, question=TEXT, answer=TEXT, follow_up=TEXT, stopped=st.booleans())
def test_an_answer_that_round_trips_is_continued_into_exactly_the_chat_templates_rendering(
    system, question, answer, follow_up, stopped
):
    tokenizer = _tokenizer()
    history = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    prompt = _render(history)
    # The ids the model sampled for `answer`, ended by EOS (stopped) or cut by max_tokens (no EOS).
    completion = tokenizer.encode(answer, add_special_tokens=False) + ([tokenizer.eos_token_id] if stopped else [])
    rendered = _render([*history, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}])
    assert _splice(prompt, completion, rendered) == (rendered, "continued")


def test_an_answer_cut_inside_a_character_is_continued_with_the_ids_the_model_sampled():
    tokenizer = _tokenizer()
    history = [{"role": "user", "content": "Tell me about token ids."}]
    prompt = _render(history)
    # "ids €" cut after the first two of the euro sign's three bytes: the client got "ids " (the partial
    # character held back) or "ids \ufffd"; the template renders what it got back, one id per byte.
    completion = tokenizer.encode("ids €", add_special_tokens=False)[:-1]
    for text in ("ids ", "ids \ufffd"):
        rendered = _render([*history, {"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}])
        ids, outcome = _splice(prompt, completion, rendered)
        assert outcome == "continued" and ids is not None and ids != rendered
        assert ids[: len(prompt) + len(completion)] == prompt + completion, "the prompt extends the served ids"
        closing = rendered.index(tokenizer.eos_token_id, len(prompt))
        assert ids[len(prompt) + len(completion) :] == rendered[closing:], "what is new, as the template renders it"


def test_an_edited_history_or_answer_falls_back_to_vllms_rendering():
    tokenizer = _tokenizer()
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    prompt = _render(history)
    completion = tokenizer.encode("Hello there.", add_special_tokens=False) + [tokenizer.eos_token_id]
    after = [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "More."}]
    edited_system = [{"role": "system", "content": "Be long."}, history[1], *after]
    assert _splice(prompt, completion, _render(edited_system)) == (None, HISTORY)
    edited_answer = [*history, {"role": "assistant", "content": "Something else."}, after[1]]
    assert _splice(prompt, completion, _render(edited_answer)) == (None, ANSWER)
    # The whole answer dropped (a truncated context): the next message is no answer at all.
    assert _splice(prompt, completion, _render([*history, after[1]])) == (None, HISTORY)
    # A template that leaves the reasoning out of an earlier answer: the text after it still matches.
    reasoned = tokenizer.encode("<think>hmm</think>Hello there.", add_special_tokens=False)
    ids, outcome = _splice(prompt, reasoned, _render([*history, *after]))
    assert outcome == "continued" and ids is not None and ids[len(prompt) : len(prompt) + len(reasoned)] == reasoned


def test_an_answer_the_client_cut_the_head_off_falls_back_unless_the_head_is_reasoning():
    """The client's answer a tail of the one served: the model would see the whole served answer where the
    client's history holds its tail; only a head of reasoning (closed by its tag) is what a template leaves out."""
    tokenizer = _tokenizer()
    history = [{"role": "user", "content": "Hi."}]
    prompt = _render(history)
    after = [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "More."}]
    rendered = _render([*history, *after])
    eos = [tokenizer.eos_token_id]
    for head in ("Sure. ", "I will think about it. ", "<think>hmm</think> Sure. ", "think> "):
        served = tokenizer.encode(head + "Hello there.", add_special_tokens=False) + eos
        assert _splice(prompt, served, rendered) == (None, ANSWER), head
    for head in ("<think>hmm</think>", "<think>\nhmm\n</think>\n\n", "<seed:think>x</seed:think>"):
        served = tokenizer.encode(head + "Hello there.", add_special_tokens=False) + eos
        ids, outcome = _splice(prompt, served, rendered)
        assert outcome == "continued" and ids is not None
        assert ids[len(prompt) : len(prompt) + len(served) - 1] == served[:-1], "the answer as the model sampled it"


def _recorded() -> list[tuple[str, list[dict[str, Any]]]]:
    index = json.loads((CONVERSATIONS / "index.json").read_text())
    return [(name, json.loads((CONVERSATIONS / f).read_text())["turns"]) for name, f in index["conversations"].items()]


@pytest.mark.parametrize(("name", "turns"), _recorded(), ids=[name for name, _ in _recorded()])
def test_every_recorded_conversation_is_continued_and_equals_vllms_rendering_where_the_text_round_trips(name, turns):
    tokenizer = _tokenizer()
    stops = render_hook.stop_ids(None, tokenizer)
    exact = drifted = 0
    for before, turn in zip(turns, turns[1:], strict=False):
        prompt, completion = before["prompt_token_ids"], before["completion_token_ids"]
        rendered = turn["prompt_token_ids"]
        ids, outcome = _splice(prompt, completion, rendered)
        assert outcome == "continued" and ids is not None, "the client sent the history back unchanged"
        answer = completion[:-1] if completion and completion[-1] in stops else completion
        assert ids[: len(prompt) + len(answer)] == prompt + answer
        round_trips = tokenizer.encode(tokenizer.decode(answer), add_special_tokens=False) == answer
        if round_trips:
            assert ids == rendered, "where the text round-trips: exactly vLLM's own rendering"
            exact += 1
        else:
            # The drift: vLLM re-rendered the answer's text, whose ids are not the ones sampled; what
            # follows the answer is vLLM's rendering, id for id.
            closing = rendered.index(next(i for i in rendered[len(prompt) :] if i in stops), len(prompt))
            assert ids[len(prompt) + len(answer) :] == rendered[closing:]
            assert rendered[len(prompt) : closing] != answer
            drifted += 1
    assert exact + drifted == len(turns) - 1 >= 2


def test_the_memory_keeps_each_sessions_last_turns_compactly_and_forgets_the_oldest():
    memory = Memory(sessions=2, max_ids=100)
    key = ("s", None)
    first = _tap("s")
    assert memory.begin(key, first).previous == []
    first.prompt, first._choice(0).ids = [1, 2, 3], [4, 5]
    second = _tap("s")
    assert memory.begin(key, second).previous == [], "a turn still running is never continued"
    memory.settle(key, first)
    third = _tap("s")
    found = memory.begin(key, third).previous
    assert found == [Kept(array("i", [1, 2, 3]), array("i", [4, 5]), False)], "the turn that ended"
    memory.settle(key, second)  # it reported no ids (an error answer): forgotten
    third.prompt, third._choice(0).ids = [1, 2, 3, 4, 5, 6], [7]
    memory.settle(key, third)
    assert [t.prompt.tolist() for t in memory.begin(key, _tap("s")).previous] == [[1, 2, 3, 4, 5, 6], [1, 2, 3]]
    memory.begin(("t", None), _tap("t"))
    memory.begin(("u", "agent-1"), _tap("u"))
    assert len(memory) == 2 and memory.begin(key, _tap("s")).previous == [], "the least recently used went"
    big = _tap("v")
    memory.begin(("v", None), big)
    big.prompt, big._choice(0).ids = list(range(90)), list(range(20))
    memory.settle(("v", None), big)
    assert len(memory) == 0, "past max_ids, the oldest sessions go"


def _tap(session: str) -> Collector:
    return Collector(_NoSink(), "/v1/chat/completions", SessionKey(session, "x-nvext-session-id", None, None))


class _NoSink:
    def submit(self, turn: Any) -> None:
        raise AssertionError("not submitted here")


def test_a_captured_chat_request_in_a_session_carries_its_sessions_last_turns_to_vllms_renderer(monkeypatch):
    monkeypatch.setattr(continuation, "MEMORY", Memory())
    headers = [(b"x-nvext-session-id", b"run-1")]
    turns = []
    for route in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"):
        tap = Collector.of(_NoSink(), route, headers, {}, 0.0)
        assert tap is not None
        turns.append(continuation.TURN.get())
        tap.prompt, tap._choice(0).ids = [1], [2]
        tap.finish()  # reported nothing: nothing submitted
        assert continuation.TURN.get() is None
    assert [len(t.previous) if t else None for t in turns] == [0, 1, 2, None], "completions renders no chat"
    assert Collector.of(_NoSink(), "/v1/chat/completions", [], {}, 0.0) is not None
    assert continuation.TURN.get() is None, "a request of no session is its own: nothing to continue"


def test_the_hook_wraps_the_installed_vllms_chat_rendering_once():
    renderer = pytest.importorskip("vllm.renderers.online_renderer")
    original = renderer.OnlineRenderer.preprocess_chat
    try:
        render_hook.install()
        wrapped = renderer.OnlineRenderer.preprocess_chat
        assert wrapped is not original and wrapped.__wrapped__ is original
        render_hook.install()
        assert renderer.OnlineRenderer.preprocess_chat is wrapped, "installed once per process"
    finally:
        renderer.OnlineRenderer.preprocess_chat = original


# --- the setting ------------------------------------------------------------------------------------


def test_the_setting_needs_capture_and_travels_with_it(tmp_path, monkeypatch):
    from vllm_nvext.config import ConfigError, Settings, capture_environ

    with pytest.raises(ConfigError, match="VLLM_NVEXT_CONTINUE_IDS=1.*needs capture on.*VLLM_NVEXT_CAPTURE"):
        Settings.from_env({"VLLM_NVEXT_CONTINUE_IDS": "1"})
    with pytest.raises(ConfigError, match="VLLM_NVEXT_CONTINUE_IDS: expected 0 or 1"):
        Settings.from_env({"VLLM_NVEXT_CONTINUE_IDS": "maybe"})
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    assert not Settings.from_env({"VLLM_NVEXT_CAPTURE": url}).continue_ids, "off by default"
    on = Settings.from_env({"VLLM_NVEXT_CAPTURE": url, "VLLM_NVEXT_CONTINUE_IDS": "1"})
    assert on.continue_ids and capture_environ(on)["VLLM_NVEXT_CONTINUE_IDS"] == "1"
    assert Settings.from_env(capture_environ(on)) == on, "what `vllm-nvext serve` hands vLLM's process"
    monkeypatch.setenv("VLLM_NVEXT_CONTINUE_IDS", "1")  # with `--capture URL` (`serve`) or `capture=URL`
    assert Settings.create(capture=url) == on


def test_the_middleware_with_the_setting_wraps_vllms_rendering_and_refuses_it_without_capture(tmp_path):
    renderer = pytest.importorskip("vllm.renderers.online_renderer")
    from vllm_nvext import ConfigError, NvextMiddleware

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    original = renderer.OnlineRenderer.preprocess_chat
    with pytest.raises(ConfigError, match="continue_ids"):
        NvextMiddleware(app, continue_ids=True)
    assert renderer.OnlineRenderer.preprocess_chat is original, "a refused setting wraps nothing"
    try:
        middleware = NvextMiddleware(app, capture=f"sqlite:///{tmp_path / 'c.sqlite3'}", continue_ids=True)
        assert renderer.OnlineRenderer.preprocess_chat.__wrapped__ is original
        assert continuation.MEMORY is not None
        assert middleware.sink is not None
        middleware.sink.close()
    finally:
        renderer.OnlineRenderer.preprocess_chat = original


def test_the_proxy_refuses_the_setting_in_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("aiohttp")
    from vllm_nvext.tools import cli

    monkeypatch.setenv("VLLM_NVEXT_CONTINUE_IDS", "1")
    assert cli.main(["proxy", "--upstream", "http://h:1", "--capture", f"sqlite:///{tmp_path / 'c.sqlite3'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-nvext proxy: error: VLLM_NVEXT_CONTINUE_IDS=1 works only mounted in vLLM's server")
    assert err.count("\n") == 1 and not (tmp_path / "c.sqlite3").exists()


def test_serve_refuses_continue_ids_without_capture(capsys):
    pytest.importorskip("vllm")
    from vllm_nvext.tools import cli

    assert cli.main(["serve", "--model", "m", "--continue-ids"]) == 2
    assert (
        "vllm-nvext serve: error: continue_ids (VLLM_NVEXT_CONTINUE_IDS=1) needs capture on" in capsys.readouterr().err
    )


@pytest.mark.parametrize(("name", "turns"), _recorded(), ids=[name for name, _ in _recorded()])
def test_a_recorded_conversation_continued_turn_after_turn_extends_every_turn(name, turns):
    """Each turn continues the ids the previous turn was served (themselves continued), its history compared
    with vLLM's own rendering of the previous turn's; all equal to vLLM's rendering while every answer so far
    round-trips."""
    tokenizer = _tokenizer()
    stops = render_hook.stop_ids(None, tokenizer)
    served, rendered_before = turns[0]["prompt_token_ids"], None
    exact = True
    for before, turn in zip(turns, turns[1:], strict=False):
        completion = before["completion_token_ids"]
        ids, outcome = _splice(served, completion, turn["prompt_token_ids"], rendered_before)
        assert outcome == "continued" and ids is not None
        answer = completion[:-1] if completion and completion[-1] in stops else completion
        assert ids[: len(served) + len(answer)] == served + answer
        exact = exact and tokenizer.encode(tokenizer.decode(answer), add_special_tokens=False) == answer
        assert (ids == turn["prompt_token_ids"]) == exact
        served, rendered_before = ids, turn["prompt_token_ids"]


def test_the_recordings_hold_answers_that_round_trip_and_answers_that_drift():
    """Both branches of the proof above are taken: the ASCII-only conversations round-trip, the others drift."""
    tokenizer = _tokenizer()
    stops = render_hook.stop_ids(None, tokenizer)
    kinds = set()
    for _, turns in _recorded():
        for turn in turns[:-1]:
            ids = turn["completion_token_ids"]
            answer = ids[:-1] if ids and ids[-1] in stops else ids
            kinds.add(tokenizer.encode(tokenizer.decode(answer), add_special_tokens=False) == answer)
    assert kinds == {True, False}


def test_this_vllm_renders_chat_responses_and_messages_through_the_method_the_hook_wraps():
    """The entry the hook wraps (render_hook.TARGETS) is there in .venv's vLLM, with the (request, messages)
    it reads, and it is what chat (and /v1/messages, a chat request inside vLLM) and /v1/responses render
    through; each other release's own files: tests/e2e/test_versions.py, in the group that builds its venv."""
    import importlib.util

    from tests.support.vllm_source import renderer_entry

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    assert render_hook.TARGETS[0][1:] == ("OnlineRenderer", "preprocess_chat")
    assert renderer_entry(Path(spec.origin).parent) == (
        ["self", "request", "messages"],
        {"render_chat", "render_responses"},
    )


def test_a_request_continues_the_newest_turn_its_history_begins_with_and_never_one_of_several_choices():
    tokenizer = _tokenizer()
    stops, decode = render_hook.stop_ids(None, tokenizer), render_hook.decoder(tokenizer)
    loop = [{"role": "user", "content": "Fix the bug."}]
    prompt = _render(loop)
    completion = tokenizer.encode("Done.", add_special_tokens=False) + [tokenizer.eos_token_id]
    # A title request of the same session, sent after the loop's turn: newer, but not this history's.
    title = _render([{"role": "user", "content": "Name this conversation."}])
    rendered = _render([*loop, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}])
    newest_first = [(title, [1, 2], False, None), (prompt, completion, False, None)]
    assert render_hook.best(newest_first, rendered, stops, decode) == (rendered, "continued")
    several = [(prompt, completion, True, None)]
    assert render_hook.best(several, rendered, stops, decode) == (None, render_hook.SEVERAL)
    assert render_hook.best([(None, None, False, None)], rendered, stops, decode) == (None, "no_ids")

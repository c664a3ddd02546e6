"""`VLLM_NVEXT_CONTINUE_IDS` (docs/capture.md "Continuing the ids"): a captured session's next prompt is the
previous turn's prompt + completion ids + what is new, and exactly the chat template's rendering where the
previous answer's text round-trips to its ids.

On the tiny model's real tokenizer and chat template, and on conversations recorded from vLLM 0.32
(tests/fixtures/conversations, by scripts/record_conversations.py): every turn after the first is
continued, and its continued ids equal vLLM's own rendering exactly, except where the recorded
completion ids decode to a text that does not encode back to them (the drift this setting removes).
"""

from __future__ import annotations

import asyncio
import functools
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


def _render(messages: list[dict[str, Any]], generation: bool = True, tokenizer: Any = None) -> list[int]:
    tokenizer = tokenizer or _tokenizer()
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True, return_dict=False)
    return list(ids)


def _splice(
    prompt: list[int], completion: list[int], rendered: list[int], before: list[int] | None = None
) -> tuple[list[int] | None, str]:
    """The splice's ids part alone (`continued`): the ids, were the answer the one served."""
    tokenizer = _tokenizer()
    stops = render_hook.stop_ids(None, tokenizer)
    found, outcome = continued(prompt, completion, rendered, stops, render_hook.decoder(tokenizer), before)
    return (None if found is None else found.ids), outcome


def _continue(
    prompt: list[int],
    completion: list[int],
    messages: list[dict[str, Any]],
    at: int | None,
    tokenizer: Any = None,
    before: list[int] | None = None,
) -> tuple[list[int] | None, str]:
    """The whole decision, as the hook makes it (render_hook.best with renders_as_served), on the tiny model's
    real tokenizer and chat template: `messages` is the new request, `at` where the previous turn's answer is."""
    tokenizer = tokenizer or _tokenizer()
    rendered = _render(messages, tokenizer=tokenizer)

    async def render(edited: list[Any]) -> list[dict[str, Any]]:  # the template again, on other messages
        return [{"type": "token", "prompt_token_ids": _render(edited, tokenizer=tokenizer)}]

    async def run(function: Any, *args: Any) -> Any:
        return function(*args)

    check = functools.partial(render_hook.renders_as_served, messages, rendered, render)
    stops, decode = render_hook.stop_ids(None, tokenizer), render_hook.decoder(tokenizer)
    previous = [(prompt, completion, False, before, at)]
    return asyncio.run(render_hook.best(previous, rendered, stops, decode, check, run))


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
    conversation = [*history, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    assert _continue(prompt, completion, conversation, len(history)) == (_render(conversation), "continued")


def test_an_answer_cut_inside_a_character_is_continued_with_the_ids_the_model_sampled():
    tokenizer = _tokenizer()
    history = [{"role": "user", "content": "Tell me about token ids."}]
    prompt = _render(history)
    # "ids €" cut after the first two of the euro sign's three bytes: the client got "ids " (the partial
    # character held back) or "ids \ufffd"; the template renders what it got back, one id per byte.
    completion = tokenizer.encode("ids €", add_special_tokens=False)[:-1]
    for text in ("ids ", "ids \ufffd"):
        conversation = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
        rendered = _render(conversation)
        ids, outcome = _continue(prompt, completion, conversation, len(history))
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
    assert _continue(prompt, completion, edited_system, 2) == (None, HISTORY)
    edited_answer = [*history, {"role": "assistant", "content": "Something else."}, after[1]]
    assert _continue(prompt, completion, edited_answer, 2) == (None, ANSWER)
    # The whole answer dropped (a truncated context): the next message is no answer at all.
    assert _continue(prompt, completion, [*history, after[1]], 2) == (None, HISTORY)
    assert _continue(prompt, completion, [*history, *after], 2)[1] == "continued", "sent back as it was served"


# Edits of the served answer "Run rm -rf /tmp/x now.\n\ndef f():\n    return 1" that the old comparison (texts without
# whitespace or U+FFFD, special tokens decoded away) took for the answer served: each one the model must read as sent.
SERVED = "Run rm -rf /tmp/x now.\n\ndef f():\n    return 1"
EDITS = {
    "a space inserted": "Run rm -rf / tmp/x now.\n\ndef f():\n    return 1",
    "dedented": "Run rm -rf /tmp/x now.\n\ndef f():\nreturn 1",
    "NBSP for a space": "Run rm -rf\u00a0/tmp/x now.\n\ndef f():\n    return 1",
    "U+3000 for a space": "Run rm -rf\u3000/tmp/x now.\n\ndef f():\n    return 1",
    "U+2028 for a newline": "Run rm -rf /tmp/x now.\u2028\ndef f():\n    return 1",
    "U+FFFD inserted": "Run rm -rf /tmp/x\ufffd now.\n\ndef f():\n    return 1",
    "<|im_start|> inserted": "Run rm -rf /tmp/x now.<|im_start|>\n\ndef f():\n    return 1",
    "<|endoftext|> inserted": "Run rm -rf /tmp/x<|endoftext|> now.\n\ndef f():\n    return 1",
    "a trailing space": SERVED + " ",
}


@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_an_answer_edited_in_whitespace_or_special_tokens_alone_falls_back_and_the_model_reads_the_clients_text(edit):
    """Splice only where the client's answer renders, by the template and tokenizer, to exactly what the served
    answer renders to: every other edit falls back to vLLM's rendering of what the client sent."""
    tokenizer = _tokenizer()
    history = [{"role": "user", "content": "How do I clean up?"}]
    prompt = _render(history)
    completion = tokenizer.encode(SERVED, add_special_tokens=False) + [tokenizer.eos_token_id]
    conversation = [*history, {"role": "assistant", "content": EDITS[edit]}, {"role": "user", "content": "Thanks."}]
    assert _continue(prompt, completion, conversation, len(history)) == (None, ANSWER)
    served = [*history, {"role": "assistant", "content": SERVED}, conversation[-1]]
    assert _continue(prompt, completion, served, len(history)) == (_render(served), "continued")


def test_an_answer_whose_role_carries_a_special_token_falls_back():
    role = "<|im_start|>assistant"  # rendered `<|im_start|><|im_start|>assistant`: not the role the model was served
    tokenizer = _tokenizer()
    history = [{"role": "user", "content": "Hi."}]
    prompt = _render(history)
    completion = tokenizer.encode("Hello there.", add_special_tokens=False) + [tokenizer.eos_token_id]
    conversation = [*history, {"role": role, "content": "Hello there."}, {"role": "user", "content": "More."}]
    ids, outcome = _continue(prompt, completion, conversation, len(history))
    assert ids is None and outcome in (ANSWER, HISTORY), "vLLM's rendering of what the client sent stands"


def test_an_answer_the_client_cut_the_head_off_falls_back_on_a_server_without_a_reasoning_parser():
    """The client's answer a tail of the one served, up to a `</think>`-like tag too: without a reasoning parser
    the client got the whole text as its content, so the head is the client's edit (the model would read it)."""
    tokenizer = _tokenizer()
    history = [{"role": "user", "content": "Hi."}]
    prompt = _render(history)
    conversation = [*history, {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "More."}]
    eos = [tokenizer.eos_token_id]
    heads = ("Sure. ", "<think>hmm</think> Sure. ", "think> ", "<think>hmm</think>", "<seed:think>x</seed:think>")
    for head in heads:
        served = tokenizer.encode(head + "Hello there.", add_special_tokens=False) + eos
        assert _continue(prompt, served, conversation, len(history)) == (None, ANSWER), head


def test_a_sampled_character_the_tokenizer_normalizes_is_continued_where_its_rendering_is_the_same():
    """A sampled U+0343 (its bytes, as a byte-level model samples them) renders back, through the tiny model's
    tokenizer (NFC-normalizing, as Qwen's), as U+0313: the client's text and the served one render alike, so the
    loop extends with the ids sampled; a text that renders otherwise does not."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokenizer = _tokenizer()
    assert type(tokenizer.backend_tokenizer.normalizer).__name__ == "NFC"
    history = [{"role": "user", "content": "Accent?"}]
    prompt = _render(history)
    symbols = bytes_to_unicode()
    sampled = [tokenizer.convert_tokens_to_ids(symbols[b]) for b in "a\u0343".encode()]  # one id per byte
    completion = [*sampled, tokenizer.eos_token_id]
    assert tokenizer.decode(sampled) == "a\u0343", "the client gets U+0343"
    assert tokenizer.encode("a\u0343", add_special_tokens=False) == tokenizer.encode("a\u0313"), "it renders back"
    assert tokenizer.encode("a\u0343", add_special_tokens=False) != sampled, "as other ids: the drift"
    conversation = [*history, {"role": "assistant", "content": "a\u0343"}, {"role": "user", "content": "Yes."}]
    ids, outcome = _continue(prompt, completion, conversation, len(history))
    assert outcome == "continued" and ids is not None and ids[len(prompt) : len(prompt) + len(sampled)] == sampled
    other = [*history, {"role": "assistant", "content": "a\u0313 "}, conversation[-1]]
    assert _continue(prompt, completion, other, len(history)) == (None, ANSWER)


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
        messages = turn["request"].get("messages")
        if messages is not None:  # chat: the answer as vLLM served it, sent back, renders as the served one does
            assert _render(messages) == rendered, "the tiny model's template is vLLM's rendering here"
            assert _continue(prompt, completion, messages, len(before["request"]["messages"])) == (ids, outcome)
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
    newest_first = [(title, [1, 2], False, None, 1), (prompt, completion, False, None, 1)]
    conversation = [*loop, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]

    async def render(edited: list[Any]) -> list[dict[str, Any]]:
        return [{"type": "token", "prompt_token_ids": _render(edited)}]

    async def run(function: Any, *args: Any) -> Any:
        return function(*args)

    check = functools.partial(render_hook.renders_as_served, conversation, rendered, render)

    def best(previous: list[Any]) -> tuple[list[int] | None, str]:
        return asyncio.run(render_hook.best(previous, rendered, stops, decode, check, run))

    assert best(newest_first) == (rendered, "continued")
    assert best([(prompt, completion, True, None, 1)]) == (None, render_hook.SEVERAL)
    assert best([(None, None, False, None, 1)]) == (None, "no_ids")
    assert best([(prompt, completion, False, None, None)]) == (None, ANSWER), "where its answer is: unknown"

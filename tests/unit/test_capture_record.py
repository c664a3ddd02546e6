"""The captured turn's record: its JSON shape (the read API's) and where a prompt leaves its session's ids."""

from __future__ import annotations

import pytest

from vllm_nvext.capture.record import BREAK_CONTEXT, PrefixBreak, Turn, prefix_break, valid_session_id

KEYS = [
    "index",
    "session_id",
    "route",
    "request_id",
    "time",
    "model",
    "parent_id",
    "agent_id",
    "group_id",
    "session_source",
    "request_kind",
    "prompt_token_ids",
    "completion_token_ids",
    "logprobs",
    "finish_reason",
    "usage",
    "spans",
    "extends_previous",
    "break",
    "choices",
]


def turn(prompt: list[int] | None, completion: list[int] | None = None, **kw: object) -> Turn:
    base: dict[str, object] = dict(
        session_id="s1",
        route="/v1/chat/completions",
        request_id="chatcmpl-1",
        time=1.5,
        session_source="x-nvext-session-id",
    )
    base.update(kw)
    return Turn(prompt_token_ids=prompt, completion_token_ids=completion, **base)  # type: ignore[arg-type]


def test_a_turn_has_the_contract_keys_and_unreported_values_are_null():
    d = turn(None).to_json()
    assert list(d) == KEYS
    assert d["prompt_token_ids"] is None and d["logprobs"] is None and d["break"] is None
    assert d["extends_previous"] is None and d["index"] is None


def test_a_turn_survives_its_json():
    t = turn([1, 2, 3], [4, 5], model="m", usage={"prompt_tokens": 3}, logprobs=[-0.5, None]).placed(
        1, turn([1, 9], [7])
    )
    assert Turn.from_json(t.to_json()) == t
    assert t.to_json()["break"] == {
        "index": 1,
        "previous_ids": [1, 9, 7],
        "prompt_ids": [1, 2, 3],
        "previous_text": None,
        "prompt_text": None,
    }


@pytest.mark.parametrize(
    ("key", "value"),
    [("session_id", 3), ("time", "now"), ("prompt_token_ids", [1, "2"]), ("extends_previous", 1), ("break", [])],
)
def test_a_record_of_the_wrong_shape_is_refused_naming_its_key(key, value):
    d = turn([1]).to_json()
    d[key] = value
    with pytest.raises(ValueError, match=key):
        Turn.from_json(d)


def test_a_prompt_that_repeats_the_previous_ids_extends_them():
    assert prefix_break([1, 2, 3], [1, 2, 3, 4]) is None
    assert prefix_break([1, 2, 3], [1, 2, 3]) is None
    assert prefix_break([], [5]) is None


def test_a_break_is_where_the_ids_first_differ_with_a_window_each_side():
    previous = list(range(100))
    prompt = [*range(50), 999, *range(51, 60)]
    found = prefix_break(previous, prompt)
    assert found == PrefixBreak(
        index=50,
        previous_ids=list(range(50 - BREAK_CONTEXT, 50 + BREAK_CONTEXT)),
        prompt_ids=prompt[50 - BREAK_CONTEXT : 50 + BREAK_CONTEXT],
    )


def test_a_shorter_prompt_breaks_at_its_own_length():
    found = prefix_break([1, 2, 3, 4], [1, 2])
    assert found is not None and found.index == 2 and found.prompt_ids == [1, 2]


def test_the_store_places_a_turn_against_the_previous_prompt_and_completion():
    first = turn([1, 2], [3, 4]).placed(0, None)
    assert (first.index, first.extends_previous, first.break_) == (0, None, None)
    second = turn([1, 2, 3, 4, 5]).placed(1, first)
    assert (second.index, second.extends_previous, second.break_) == (1, True, None)
    third = turn([1, 2, 3, 6]).placed(2, second)
    assert third.extends_previous is False and third.break_ is not None and third.break_.index == 3
    unknown = turn(None).placed(3, third)
    assert unknown.extends_previous is None  # the ids were not reported: not "false"


@pytest.mark.parametrize(
    "value", ["chatcmpl-1", "a" * 256, "0f1e2d3c-uuid", "user_1_session:2", "a.b~c", ".a", "..a", "a.."]
)
def test_a_session_id_of_url_safe_characters_is_valid(value):
    assert valid_session_id(value)


@pytest.mark.parametrize("value", ["", "a" * 257, "../etc/passwd", "a b", "a/b", "é", "a\x00", ".", "..", "..."])
def test_a_session_id_with_other_characters_or_too_long_is_not(value):
    assert not valid_session_id(value)


def test_a_break_on_a_server_with_a_tokenizer_carries_the_texts_around_it(tmp_path):
    """`break.previous_text` / `prompt_text`: the ids around the break, decoded by the server's tokenizer (special
    tokens as they are), as the store records them; null only where no tokenizer was at hand (the proxy)."""
    transformers = pytest.importorskip("transformers")
    from starlette.applications import Starlette

    from vllm_nvext.capture import render_hook
    from vllm_nvext.capture.store import open_sink
    from vllm_nvext.tools import tiny_model

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_model.ensure())
    app = Starlette()

    class Renderer:  # where vLLM keeps its tokenizer: app.state.online_renderer.renderer.get_tokenizer()
        def get_tokenizer(self) -> object:
            return tokenizer

    app.state.online_renderer = type("OnlineRenderer", (), {"renderer": Renderer()})()
    decode = render_hook.vllm_decode(app)
    assert decode is not None and render_hook.vllm_decode(Starlette()) is None, "no tokenizer: no texts"

    def ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    sink = open_sink(f"sqlite:///{tmp_path / 'c.sqlite3'}")
    sink.decode = decode
    head = ("s", "/v1/chat/completions")
    first = Turn(*head, "r1", 1.0, "x-nvext-session-id", prompt_token_ids=ids("<|im_start|>user\nHi"),
                 completion_token_ids=ids("rm -rf /tmp/x"), decode=sink.decode)  # fmt: skip
    edited = Turn(*head, "r2", 2.0, "x-nvext-session-id",
                  prompt_token_ids=ids("<|im_start|>user\nHirm -rf / tmp/x<|im_end|>"), decode=sink.decode)  # fmt: skip
    sink.submit(first)
    sink.submit(edited)
    sink.flush()
    turns = sink.read("s")
    assert turns is not None and turns[1]["extends_previous"] is False
    brk = turns[1]["break"]
    sink.close()
    assert brk["previous_text"] == decode(brk["previous_ids"]) and "/tmp" in brk["previous_text"]
    assert brk["prompt_text"] == decode(brk["prompt_ids"]) and "/ tmp" in brk["prompt_text"]
    no_tokenizer = prefix_break([1, 2, 3], [1, 2, 4])
    assert no_tokenizer is not None and no_tokenizer.previous_text is None and no_tokenizer.prompt_text is None

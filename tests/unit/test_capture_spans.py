"""A turn's spans (docs/capture.md, Spans): which ids became text, reasoning, or which tool call, by the stream
chunks that carried them. A parser holding ids back (a tool call's opening tag and the pieces of its arguments,
`</think>`) sends chunks whose delta shows nothing: those ids belong to what shows next, or to what showed last
where nothing follows, so a tool call is one span, as a trainer masks it."""

from __future__ import annotations

from typing import Any

from vllm_nvext.capture.choice import Choice, delta_kind


def _call(index: int, **function: str) -> dict[str, Any]:
    call: dict[str, Any] = {"index": index, "function": function}
    if "name" in function:
        call.update(id=f"call-{index}", type="function")
    return call


def _record(*chunks: tuple[dict[str, Any], list[int]]) -> list[tuple[Any, ...]]:
    """The spans a choice records from these (delta, ids) chunks, fed as the tap feeds them."""
    state = Choice()
    for delta, ids in chunks:
        kind, tool, call = delta_kind(delta, {"delta": delta})
        if call is not None:
            assert tool is not None, "a tool call's delta names its index"
            state.tools[tool] = (call.get("id") or state.tools.get(tool, (None, None))[0],
                                 call["function"].get("name") or state.tools.get(tool, (None, None))[1])  # fmt: skip
        state.add(ids, None, kind, tool)
    return [(s["kind"], s["start"], s["end"], s["name"]) for s in state.fields()["spans"]]


def test_a_streamed_tool_call_is_one_span_with_the_tags_and_pieces_the_parser_held_back():
    # As vLLM's hermes parser streams `<tool_call>\n{"name": "Bash", "arguments": {...}}\n</tool_call>` then EOS.
    spans = _record(
        ({}, [1, 2, 3]),  # `<tool_call>\n{"name": ` held back
        ({"tool_calls": [_call(0, name="Bash")]}, [4]),
        ({}, [5, 6]),  # a piece of the arguments held back
        ({"tool_calls": [_call(0, arguments='{"command": "ls"}')]}, [7, 8]),
        ({}, [9, 10, 11]),  # `}\n</tool_call>` and EOS: nothing shows after them
    )
    assert spans == [("tool_call", 0, 11, "Bash")]


def test_text_then_a_tool_call_splits_where_the_call_shows_and_a_closing_think_goes_to_the_text():
    spans = _record(
        ({"reasoning": "hm"}, [1, 2]),
        ({}, [3]),  # `</think>`
        ({"content": "Sure."}, [4, 5]),
        ({}, [6]),  # `<tool_call>`
        ({"tool_calls": [_call(0, name="ls")]}, [7]),
        ({"tool_calls": [_call(1, name="pwd")]}, [8]),
    )
    assert spans == [
        ("reasoning", 0, 2, None),
        ("text", 2, 5, None),
        ("tool_call", 5, 7, "ls"),
        ("tool_call", 7, 8, "pwd"),
    ]


def test_ids_of_which_nothing_ever_showed_are_text_and_a_plain_answer_is_one_text_span():
    assert _record(({}, [1, 2])) == [("text", 0, 2, None)]
    assert _record(({"content": "a"}, [1]), ({"content": "b"}, [2]), ({}, [3])) == [("text", 0, 3, None)]

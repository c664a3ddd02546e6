"""The SSE framer: any split of a stream into body messages gives the same events."""

from __future__ import annotations

from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recorded import recordings
from vllm_nvext.outbound.sse import EventFramer, data_payload

STREAMS = sorted(name for name, rec in recordings().items() if rec.stream)


def frame(data: bytes, cuts: list[int]) -> tuple[list[bytes], bytes]:
    framer = EventFramer()
    events: list[bytes] = []
    prev = 0
    for cut in [*sorted(cuts), len(data)]:
        events += framer.feed(data[prev:cut])
        prev = cut
    return events, framer.flush()


def _with_line_ends(data: bytes, eol: bytes) -> bytes:
    return data.replace(b"\n", eol)


def _contents(events: list[bytes]) -> list[bytes]:
    """Events without their terminators: a CR-ended blank line may be sent before its LF arrives."""
    return [e.rstrip(b"\r\n") for e in events if e.strip(b"\r\n")]


@pytest.mark.parametrize("name", STREAMS)
def test_recorded_stream_frames_into_its_events(name):
    body = recordings()[name].body
    events, tail = frame(body, [])
    assert tail == b""
    assert b"".join(events) == body
    assert [e for e in events if e.startswith(b"data: [DONE]")] == [b"data: [DONE]\n\n"]
    assert len(events) == body.count(b"\n\n")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(STREAMS),
    eol=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    data=st.data(),
)
def test_any_split_of_a_recorded_stream_yields_the_same_events(name, eol, data):
    body = _with_line_ends(recordings()[name].body, eol)
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=40))
    whole, whole_tail = frame(body, [])
    split, split_tail = frame(body, cuts)
    assert b"".join(split) + split_tail == body
    assert _contents(split) == _contents(whole)
    assert whole_tail == split_tail == b""


def _json_safe(text: str) -> bytes:
    """Raw UTF-8 as it stands inside a JSON string: no quotes, backslashes or line ends."""
    return text.encode("utf-8").translate(None, b'\\"\r\n')


# Annotated: mypy infers `("Cs",)` as tuple[str] through hypothesis's strategy decorator, not its Literal.
_SURROGATES: tuple[Literal["Cs"]] = ("Cs",)
_json_text = st.text(alphabet=st.characters(blacklist_categories=_SURROGATES), max_size=20)
_event = st.one_of(
    _json_text.map(lambda t: b'data: {"t": "' + _json_safe(t) + b'"}'),
    st.just(b": keep-alive"),
    st.just(b":"),
    st.just(b"data: [DONE]"),
    st.just(b"event: ping\ndata: {}"),
    st.just(b"data: a\ndata: b"),
)


@settings(max_examples=3000, deadline=None)
@given(
    events=st.lists(_event, max_size=12),
    eols=st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=1, max_size=3),
    tail=st.binary(max_size=8).filter(lambda b: b"\n" not in b and b"\r" not in b),
    data=st.data(),
)
def test_random_streams_survive_random_splits(events, eols, tail, data):
    eol = eols[0]
    body = b"".join(e.replace(b"\n", eol) + eol + eol for e in events) + tail
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=30))
    whole, whole_tail = frame(body, [])
    split, split_tail = frame(body, cuts)
    assert b"".join(whole) + whole_tail == body == b"".join(split) + split_tail
    assert _contents(split) == _contents(whole)
    assert len(_contents(whole)) == len(events)


def test_crlf_split_between_cr_and_lf_is_one_line_end():
    framer = EventFramer()
    assert framer.feed(b"data: 1\r") == []
    assert framer.feed(b"\ndata: 2\r\n") == []  # CRLF, not CR + an empty LF line
    assert framer.feed(b"\r\n") == [b"data: 1\r\ndata: 2\r\n\r\n"]


def test_event_is_forwarded_as_soon_as_it_is_complete():
    framer = EventFramer()
    assert framer.feed(b'data: {"a":') == []
    assert framer.feed(b"1}\n") == []
    assert framer.feed(b"\n") == [b'data: {"a":1}\n\n']
    assert framer.buffered == 0


def test_utf8_character_split_across_messages_is_reassembled():
    payload = 'data: {"t":"\u00e9\u6f22\U0001f600"}\n\n'.encode()
    framer = EventFramer()
    out: list[bytes] = []
    for i in range(len(payload)):
        out += framer.feed(payload[i : i + 1])
    assert out == [payload]


def test_unterminated_tail_is_returned_on_flush():
    framer = EventFramer()
    assert framer.feed(b"data: done\n\ndata: partial") == [b"data: done\n\n"]
    assert framer.flush() == b"data: partial"


def test_buffer_holds_at_most_the_partial_event():
    framer = EventFramer()
    event = b"data: " + b"x" * 1000 + b"\n\n"
    for _ in range(50):
        framer.feed(event[:500])
        assert framer.buffered == 500
        framer.feed(event[500:])
        assert framer.buffered == 0


def test_data_payload_spans_only_single_data_lines():
    assert data_payload(b'data: {"a":1}\n\n') == (6, 13)
    assert data_payload(b'data:{"a":1}\r\n\r\n') == (5, 12)
    assert data_payload(b": keep-alive\n\n") is None
    assert data_payload(b"data: a\ndata: b\n\n") is None
    assert data_payload(b"event: x\ndata: {}\n\n") is None

"""Attacks on the stream sends' shortcuts, round 2: the armed sends give the general path's bytes and metrics.

The `send` handed to vLLM (`kernels.python_stream_send`, the compiled `_speedups.StreamSend`) serves an armed
stream's deltas (escaped quotes and backslashes in their texts included), choice 0's finish chunk (compiled
only), `[DONE]`, the usage chunk and the closing empty message itself. Whatever it serves, the client must get
the bytes, and the metrics must count the events (and the ones forwarded unchanged), that the general path
gives: the `ReshapingSend` handed every message with no armed send, and, for streams of valid JSON, the
decoding `DecodingStreamReshaper`.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recorded import recordings
from tests.support.kernels import IMPLS, kernels_for
from tests.unit.test_metrics import Sample, counted_since, scrape
from tests.unit.test_stream_finish import _run, _Sink
from tests.unit.test_stream_layouts import _events, _first_difference, _plan
from vllm_nvext import Mode
from vllm_nvext.kernels import PYTHON, Kernels
from vllm_nvext.outbound.decoding import DecodingStreamReshaper
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.send import ReshapingSend

START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


class _CountingClock(Clock):
    """A clock whose every reading is the next integer: the same readings on every path that reads it alike."""

    __slots__ = ("readings",)

    def __init__(self) -> None:
        super().__init__(1000.0, 0.0)
        self.readings = 0

    def elapsed_ms(self) -> float:
        self.readings += 1
        return float(self.readings)


def _never_armed(general: Any, downstream: Any) -> Any:
    """A stream send that hands every message to the general path (the `ReshapingSend`) and is never armed."""
    left = [0]

    def arm(countdown: int, *parts: Any) -> None:
        left[0] = countdown

    return general, arm, lambda: None, lambda: left[0]


NEVER_ARMED = replace(PYTHON, stream_send=_never_armed)  # the Python kernels whose send never serves a message


Messages = list[tuple[bytes, bool]]


def _sent(plan: Any, messages: Messages, kernels: Kernels) -> tuple[bytes, dict[Sample, float]]:
    """The client's bytes and what the counters added (events, events forwarded unchanged) for a stream sent
    through `kernels`' send."""
    before = scrape()
    sink = _Sink()
    reshaping = ReshapingSend(plan, _CountingClock(), sink, kernels)
    _run(reshaping.app_send(dict(START)))
    for body, more in messages:
        _run(reshaping.app_send({"type": "http.response.body", "body": body, "more_body": more}))
    reshaping.count_stream()
    return b"".join(sink.bodies), counted_since(before)


def _decoded(plan: Any, messages: Messages) -> bytes:
    general = DecodingStreamReshaper(plan, _CountingClock())
    return b"".join(general.feed(body) + (b"" if more else general.flush()) for body, more in messages)


def _messages(events: list[bytes]) -> Messages:
    return [(e, True) for e in events] + [(b"", False)]


# --- found broken: a delta whose ids a decode refuses, under a plan that reads the ids -----------------


@pytest.mark.parametrize("ids", [b"[1,,2]", b"[,]", b"[1,]", b"[01]"])
@pytest.mark.parametrize("name", ["chat_stream_ids_long", "vllm-0.33/completions_stream_ids_long"])
def test_a_delta_whose_ids_are_not_json_under_engine_data_goes_out_as_the_general_path_sends_it(name, ids, kernels):
    """engine_data reads every delta's ids (`ChunkReshaper.delta_ids`): the general path forwards a delta whose
    ids a decode refuses unchanged and counts it; the armed send raised out of vLLM's `send` (the client's
    stream cut short) instead."""
    rec = recordings()[name]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids", "engine_data"])
    events = _events(rec.body)
    at = len(events) // 2
    start = events[at].find(b'"token_ids":[') + len(b'"token_ids":')
    events[at] = events[at][:start] + ids + events[at][events[at].find(b"]", start) + 1 :]
    want, want_counted = _sent(plan, _messages(events), NEVER_ARMED)
    assert events[at] in _events(want), "the general path forwards the delta as vLLM wrote it"
    got, counted = _sent(plan, _messages(events), kernels)
    assert got == want, _first_difference(got, want)
    assert counted == want_counted


# --- the property: mutated recorded streams through every send -----------------------------------------

STREAMS = ["chat_stream_ids_long", "completions_stream_ids_long", "vllm-0.33/chat_stream_ids_stop",
           "vllm-0.33/chat_stream_ids_kv_usage", "vllm-0.33/completions_stream_ids_long", "chat_stream_ids",
           "vllm-0.33/chat_stream_ids_logprobs", "completions_stream_ids"]  # fmt: skip
SELECTORS = [
    ["completion_token_ids"],
    ["completion_token_ids", "prompt_token_ids"],
    ["completion_token_ids", "engine_data"],
    ["completion_token_ids", "timing"],
    ["prompt_token_ids"],
]
PLANS = [
    (name, plan)
    for name in STREAMS
    for mode in (Mode.NVEXT, Mode.BOTH, Mode.VLLM)
    for selectors in SELECTORS
    if (plan := _plan(recordings()[name], mode, selectors)) is not None
]
# Characters whose escapes a text may hold: quotes and backslashes (in runs), `/`, control characters,
# non-ASCII, a line separator, and the bytes of the keys and ids around the text.
CHARS = ['"', "\\", "\\", "/", "\x00", "\x08", "\x1f", "\x7f", "\n", "\t", "é", "\u2028", "😀", "[", "]", ",", ":",
         '","finish_reason":null,"token_ids":[1]}]}', "a"]  # fmt: skip
# JSON string bytes vLLM's encoder would not write, but a decode reads: the general path rewrites them.
OTHER_TEXTS = [b"\\u00e9", b"\\/", b"\\u001F", b"\\u0041", b"\\ud83d\\ude00", b"\\ud800", b"\\\\\\\\\\\\", b'\\\\\\"']
TEXTS = st.one_of(
    st.lists(st.sampled_from(CHARS), max_size=8).map(lambda cs: orjson.dumps("".join(cs))[1:-1]),
    st.lists(st.sampled_from(CHARS[:-2]), max_size=8).map(
        lambda cs: json.dumps("".join(cs), ensure_ascii=True).encode()[1:-1]
    ),
    st.lists(st.sampled_from(OTHER_TEXTS + [b"a", b"\\\\", b'\\"']), max_size=5).map(b"".join),
)
IDS = [b"null", b"[]", b"[0]", b"[1,2,3]", b"[123456789012345]", b"[1234567890123456]", b"[1,,2]", b"[01]"]
REASONS = [b'"stop"', b'"length"', b'"abort"', b'"tool_calls"', b"null"]
STOP_REASONS = [b"null", b"0", b"128001", b"-5", b'"</s>"', b'"\\n"', b'"\\u00e9"', b'"\xc3\xa9"', b'""', b'"a\\"b"',
                b"12345678901234567"]  # fmt: skip


def _text_span(event: bytes) -> tuple[int, int] | None:
    for key in (b'"delta":{"content":"', b'"delta":{"reasoning_content":"', b'"delta":{"reasoning":"', b'"text":"'):
        at = event.find(key)
        if at >= 0:
            text = close = at + len(key)
            while (close := event.find(b'"', close)) >= 0:
                if (close - text - len(event[text:close].rstrip(b"\\"))) % 2 == 0:
                    return text, close
                close += 1
    return None


def _value_span(event: bytes, key: bytes) -> tuple[int, int] | None:
    at = event.find(key)
    if at < 0:
        return None
    start = at + len(key)
    try:
        _, end = json.JSONDecoder().raw_decode(event.decode(errors="surrogateescape"), start)
    except ValueError:
        return None
    return start, len(event[:end].decode(errors="surrogateescape").encode(errors="surrogateescape"))


def _edit(event: bytes, key: bytes, value: bytes) -> bytes:
    span = _value_span(event, key)
    return event if span is None else event[: span[0]] + value + event[span[1] :]


def _valid(event: bytes) -> bool:
    if not event.startswith(b"data: {"):
        return True
    try:
        orjson.loads(event[6:-2])
        return True
    except orjson.JSONDecodeError:
        return False


@st.composite
def _streams(draw: st.DrawFn) -> tuple[Any, Messages, bool]:
    name, plan = draw(st.sampled_from(PLANS))
    events = _events(recordings()[name].body)
    with_text = [i for i, e in enumerate(events) if _text_span(e) is not None]
    rnd = random.Random(draw(st.integers(0, 2**32)))
    for _ in range(draw(st.integers(1, 8))):
        at = draw(st.sampled_from(with_text[1:3] + with_text[-2:] + with_text))  # arming, finish and any delta
        event = events[at]
        what = draw(st.sampled_from(["text", "text", "text", "ids", "ids", "reason", "stop", "no ids"]))
        if what == "text":
            span = _text_span(event)
            assert span is not None
            event = event[: span[0]] + draw(TEXTS) + event[span[1] :]
        elif what == "ids":
            event = _edit(event, b'"token_ids":', draw(st.sampled_from(IDS)))
        elif what == "reason":
            event = _edit(event, b'"finish_reason":', draw(st.sampled_from(REASONS)))
        elif what == "stop":
            event = _edit(event, b'"stop_reason":', draw(st.sampled_from(STOP_REASONS)))
        else:
            event = event.replace(b',"token_ids":', b',"tokens":', 1)
        events[at] = event
    if draw(st.booleans()):
        events = [e for e in events if b'"choices":[]' not in e]  # no include_usage
    if rnd.random() < 0.2:
        events.insert(rnd.randrange(2, len(events)), events[rnd.choice(with_text)])
    return plan, _messages(events), all(_valid(e) for e in events)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(stream=_streams())
def test_a_mutated_recorded_stream_gets_the_general_paths_bytes_and_metrics_through_either_send(stream):
    """Texts with every kind of escape (backslash runs before a quote, `\\u` escapes, `\\/`, lone surrogates),
    ids withheld or left out, other finish and stop reasons, with or without the usage chunk: both sends give
    the never-armed general path's bytes and metrics, which are the decoding path's for a stream of valid JSON."""
    plan, messages, valid = stream
    want, want_counted = _sent(plan, messages, NEVER_ARMED)
    if valid:
        decoded = _decoded(plan, messages)
        assert want == decoded, "the general path: " + _first_difference(want, decoded)
    for impl in IMPLS:
        got, counted = _sent(plan, messages, kernels_for(impl))
        assert got == want, f"{impl}: " + _first_difference(got, want)
        assert counted == want_counted, f"{impl}: the metrics read {counted}, the general path's {want_counted}"

"""The `send` handed to vLLM gives the general path's bytes, in both implementations.

`kernels.python_stream_send` and the compiled `_speedups.StreamSend` serve the mid-stream
deltas of an armed stream themselves (splice.Splice); everything else goes through the general
path. Whatever serves them, the client must get the bytes the general path gives (every shortcut
off, every event decoded) on every recorded stream and on the layouts hypothesis derives from
them (tests/unit/test_stream_layouts.py). The compiled arm is skipped only where the extension is
not built; CI sets VLLM_NVEXT_REQUIRE_EXTENSION=1 so that a missing build fails instead.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.recorded import recordings
from tests.unit.test_metrics import delta, sample, scrape
from tests.unit.test_stream_layouts import (
    RECORDED_CASES,
    RUST,
    STREAMS,
    _events,
    _first_difference,
    _plan,
    draw_relaid_stream,
)
from vllm_nvext import NvextMiddleware, Settings, metrics
from vllm_nvext.config import ConfigError, Mode
from vllm_nvext.kernels import KERNELS, PYTHON, Kernels
from vllm_nvext.outbound import stream as stream_module
from vllm_nvext.outbound.decoding import DecodingStreamReshaper
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.outbound.splice import Splice, learn_splice
from vllm_nvext.outbound.stream import StreamReshaper
from vllm_nvext.send import ReshapingSend

START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def _drive(awaitable: Any) -> None:
    coro = awaitable.__await__()
    with pytest.raises(StopIteration):
        coro.send(None)


class _Sink:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    async def __call__(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.body":
            self.bodies.append(bytes(message.get("body", b"")))


def _through_send(plan: Any, events: list[bytes], kernels: Kernels) -> tuple[bytes, ReshapingSend]:
    """The client's bytes for a stream sent one event per message through the send handed to vLLM."""
    sink = _Sink()
    reshaping = ReshapingSend(plan, Clock(), sink, kernels)
    _drive(reshaping.app_send(dict(START)))
    for event in events:
        _drive(reshaping.app_send({"type": "http.response.body", "body": event, "more_body": True}))
    _drive(reshaping.app_send({"type": "http.response.body", "body": b"", "more_body": False}))
    return b"".join(sink.bodies), reshaping


def _general(plan: Any, events: list[bytes]) -> bytes:
    general = DecodingStreamReshaper(plan, Clock())
    return b"".join(general.feed(e) for e in events) + general.flush()


@pytest.mark.parametrize(("name", "mode", "selectors"), RECORDED_CASES)
def test_recorded_stream_through_the_send_gives_the_general_paths_bytes(name, mode, selectors, kernels):
    plan = _plan(recordings()[name], mode, selectors)
    events = _events(recordings()[name].body)
    got, _ = _through_send(plan, events, kernels)
    want = _general(plan, events)
    assert got == want, (
        f"{kernels.impl}: the client would get other bytes than the general path gives" + _first_difference(got, want)
    )


# Every recorded stream with ids of every layout (vLLM 0.32, 0.33 and 0.34, vllm-rs 0.33 and 0.34; chat and
# completions, short and long, stopped and with kv_transfer_params); with logprobs a delta is not the splice's.
ARMING_STREAMS = [n for n in STREAMS if "_stream_ids" in n and "logprobs" not in n]


@pytest.mark.parametrize("mode", [Mode.NVEXT, Mode.BOTH])
@pytest.mark.parametrize("name", ARMING_STREAMS)
def test_every_recorded_layout_arms_the_send_after_its_first_chunks(name, mode, kernels, monkeypatch):
    # The armed send serves every message after the first chunk and the delta that arms it: each mid-stream delta,
    # the finish chunk, [DONE] and the end of the stream. Counted, not timed: the messages the send hands back to
    # the general path (`ReshapingSend.__call__`), whatever the stream's length. A layout that stops arming (every
    # delta through Python: ~3 µs a delta instead of ~0.2, benchmarks/bench_layouts.py) fails here.
    rec = recordings()[name]
    plan = _plan(rec, mode, ["completion_token_ids"])
    handed_back: list[int] = []
    real = ReshapingSend.__call__

    async def counting(self, message):
        if message["type"] == "http.response.body":
            handed_back.append(id(message))
        await real(self, message)

    monkeypatch.setattr(ReshapingSend, "__call__", counting)
    sink = _Sink()
    reshaping = ReshapingSend(plan, Clock(), sink, kernels)
    _drive(reshaping.app_send(dict(START)))
    messages = [{"type": "http.response.body", "body": e, "more_body": True} for e in _events(rec.body)]
    messages.append({"type": "http.response.body", "body": b"", "more_body": False})
    for message in messages:
        _drive(reshaping.app_send(message))
    python = [i for i, message in enumerate(messages) if id(message) in handed_back]
    deltas = sum(e["choices"][0].get("finish_reason") is None for e in rec.events() if e["choices"])
    finish = next(i for i, e in enumerate(rec.events()) if e["choices"] and e["choices"][0].get("finish_reason"))
    # The first chunk and the delta that arms; the finish chunk too where it moves kv_transfer_params, and vllm-rs's
    # (its deltas teach no finish chunk's bytes: no finish reason before their ids).
    moved = b'"kv_transfer_params":{' in rec.body or rec.vllm in RUST
    allowed = {0, 1, finish} if moved else {0, 1}
    assert deltas >= 2 and set(python) <= allowed, (
        f"{kernels.impl}: {len(python)} of {len(messages)} messages went through the general path (at {python[:8]}),"
        f" not only the first chunk and the delta that arms the send"
    )
    assert b"".join(sink.bodies) == _general(plan, _events(rec.body)), "the armed send gave other bytes"


def test_the_metrics_count_every_event_whichever_path_serves_it(kernels):
    rec = recordings()["chat_stream_ids_long"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = _events(rec.body)
    before = scrape()
    _, reshaping = _through_send(plan, events, kernels)
    reshaping.count_stream()
    reshaping.count_stream()  # once: a second call adds nothing
    got = delta(before)
    counted = got.pop(sample("reshaped_events", endpoint="chat", kind="stream"), 0)
    assert counted == len(events), f"{kernels.impl}: the reshaped-events counter reads {counted}, not {len(events)}"
    assert 0 < got.pop(sample("reshaping_seconds", endpoint="chat", kind="stream"), 0) < 1.0
    assert got == {}, f"{kernels.impl}: nothing forwarded unchanged, no other counter"


@pytest.mark.parametrize("selectors", [["timing"], ["completion_token_ids", "timing"]])
def test_the_first_tokens_time_reaches_timing_whichever_path_serves_the_deltas(kernels, selectors):
    # Only `timing` reads the first token's time: the deltas of a stream that asks for it are reported to
    # the reshaper until it is known, by whichever send serves them (only then; no other plan records it).
    rec = recordings()["chat_stream_ids_long"]
    plan = _plan(rec, Mode.NVEXT, selectors)
    got, _ = _through_send(plan, _events(rec.body), kernels)
    timed = [json.loads(e[6:]) for e in got.split(b"\n\n") if e.startswith(b"data: {") and b'"timing":' in e]
    assert len(timed) == 1, "one finish chunk carries timing"
    timing = timed[0]["nvext"]["timing"]
    assert "ttft_ms" in timing and 0 <= timing["ttft_ms"] <= timing["total_time_ms"], timing


def test_with_the_metrics_off_the_send_gives_the_general_paths_bytes(kernels, monkeypatch):
    monkeypatch.setattr(metrics, "enabled", lambda: False)  # prometheus_client not importable: nothing timed
    for name, mode, selectors in (p.values for p in RECORDED_CASES):
        plan = _plan(recordings()[name], mode, selectors)
        events = _events(recordings()[name].body)
        got, reshaping = _through_send(plan, events, kernels)
        assert got == _general(plan, events), f"{kernels.impl} {name}: other bytes than the general path"
        assert reshaping._tally is None


@pytest.mark.parametrize("name", ["chat_stream_ids_long", "vllm-0.33/completions_stream_ids"])
def test_an_event_stream_answering_a_unary_request_gets_the_general_paths_bytes_and_counts(name, kernels):
    # A unary request's send is the ReshapingSend itself (no stream send made); should its answer be an event
    # stream all the same, the general path serves every message, and the metrics count every event.
    rec = recordings()[name]
    plan = replace(_plan(rec, Mode.NVEXT, ["completion_token_ids"]), stream=False)
    events = _events(rec.body)
    before = scrape()
    got, reshaping = _through_send(plan, events, kernels)
    reshaping.count_stream()
    assert got == _general(plan, events), f"{kernels.impl}: other bytes than the general path"
    endpoint = "chat" if name.startswith("chat") else "completions"
    assert delta(before).get(sample("reshaped_events", endpoint=endpoint, kind="stream")) == len(events)


def test_the_send_serves_memoryview_bodies_and_message_shapes_it_does_not_know_through_the_general_path(kernels):
    rec = recordings()["chat_stream_ids_long"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = _events(rec.body)
    sink = _Sink()
    reshaping = ReshapingSend(plan, Clock(), sink, kernels)
    _drive(reshaping.app_send(dict(START)))
    for i, event in enumerate(events):
        body: Any = memoryview(event) if i % 3 == 0 else bytearray(event) if i % 3 == 1 else event
        message: dict[str, Any] = {"type": "http.response.body", "body": body, "more_body": True}
        if i == 5:
            message = {"type": "http.response.body", "more_body": 1, "body": event}  # a truthy non-bool
        _drive(reshaping.app_send(message))
    _drive(reshaping.app_send({"type": "http.response.body", "more_body": False}))
    assert b"".join(sink.bodies) == _general(plan, events), f"{kernels.impl}: other bytes than the general path"


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_the_send_gives_the_general_paths_bytes_on_any_layout(kernels, data):
    case = draw_relaid_stream(data)
    if case is None:
        return
    label, plan, events = case
    got, _ = _through_send(plan, events, kernels)
    want = _general(plan, events)
    assert got == want, f"{kernels.impl} {label}" + _first_difference(got, want)


def test_the_two_implementations_agree_with_each_other_on_every_recorded_stream(kernels):
    reference = PYTHON
    other = kernels
    for name, mode, selectors in (p.values for p in RECORDED_CASES):
        plan = _plan(recordings()[name], mode, selectors)
        events = _events(recordings()[name].body)
        sinks = []
        for make in (reference, other):
            sink = _Sink()
            reshaping = ReshapingSend(plan, Clock(), sink, make)
            _drive(reshaping.app_send(dict(START)))
            for event in events:
                _drive(reshaping.app_send({"type": "http.response.body", "body": event, "more_body": True}))
            sinks.append(sink.bodies)
        assert sinks[0] == sinks[1], f"{name}: python and {kernels.impl} send other messages"


def test_the_setting_forces_the_pure_python_path():
    assert NvextMiddleware(lambda *a: None, pure_python=True).stream_path == "python"
    assert Settings.from_env({"VLLM_NVEXT_PURE_PYTHON": "1"}).pure_python is True
    assert Settings.from_env({}).pure_python is False
    with pytest.raises(ConfigError, match="VLLM_NVEXT_PURE_PYTHON"):
        Settings.from_env({"VLLM_NVEXT_PURE_PYTHON": "maybe"})
    with pytest.raises(ConfigError, match="pure_python"):
        Settings(pure_python="yes")  # type: ignore[arg-type]
    built = "c" if "c" in KERNELS else "python"
    assert NvextMiddleware(lambda *a: None).stream_path == built


def test_the_startup_log_and_the_info_metric_say_which_path_runs(caplog):
    from prometheus_client import REGISTRY

    with caplog.at_level("INFO", logger="vllm_nvext"):
        NvextMiddleware(lambda *a: None, pure_python=True)
    assert "the python stream path runs" in caplog.text
    # Inside vLLM's server the line goes to vLLM's own log too (vLLM prints only its `vllm` loggers).
    import logging

    import vllm.logger  # noqa: F401  (what `vllm serve` has loaded before it builds the middleware)

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level
    vllm_log.addHandler(handler)
    vllm_log.setLevel(logging.INFO)  # vLLM's default (VLLM_LOGGING_LEVEL)
    try:
        NvextMiddleware(lambda *a: None, pure_python=True)
    finally:
        vllm_log.removeHandler(handler)
        vllm_log.setLevel(level)
    assert any("the python stream path runs" in m for m in seen), "vLLM's log names the stream path"
    assert REGISTRY.get_sample_value("vllm_nvext:stream_path_info", {"impl": "python"}) == 1
    if "c" in KERNELS:
        NvextMiddleware(lambda *a: None)
        assert REGISTRY.get_sample_value("vllm_nvext:stream_path_info", {"impl": "c"}) == 1
        assert REGISTRY.get_sample_value("vllm_nvext:stream_path_info", {"impl": "python"}) == 0


# ---------------------------------------------------------------- arming: the splice a delta teaches


def _arming_calls(plan: Any, events: list[bytes]) -> list[tuple[bytes, int, int, bool, bool, bytes]]:
    """What the stream's learner is asked when a delta arms the splice: (event, start, end, strip, trio, out)."""
    calls: list[tuple[bytes, int, int, bool, bool, bytes]] = []

    def recording(*args: Any) -> Any:
        calls.append(args)
        return learn_splice(*args)

    reshaper = StreamReshaper(plan, Clock(), replace(PYTHON, learn_splice=recording))
    for event in events:
        reshaper.feed(event)
    return calls


def _variants(call: tuple[bytes, int, int, bool, bool, bytes], text: bytes) -> list[tuple[Any, ...]]:
    """The arming delta with `text` (a JSON string's bytes) in place of its own, and the bytes the splice
    learned from the original delta renders for it, that delta itself and one byte more as what it must give."""
    event, start, end, strip, trio, out = call
    parts = learn_splice(*call)
    if parts is None:
        return [call]
    prefix, head, tail, *_ = parts
    close = start - len(head)
    moved = len(text) - (close - len(prefix))
    relaid = event[: len(prefix)] + text + event[close:]
    rendered = Splice(*parts, strip, trio).render(relaid, start + moved)
    return [call, *((relaid, start + moved, end + moved, strip, trio, o) for o in (rendered, relaid, rendered + b" "))]


_TEXTS = [b"", b"x", b'\\"', b"\\\\", b'a\\\\\\"b', b"\\u0022", b"\\n", b"[1,2]", b'"', b"a\nb", b"a\\"]


def test_the_two_learners_arm_the_same_splice_on_every_recorded_stream(kernels):
    learner = kernels.learn_splice
    armed = 0
    for name, mode, selectors in (p.values for p in RECORDED_CASES):
        plan = _plan(recordings()[name], mode, selectors)
        for call in _arming_calls(plan, _events(recordings()[name].body)):
            for text in _TEXTS:
                for args in _variants(call, text):
                    want = learn_splice(*args)
                    armed += want is not None
                    assert learner(*args) == want, f"{name}: {kernels.impl} learns another splice from {args[0]!r}"
    assert armed > 100, "the recordings' deltas arm a splice"


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), text=st.text(max_size=8))
def test_the_two_learners_arm_the_same_splice_on_any_layout_and_text(kernels, data, text):
    learner = kernels.learn_splice
    case = draw_relaid_stream(data)
    if case is None:
        return
    label, plan, events = case
    encoded = json.dumps(text, ensure_ascii=data.draw(st.booleans()))[1:-1].encode()
    for call in _arming_calls(plan, events):
        for args in _variants(call, encoded):
            assert learner(*args) == learn_splice(*args), f"{kernels.impl} {label}: another splice from {args[0]!r}"


def test_a_splice_that_does_not_give_the_byte_level_paths_bytes_is_never_armed(kernels, monkeypatch):
    rec = recordings()["chat_stream_ids_long"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    events = _events(rec.body)
    call = _arming_calls(plan, events)[0]
    event, start, end, strip, trio, out = call
    learner = kernels.learn_splice
    assert learner(*call) is not None, "the recorded delta arms a splice"
    for wrong in (out + b" ", out[:-1], out[:-2] + b"}\n", event):
        assert learner(event, start, end, strip, trio, wrong) is None, (
            f"{kernels.impl} arms a splice that renders {out!r}"
        )
    # Through the send: byte-level paths that give other bytes than the splice leave every delta to them (the
    # first delta is served as the first chunk is, the later ones by `delta_bytes`).
    real, real_first = stream_module.delta_bytes, stream_module.first_chunk

    def other_bytes(event: bytes, start: int, end: int, *args: Any) -> bytes | None:
        new = real(event, start, end, *args)
        return (event if new is None else new)[:-2] + b" \n\n"

    def other_first(*args: Any) -> tuple[bytes, int, int] | None:
        served = real_first(*args)
        return None if served is None else (served[0][:-2] + b" \n\n", *served[1:])

    monkeypatch.setattr(stream_module, "delta_bytes", other_bytes)
    monkeypatch.setattr(stream_module, "first_chunk", other_first)
    got, reshaping = _through_send(plan, events, kernels)
    stream = reshaping._stream
    assert stream is not None and stream.splice is None, f"{kernels.impl}: armed a splice the byte-level path disowns"
    alone = StreamReshaper(plan, Clock(), kernels)  # the stream path by itself, no splice served by the send
    want = b"".join(alone.feed(e) for e in events) + alone.flush()
    assert got.count(b" \n\n") > 300 and got == want, (
        f"{kernels.impl}: a delta went out other than the byte-level path made it"
    )


def test_a_delta_whose_text_or_ids_cannot_be_found_teaches_no_splice(kernels):
    learner = kernels.learn_splice
    rec = recordings()["chat_stream_ids_long"]
    plan = _plan(rec, Mode.NVEXT, ["completion_token_ids"])
    event, start, end, strip, trio, out = _arming_calls(plan, _events(rec.body))[0]
    assert learner(event, start, end, strip, trio, out) is not None
    unclosed = b'data: {"text":"ab\\"[1]}\n\n'  # every quote after the text's opening one escaped
    cases = {
        "no text key": (event.replace(b'"content":', b'"other":'), start, end),
        "no closing quote": (unclosed, unclosed.find(b"["), unclosed.find(b"]") + 1),
        "a list after the ids": (event[:-4] + b',"x":[]}\n\n', start, end),
    }
    for label, (relaid, s, e) in cases.items():
        assert learn_splice(relaid, s, e, strip, trio, out) is None, f"python: {label}"
        assert learner(relaid, s, e, strip, trio, out) is None, f"{kernels.impl}: {label}"
    if kernels.impl == "c":
        with pytest.raises(ValueError, match="inside the event"):
            learner(event, end, start, strip, trio, out)

"""Stream reshaping, bytes in and bytes out: every shortcut gives the bytes of the general path."""

from __future__ import annotations

import json

import pytest

from tests.helpers import sse_events, sse_frames
from tests.recorded import recordings
from vllm_nvext import Mode
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.outbound.decoding import DecodingStreamReshaper
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.outbound.stream import StreamReshaper

STREAMS = sorted(n for n, r in recordings().items() if r.stream and "n2" not in n)
SELECTOR_SETS = [
    ["completion_token_ids"],
    ["completion_token_ids", "engine_data"],
    ["prompt_token_ids"],
    ["engine_data"],
    ["timing", "stop_reason", "detailed_finish_reason"],
]


def _run(reshaper: StreamReshaper, events: list[bytes]) -> list[dict]:
    sent = b""
    for raw in events:
        new = reshaper.reshape_event(raw)
        sent += raw if new is None else new  # a finish chunk may wait for the next event
    sent += reshaper.flush()
    out = sse_events(sent, complete=False)
    for event in out:
        event.get("nvext", {}).pop("timing", None)  # wall-clock values differ run to run
    return out


@pytest.mark.parametrize("selectors", SELECTOR_SETS, ids="+".join)
@pytest.mark.parametrize("mode", [Mode.NVEXT, Mode.BOTH, Mode.AUTO])
@pytest.mark.parametrize("name", STREAMS)
def test_byte_level_path_equals_decoding_every_chunk(name, mode, selectors):
    rec = recordings()[name]
    request = {**rec.request, "nvext": {"extra_fields": selectors}}
    plan = plan_request(json.dumps(request).encode(), rec.endpoint, mode)
    assert plan is not None
    events = sse_frames(rec.body)
    fast = _run(StreamReshaper(plan, Clock()), events)
    slow = _run(DecodingStreamReshaper(plan, Clock()), events)
    assert fast == slow


def test_byte_level_path_serves_mid_stream_deltas(json_decodes):
    rec = recordings()["chat_stream_ids_long"]
    plan = plan_request(
        json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids"]}}).encode(),
        rec.endpoint,
        Mode.NVEXT,
    )
    reshaper = StreamReshaper(plan, Clock())
    events = sse_frames(rec.body)
    reshaper.reshape_event(events[0])
    reshaper.reshape_event(events[1])  # the first delta arms the splice (splice.Splice)
    delta = events[5]
    decodes_before = len(json_decodes)
    out = reshaper.reshape_event(delta)
    assert len(json_decodes) == decodes_before and isinstance(out, bytes), "a plain delta chunk must not need a decode"
    # everything vLLM wrote outside the changed spans is kept byte for byte
    assert out.startswith(delta[: delta.index(b',"token_ids":')])


def test_key_lookalikes_inside_text_are_not_matched():
    rec = recordings()["chat_stream_ids"]
    plan = plan_request(
        json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids"]}}).encode(),
        rec.endpoint,
        Mode.NVEXT,
    )
    events = sse_frames(rec.body)
    event = json.loads(events[2][6:])
    event["choices"][0]["delta"]["content"] = ',"token_ids":[9,9],"finish_reason":null,"nvext":{}}'
    tricky = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
    reshaper = StreamReshaper(plan, Clock())
    reshaper.reshape_event(events[0])
    got = json.loads(reshaper.reshape_event(tricky)[6:])
    assert got["choices"][0]["delta"]["content"] == event["choices"][0]["delta"]["content"]
    assert got["nvext"]["completion_token_ids"] == event["choices"][0]["token_ids"]
    assert got["choices"][0]["token_ids"] is None


def _timing_free(body: bytes) -> list[dict]:
    out = []
    for block in body.split(b"\n\n"):
        if block.startswith(b"data: {"):
            event = json.loads(block[6:])
            event.get("nvext", {}).pop("timing", None)  # wall-clock values differ run to run
            out.append(event)
        elif block:
            out.append({"raw": block.decode()})
    return out


@pytest.mark.parametrize("selectors", SELECTOR_SETS, ids="+".join)
@pytest.mark.parametrize("name", STREAMS)
def test_feeding_whole_events_equals_feeding_split_bytes(name, selectors):
    """The single-event shortcut in `feed` gives the bytes the framer gives for any split."""
    rec = recordings()[name]
    request = {**rec.request, "nvext": {"extra_fields": selectors}}
    plan = plan_request(json.dumps(request).encode(), rec.endpoint, Mode.NVEXT)
    assert plan is not None
    whole = StreamReshaper(plan, Clock())
    by_event = b"".join(whole.feed(e) for e in sse_frames(rec.body) + [b"data: [DONE]\n\n"]) + whole.flush()
    split = StreamReshaper(plan, Clock())
    pieces = [rec.body[i : i + 7] for i in range(0, len(rec.body), 7)]
    by_piece = b"".join(split.feed(p) for p in pieces) + split.flush()
    assert by_event.endswith(b"data: [DONE]\n\n") and rec.body.endswith(b"data: [DONE]\n\n")
    assert _timing_free(by_event) == _timing_free(by_piece)


def test_unterminated_tail_is_flushed_as_it_came():
    rec = recordings()["chat_stream_ids"]
    plan = plan_request(
        json.dumps({**rec.request, "nvext": {"extra_fields": ["completion_token_ids"]}}).encode(),
        rec.endpoint,
        Mode.NVEXT,
    )
    stream = StreamReshaper(plan, Clock())
    assert stream.feed(b'data: {"partial') == b""
    assert stream.buffered == len(b'data: {"partial')
    assert stream.flush() == b'data: {"partial' and stream.buffered == 0


def _with_usage_reports(body: bytes) -> bytes:
    """The recorded stream as vLLM sends it with --enable-per-request-metrics and
    --enable-prompt-tokens-details: both ride on the usage-only chunk."""
    out = []
    for block in body.split(b"\n\n")[:-1]:
        if block.startswith(b"data: {"):
            event = json.loads(block[6:])
            if event.get("choices") == []:
                event["usage"]["prompt_tokens_details"] = {"cached_tokens": 3}
                event["metrics"] = {"time_to_first_token_ms": 4.25, "queue_time_ms": 0.5}
                block = b"data: " + json.dumps(event, separators=(",", ":")).encode()
        out.append(block + b"\n\n")
    return b"".join(out)


def _stream_plan(rec, selectors):
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    plan = plan_request(
        json.dumps({**request, "nvext": {"extra_fields": selectors}}).encode(), rec.endpoint, Mode.NVEXT
    )
    assert plan is not None
    return plan


USAGE_STREAMS = [n for n in STREAMS if any(e.get("choices") == [] for e in recordings()[n].events())]


@pytest.mark.parametrize("name", USAGE_STREAMS)
def test_finish_chunk_waits_for_the_usage_chunk_and_carries_what_vllm_reports_there(name):
    rec = recordings()[name]
    body = _with_usage_reports(rec.body)
    plan = _stream_plan(rec, ["timing", "engine_data"])
    assert plan.finish_waits_for_usage
    stream = StreamReshaper(plan, Clock())
    events = [b + b"\n\n" for b in body.split(b"\n\n")[:-1]]
    sent = [stream.feed(e) for e in events] + [stream.flush()]
    usage_at = next(i for i, e in enumerate(events) if b'"choices":[]' in e)
    assert sent[usage_at - 1] == b"", "the finish chunk is held until the usage chunk"
    finish, usage = sent[usage_at].split(b"\n\n")[:2]
    assert usage + b"\n\n" == events[usage_at], "the usage chunk itself goes out as vLLM sent it"
    nv = json.loads(finish[6:])["nvext"]
    assert list(nv) == ["timing", "engine_data"]
    timing = nv["timing"]
    assert list(timing) == [
        "request_received_ms",
        "prefill_wait_time_ms",
        "prefill_time_ms",
        "ttft_ms",
        "total_time_ms",
    ]
    assert (timing["prefill_wait_time_ms"], timing["prefill_time_ms"], timing["ttft_ms"]) == (0.5, 4.25, 4.75)
    engine = nv["engine_data"]
    assert list(engine)[:2] == ["prompt_token_ids", "kv_cache_hit"]
    assert engine["kv_cache_hit"] == {"prompt_tokens": len(engine["prompt_token_ids"]), "reused_tokens": 3}


@pytest.mark.parametrize("name", STREAMS)
def test_without_a_usage_chunk_the_finish_chunk_goes_out_before_done(name):
    rec = recordings()[name]
    body = b"".join(b + b"\n\n" for b in rec.body.split(b"\n\n")[:-1] if b'"choices":[]' not in b)
    plan = _stream_plan(rec, ["timing"])
    stream = StreamReshaper(plan, Clock())
    out = b"".join(stream.feed(b + b"\n\n") for b in body.split(b"\n\n")[:-1]) + stream.flush()
    blocks = out.split(b"\n\n")[:-1]
    assert blocks[-1] == b"data: [DONE]" and len(blocks) == len(body.split(b"\n\n")[:-1])
    finishes = [json.loads(b[6:]) for b in blocks[:-1] if b'"finish_reason":"' in b]
    assert finishes and all("timing" in f["nvext"] for f in finishes)
    assert "prefill_time_ms" not in finishes[-1]["nvext"]["timing"], "nothing vLLM did not report"


def test_a_stream_cut_after_the_finish_chunk_still_delivers_it():
    rec = recordings()["chat_stream_ids"]
    plan = _stream_plan(rec, ["engine_data"])
    stream = StreamReshaper(plan, Clock())
    events = [b + b"\n\n" for b in rec.body.split(b"\n\n")[:-1]]
    finish_at = next(i for i, e in enumerate(events) if b'"finish_reason":"' in e)
    sent = b"".join(stream.feed(e) for e in events[: finish_at + 1])
    assert b"engine_data" not in sent
    tail = stream.flush()
    assert json.loads(tail[6:-2])["nvext"]["engine_data"]["finished"] is True


def test_several_choices_never_wait():
    rec = recordings()["completions_stream_ids_n2"]
    request = {k: v for k, v in rec.request.items() if k != "return_token_ids"}
    plan = plan_request(
        json.dumps({**request, "nvext": {"extra_fields": ["timing"]}}).encode(), rec.endpoint, Mode.NVEXT
    )
    assert plan is not None and not plan.finish_waits_for_usage

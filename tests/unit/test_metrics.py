"""The Prometheus counters, through the middleware over recorded vLLM responses.

Counters live in prometheus_client's default registry (the one vLLM's `/metrics` serves), which
every test in the session shares: each test compares a scrape taken before its requests with
one taken after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import REGISTRY, generate_latest

from tests.recorded import Recording, recording
from tests.unit.asgi import Upstream, call
from vllm_nvext import Mode, NvextMiddleware, Settings, metrics
from vllm_nvext import _json as nvjson
from vllm_nvext.inbound.fields import DECISION_FIELDS, replica_model
from vllm_nvext.inbound.nvext_schema import NVEXT_FIELDS, NVEXT_OBJECTS, param_names
from vllm_nvext.outbound import chunks as nvresponse
from vllm_nvext.outbound import stream as stream_module
from vllm_nvext.protocol import Endpoint

ROOT = Path(__file__).resolve().parents[2]
NVEXT_IDS = {"extra_fields": ["completion_token_ids"]}
DIALECT_FIELDS: dict[str, dict[str, Any]] = {
    "vllm": {"return_token_ids": True},
    "nvext": {"nvext": NVEXT_IDS},
    "both": {"return_token_ids": True, "nvext": NVEXT_IDS},
}
Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape() -> dict[Sample, float]:
    """Every `vllm_nvext:*_total` sample in the registry vLLM serves."""
    out = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name.startswith(metrics.PREFIX) and s.name.endswith("_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def delta(before: dict[Sample, float]) -> dict[Sample, float]:
    after = scrape()
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def counted_since(before: dict[Sample, float]) -> dict[Sample, float]:
    """What the counters added since `before` (a `scrape`), less the reshaping time (it differs run to run)."""
    return {k: v for k, v in delta(before).items() if k[0] != metrics.PREFIX + "reshaping_seconds_total"}


def sample(name: str, **labels: str) -> Sample:
    return (metrics.PREFIX + name + "_total", tuple(sorted(labels.items())))


def request_sample(endpoint: str, dialect: str, placement: str, kind: str) -> Sample:
    return sample("requests", endpoint=endpoint, dialect=dialect, placement=placement, kind=kind)


def _app(rec: Recording, cuts=(), **settings) -> tuple[NvextMiddleware, Upstream]:
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=rec.body, cuts=cuts)
    return NvextMiddleware(upstream, settings=Settings(**settings)), upstream


def _body(rec: Recording, dialect: str | None, **extra) -> bytes:
    body = {k: v for k, v in rec.request.items() if k not in ("return_token_ids", "nvext")}
    return json.dumps({**body, **(DIALECT_FIELDS[dialect] if dialect else {}), **extra}).encode()


def _count_events(body: bytes) -> int:
    return body.count(b"\n\n")


def _endpoint(rec: Recording) -> str:
    return rec.endpoint.value


def _kind(rec: Recording) -> str:
    return "stream" if rec.stream else "unary"


def test_prometheus_client_is_there_in_the_test_environment():
    assert metrics.enabled(), "vLLM always ships prometheus_client; the counters must be on here"


# --- requests per endpoint, dialect, placement, kind -----------------------------------------


@pytest.mark.parametrize("name", ["chat_unary_plain", "completions_stream_plain"])
@pytest.mark.parametrize("mode", list(Mode))
async def test_request_that_opts_into_nothing_is_counted_as_none_without_being_parsed(name, mode, monkeypatch):
    def forbidden(_data):
        raise AssertionError("a request that opts into nothing must not be parsed")

    monkeypatch.setattr(nvjson, "loads", forbidden)
    rec = recording(name)
    app, _ = _app(rec, mode=mode)
    before = scrape()
    result = await call(app, rec.path, json.dumps(rec.request).encode())
    assert result.body == rec.body
    # Never parsed: whether it streams is unknown; nothing was reshaped.
    assert delta(before) == {request_sample(_endpoint(rec), "none", mode.value, "unknown"): 1}


@pytest.mark.parametrize(
    "name", ["chat_unary_ids", "chat_stream_ids", "completions_unary_ids", "completions_stream_ids"]
)
@pytest.mark.parametrize("dialect", list(DIALECT_FIELDS))
@pytest.mark.parametrize("header", [None, "nvext", "vllm"])
async def test_each_request_is_counted_once_by_dialect_asked_and_placement_served(name, dialect, header):
    rec = recording(name)
    app, _ = _app(rec)
    headers = [(b"content-type", b"application/json")]
    if header:
        headers.append((b"x-nvext-mode", header.encode()))
    before = scrape()
    result = await call(app, rec.path, _body(rec, dialect), headers=headers)
    assert result.status == 200
    got = {k: v for k, v in delta(before).items() if k[0] == metrics.PREFIX + "requests_total"}
    assert got == {request_sample(_endpoint(rec), dialect, header or "auto", _kind(rec)): 1}


async def test_non_json_body_is_counted_as_none():
    rec = recording("chat_unary_ids")
    app, _ = _app(rec, mode=Mode.NVEXT)
    before = scrape()
    await call(app, rec.path, b'{"return_token_ids": true}', headers=((b"content-type", b"text/plain"),))
    assert delta(before) == {request_sample("chat", "none", "nvext", "unknown"): 1}


async def test_other_routes_are_not_counted():
    rec = recording("chat_unary_ids")
    app, _ = _app(rec)
    before = scrape()
    await call(app, "/v1/embeddings", _body(rec, "nvext"))
    await call(app, rec.path, b"", method="GET")
    assert delta(before) == {}


async def test_both_mounts_count_a_request_once():
    rec = recording("chat_stream_ids")
    upstream = Upstream(status=rec.status, content_type=rec.content_type, body=rec.body)
    app = NvextMiddleware(NvextMiddleware(upstream))  # --middleware outside, the plugin inside
    before = scrape()
    result = await call(app, rec.path, _body(rec, "nvext"))
    got = delta(before)
    assert got[request_sample("chat", "nvext", "auto", "stream")] == 1
    assert got[sample("reshaped_events", endpoint="chat", kind="stream")] == _count_events(result.body)


# --- reshaped events and the time spent on them --------------------------------------------


@pytest.mark.parametrize("name", ["chat_stream_ids", "chat_stream_ids_long", "completions_stream_ids_long"])
@pytest.mark.parametrize("cuts", [(), (5, 301, 302, 4000)])
async def test_a_reshaped_stream_counts_every_event_and_its_time(name, cuts):
    rec = recording(name)
    app, _ = _app(rec, cuts=cuts)
    before = scrape()
    result = await call(app, rec.path, _body(rec, "nvext"))
    assert b'"nvext"' in result.body
    got = delta(before)
    events = sample("reshaped_events", endpoint=_endpoint(rec), kind="stream")
    seconds = sample("reshaping_seconds", endpoint=_endpoint(rec), kind="stream")
    assert got[events] == _count_events(rec.body) == _count_events(result.body)  # [DONE] included
    assert 0 < got[seconds] < 1.0
    assert set(got) == {request_sample(_endpoint(rec), "nvext", "auto", "stream"), events, seconds}


@pytest.mark.parametrize("name", ["chat_unary_ids", "completions_unary_ids"])
async def test_a_reshaped_unary_body_counts_as_one_event(name):
    rec = recording(name)
    app, _ = _app(rec)
    before = scrape()
    await call(app, rec.path, _body(rec, "both"))
    got = delta(before)
    assert got[sample("reshaped_events", endpoint=_endpoint(rec), kind="unary")] == 1
    assert got[sample("reshaping_seconds", endpoint=_endpoint(rec), kind="unary")] > 0


async def test_responses_that_need_no_reshaping_count_no_events():
    rec = recording("chat_stream_ids")
    app, _ = _app(rec)  # auto + return_token_ids: vLLM's own placement, vLLM's own send
    before = scrape()
    await call(app, rec.path, _body(rec, "vllm"))
    assert delta(before) == {request_sample("chat", "vllm", "auto", "stream"): 1}
    error = recording("error_max_tokens")
    app, _ = _app(error)
    before = scrape()
    await call(app, error.path, _body(error, "nvext"))  # vLLM's 400 passes through untouched
    assert delta(before) == {request_sample("completions", "nvext", "auto", "unary"): 1}


def _estimate(costs: list[int]) -> tuple[float, list[int]]:
    """What the middleware's stream path does with a tally: (the estimate the counters read once the stream is
    counted, the messages timed)."""
    tally = metrics.StreamTally()
    left = metrics.StreamTally.FIRST
    timed = []
    for n, cost in enumerate(costs, 1):
        left -= 1
        if not left:
            timed.append(n)
            left = tally.add(cost)
    before = scrape()
    tally.count(Endpoint.CHAT, left, 0, 0)
    got = delta(before)
    assert got.get(sample("reshaped_events", endpoint="chat", kind="stream"), 0) == len(costs)
    return got.get(sample("reshaping_seconds", endpoint="chat", kind="stream"), 0.0), timed


def test_stream_time_estimate_is_exact_when_every_message_costs_the_same():
    for messages in range(80):
        assert _estimate([1000] * messages)[0] == pytest.approx(messages * 1e-6), messages


def test_stream_time_estimate_counts_the_dearer_first_message_once():
    for messages in (2, 10, 44, 308):
        costs = [5000] + [1000] * (messages - 1)
        assert _estimate(costs)[0] == pytest.approx(sum(costs) / 1e9), messages


def test_stream_time_estimate_times_few_messages():
    _, timed = _estimate([1000] * 400)
    stride = metrics.STRIDE
    assert timed[:4] == [1, 2, 2 + stride, 2 + 2 * stride] and len(timed) == 2 + 398 // stride


def _exposed(scraped: bytes) -> dict[str, float]:
    """The `vllm_nvext:*_total` lines of a /metrics answer (the text exposition), by name and labels."""
    out = {}
    for line in scraped.decode().splitlines():
        if line.startswith(metrics.PREFIX) and "_total{" in line:
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@pytest.mark.parametrize("pure_python", [False, True], ids=["compiled send", "python send"])
@pytest.mark.parametrize("name", ["chat_stream_ids_long", "vllm-0.33/completions_stream_ids"])
async def test_a_finished_streams_counters_are_what_a_metrics_scrape_reads(name, pure_python):
    """What a user scraping /metrics (prometheus_client's exposition of the registry vLLM serves) reads once a
    stream is over: its events ([DONE] included), the time spent on them, none forwarded unchanged; whichever send
    served its deltas."""
    from prometheus_client import make_asgi_app

    exposition = make_asgi_app()
    rec = recording(name)
    app, _ = _app(rec, pure_python=pure_python)

    async def exposed() -> dict[str, float]:
        return _exposed((await call(exposition, "/metrics", b"", method="GET", headers=())).body)

    before = await exposed()
    result = await call(app, rec.path, _body(rec, "nvext"))
    assert b'"nvext"' in result.body
    after = await exposed()
    got = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    labels = f'{{endpoint="{_endpoint(rec)}",kind="stream"}}'
    events, seconds = (
        got.pop("vllm_nvext:reshaped_events_total" + labels),
        got.pop("vllm_nvext:reshaping_seconds_total" + labels),
    )
    assert events == _count_events(rec.body) == _count_events(result.body)
    assert 0 < seconds < 1.0
    assert list(got) == [
        f'vllm_nvext:requests_total{{dialect="nvext",endpoint="{_endpoint(rec)}",kind="stream",placement="auto"}}'
    ], "nothing forwarded unchanged, no other counter"


# --- responses forwarded unchanged ---------------------------------------------------------


async def test_a_unary_body_that_cannot_be_reshaped_is_forwarded_and_counted(monkeypatch, caplog):
    def broken(*_args, **_kwargs):
        raise RuntimeError("reshaping bug")

    monkeypatch.setattr("vllm_nvext.send.reshape_unary_body", broken)
    rec = recording("chat_unary_ids")
    app, _ = _app(rec)
    before = scrape()
    result = await call(app, rec.path, _body(rec, "nvext"))
    assert result.body == rec.body, "the client gets vLLM's answer as it was"
    assert "forwarded unchanged" in caplog.text
    got = delta(before)
    assert got[sample("forwarded_unchanged", endpoint="chat", kind="unary")] == 1


async def test_stream_events_that_cannot_be_reshaped_are_forwarded_and_counted(monkeypatch):
    def broken(self, obj):
        raise RuntimeError("reshaping bug")

    monkeypatch.setattr(nvresponse.ChunkReshaper, "reshape", broken)
    for shortcut in ("first_chunk", "reshape_single", "finish_chunk"):  # the single-choice shortcuts (finish.py)
        monkeypatch.setattr(stream_module, shortcut, lambda *args: broken(None, None))
    rec = recording("completions_stream_ids")
    app, _ = _app(rec)
    before = scrape()
    result = await call(app, rec.path, _body(rec, "nvext"))
    assert result.body == rec.body
    got = delta(before)
    json_events = len(rec.events())  # every JSON event fails; [DONE] is not reshaped
    assert got[sample("forwarded_unchanged", endpoint="completions", kind="stream")] == json_events
    assert got[sample("reshaped_events", endpoint="completions", kind="stream")] == _count_events(rec.body)


# --- refusals ------------------------------------------------------------------------------


SECRET = "private-prompt-text-42"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"nvext": {SECRET: 1}}, "nvext.<unknown>"),
        ({"nvext": {"router": {SECRET: 1}}}, "nvext.router.<unknown>"),
        ({"nvext": {"extra_fields": SECRET}}, "nvext.extra_fields"),
        ({"nvext": SECRET}, "nvext"),
        ({"return_token_ids": SECRET}, "return_token_ids"),
        ({"nvext": NVEXT_IDS, "n": 2}, "n"),
    ],
)
async def test_refusals_are_counted_by_the_field_named_never_by_client_text(extra, param):
    rec = recording("completions_unary_ids")
    app, upstream = _app(rec)
    before = scrape()
    result = await call(app, rec.path, _body(rec, None, **extra))
    assert result.status == 400 and upstream.calls == 0
    assert delta(before) == {sample("refusals", param=param, status="400"): 1}
    assert SECRET not in generate_latest(REGISTRY).decode()


async def test_mode_header_and_size_refusals_are_counted():
    rec = recording("chat_unary_ids")
    app, _ = _app(rec, max_body_bytes=64)
    before = scrape()
    bad_header = ((b"content-type", b"application/json"), (b"x-nvext-mode", SECRET.encode()))
    assert (await call(app, rec.path, b'{"return_token_ids": true}', headers=bad_header)).status == 400
    assert (await call(app, rec.path, _body(rec, "nvext"))).status == 413
    assert delta(before) == {
        sample("refusals", param="x-nvext-mode", status="400"): 1,
        sample("refusals", param="body", status="413"): 1,
    }
    assert SECRET not in generate_latest(REGISTRY).decode()


def test_every_field_the_middleware_validates_is_its_own_refusal_label():
    known = [f"nvext.{k}" for k in NVEXT_FIELDS] + [f"nvext.{o}.{k}" for o, f in NVEXT_OBJECTS.items() for k in f]
    for param in [*known, "nvext", "return_token_ids", "n", "prompt", "x-nvext-mode"]:
        assert metrics.refusal_param(param) == param
    assert metrics.refusal_param(None) == "body"


def test_every_vllm_field_the_middleware_reads_is_its_own_refusal_label():
    read = {name for endpoint in (Endpoint.COMPLETIONS, Endpoint.CHAT) for name in replica_model(endpoint).model_fields}
    assert read == DECISION_FIELDS, "metrics labels a refusal by the fields the middleware reads"
    for name in read:
        assert metrics.refusal_param(name) == name


_LABELS = {
    "body",
    "other",
    "nvext.<unknown>",
    *(f"nvext.{o}.<unknown>" for o in NVEXT_OBJECTS),
    *metrics._TOP_LEVEL_PARAMS,
    *param_names(),
}


@given(st.text())
def test_a_refusal_label_is_always_from_a_fixed_set(key):
    assert metrics.refusal_param(f"nvext.{key}") in _LABELS
    assert metrics.refusal_param(f"nvext.router.{key}") in _LABELS
    assert metrics.refusal_param(key) in _LABELS


# --- without prometheus_client; several processes ------------------------------------------


def _python(script: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_without_prometheus_client_the_middleware_works_and_counts_nothing():
    proc = _python(
        """
        import asyncio, json, sys
        sys.modules["prometheus_client"] = None  # `import prometheus_client` now raises ImportError
        from tests.unit.asgi import Upstream, call
        from tests.recorded import recording
        from vllm_nvext import NvextMiddleware, metrics

        async def main():
            for name in ("chat_stream_ids", "completions_unary_ids"):
                rec = recording(name)
                app = NvextMiddleware(Upstream(content_type=rec.content_type, body=rec.body))
                body = dict(rec.request, nvext={"extra_fields": ["completion_token_ids"]})
                body.pop("return_token_ids")
                result = await call(app, rec.path, json.dumps(body).encode())
                assert result.status == 200 and b'"nvext":{"completion_token_ids"' in result.body, result.body
            bad = await call(app, rec.path, b'{"nvext": 3}')
            assert bad.status == 400
            plain = await call(app, rec.path, b'{"prompt": "x"}')
            assert plain.status == 200
            assert not metrics.enabled()
            print("ok")

        asyncio.run(main())
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_counters_of_several_processes_are_summed_in_multiprocess_mode(tmp_path):
    """What vLLM does with --api-server-count > 1: one directory, one collector for all."""
    count = """
        from vllm_nvext import metrics
        from vllm_nvext.config import Mode
        from vllm_nvext.protocol import Dialect, Endpoint
        for _ in range(3):
            metrics.count_request(Endpoint.CHAT, Dialect.NVEXT, Mode.AUTO, "stream")
        metrics.count_refusal("n", 400)
        metrics.count_reshaping(Endpoint.CHAT, "stream", 10, 0.25)
    """
    env = {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for _ in range(2):
        proc = _python(count, env)
        assert proc.returncode == 0, proc.stderr
    proc = _python(
        """
        from prometheus_client import CollectorRegistry, generate_latest, multiprocess
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        print(generate_latest(registry).decode())
        """,
        env,
    )
    assert proc.returncode == 0, proc.stderr
    lines = set(proc.stdout.splitlines())
    assert 'vllm_nvext:requests_total{dialect="nvext",endpoint="chat",kind="stream",placement="auto"} 6.0' in lines
    assert 'vllm_nvext:refusals_total{param="n",status="400"} 2.0' in lines
    assert 'vllm_nvext:reshaped_events_total{endpoint="chat",kind="stream"} 20.0' in lines
    assert 'vllm_nvext:reshaping_seconds_total{endpoint="chat",kind="stream"} 0.5' in lines


# --- one rule for the `endpoint` label: the route the client called --------------------------


@pytest.mark.parametrize("name", ["chat_stream_ids", "completions_unary_ids"])
async def test_invocations_is_labelled_by_its_route_on_every_counter(name):
    rec = recording(name)
    app, _ = _app(rec)
    before = scrape()
    result = await call(app, "/invocations", _body(rec, "nvext"))
    assert b'"nvext"' in result.body, "served as the body's route and reshaped"
    got = delta(before)
    assert got[request_sample("invocations", "nvext", "auto", _kind(rec))] == 1
    assert got[sample("reshaped_events", endpoint="invocations", kind=_kind(rec))] >= 1
    assert {dict(labels)["endpoint"] for _, labels in got} == {"invocations"}, "never chat or completions"


def test_the_short_increment_adds_what_prometheus_clients_own_adds():
    """`metrics._adder` (the counter's value's own `inc`, past prometheus_client's per-call checks)
    leaves the same exposition as `child.inc`, and any other child keeps its own `inc`."""
    from prometheus_client import CollectorRegistry, Counter

    metrics._counters()  # prometheus_client imported: the short path known
    exposed = []
    for short in (False, True):
        registry = CollectorRegistry()
        counter = Counter("nvext_test_adds", "test", ["kind"], registry=registry)
        child = counter.labels("stream")
        add = metrics._adder(child) if short else child.inc
        for amount in (1, 3, 0.25):
            add(amount)
        exposed.append([line for line in generate_latest(registry).splitlines() if b"_created" not in line])
    assert exposed[0] == exposed[1]  # but the creation time
    assert b'nvext_test_adds_total{kind="stream"} 4.25' in exposed[0]
    assert metrics._adder(counter.labels("stream")) is not counter.labels("stream").inc, "the short path is taken"

    class Other:
        def inc(self, amount: float = 1) -> None:
            pass

    other = Other()
    assert metrics._adder(other) == other.inc


def test_a_negative_count_is_never_added():
    """A counter only grows: an end-of-response count below zero adds nothing (prometheus_client's
    own check raised there)."""
    before = scrape()
    metrics.count_reshaping(Endpoint.CHAT, metrics.STREAM, -1, -0.5, -2)
    assert delta(before) == {}

"""End to end: the middleware's counters on vLLM's own /metrics, after a known mix of requests.

Each test scrapes `/metrics` before and after its requests and checks the difference (other
tests may use the same servers): both mounts (`--middleware` and the endpoint plugin), and
`--api-server-count 2`, where each scrape is answered by one of the two API-server processes
and must still show what both counted.
"""

from __future__ import annotations

import collections
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import API_KEY, CHAT, COMPLETIONS, DIALECTS, greedy, nvext_placed

pytestmark = pytest.mark.e2e

PREFIX = "vllm_nvext:"
METRICS = ("requests", "refusals", "forwarded_unchanged", "reshaped_events", "reshaping_seconds")
SECRET = "metrics-e2e-private-text"  # a client string that must never become a label value
ENDPOINT = {CHAT: "chat", COMPLETIONS: "completions"}
INVOCATIONS = "/invocations"
Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape(url: str) -> tuple[dict[Sample, float], str]:
    """The `vllm_nvext:*_total` samples of one scrape (on a connection of its own), and its text."""
    text = httpx.get(url + "/metrics", headers={"Connection": "close"}, timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(PREFIX) and s.name.endswith("_total"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out, text


def delta(before: dict[Sample, float], after: dict[Sample, float]) -> dict[Sample, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def key(name: str, **labels: str) -> Sample:
    return (PREFIX + name + "_total", tuple(sorted(labels.items())))


@dataclass
class Expected:
    """What the counters must have gained from the requests `send_mix` sent."""

    counts: collections.Counter[Sample] = field(default_factory=collections.Counter)
    timed: set[Sample] = field(default_factory=set)  # reshaping_seconds samples that must have grown

    def check(self, got: dict[Sample, float]) -> None:
        seconds = {k: v for k, v in got.items() if k[0] == PREFIX + "reshaping_seconds_total"}
        counts = {k: v for k, v in got.items() if k not in seconds}
        assert counts == dict(self.counts), _diff(counts, self.counts)
        assert set(seconds) == self.timed and all(v > 0 for v in seconds.values()), seconds


def _diff(got: dict[Sample, float], want: collections.Counter[Sample]) -> str:
    wrong = [f"  {k}: got {got.get(k, 0)}, sent {want.get(k, 0)}" for k in sorted(set(got) | set(want))
             if got.get(k, 0) != want.get(k, 0)]  # fmt: skip
    return "counters differ from the requests sent:\n" + "\n".join(wrong)


# (path, dialect or None, stream, x-nvext-mode header or None): every dialect, both kinds,
# the configured mode (auto) and the header's; some of them reshaped, some not.
MIX = [
    (path, dialect, stream, header)
    for path in (CHAT, COMPLETIONS)
    for dialect, stream, header in [
        (None, False, None),
        (None, True, None),
        ("vllm", False, None),  # vLLM's own placement: nothing to reshape
        ("vllm", True, "both"),
        ("nvext", True, None),
        ("nvext", False, "vllm"),  # vLLM placement: nothing to reshape
        ("both", False, None),
        ("both", True, "nvext"),
    ]
]
REFUSALS: list[tuple[str, dict[str, Any], dict[str, str], str]] = [
    # (path, body fields, headers, param label)
    (CHAT, {"nvext": {SECRET: 1}}, {}, "nvext.<unknown>"),
    (CHAT, {"nvext": {"extra_fields": [SECRET], "router": {SECRET: True}}}, {}, "nvext.router.<unknown>"),
    (COMPLETIONS, {**DIALECTS["nvext"], "n": 2}, {}, "n"),
    (COMPLETIONS, DIALECTS["vllm"], {"x-nvext-mode": SECRET}, "x-nvext-mode"),
]


def send_mix(client: httpx.Client) -> Expected:
    """Send MIX and REFUSALS; the counters each must move."""
    want = Expected()
    for path, dialect, stream, header in MIX:
        body = greedy(
            path, max_tokens=5, **(DIALECTS[dialect] if dialect else {}), **({"stream": True} if stream else {})
        )
        resp = client.post(path, json=body, headers={"x-nvext-mode": header} if header else {})
        assert resp.status_code == 200, resp.text
        endpoint = ENDPOINT[path]
        placement = header or "auto"
        if dialect is None:
            want.counts[key("requests", endpoint=endpoint, dialect="none", placement=placement, kind="unknown")] += 1
            continue
        kind = "stream" if stream else "unary"
        want.counts[key("requests", endpoint=endpoint, dialect=dialect, placement=placement, kind=kind)] += 1
        if nvext_placed(placement, dialect):
            events = resp.content.count(b"\n\n") if stream else 1  # SSE events, [DONE] included
            assert events > 2 or not stream
            want.counts[key("reshaped_events", endpoint=endpoint, kind=kind)] += events
            want.timed.add(key("reshaping_seconds", endpoint=endpoint, kind=kind))
    # /invocations is labelled by its route on every counter, whichever route serves the body.
    for served_as, stream in ((CHAT, True), (COMPLETIONS, False)):
        body = greedy(served_as, max_tokens=5, **DIALECTS["nvext"], **({"stream": True} if stream else {}))
        resp = client.post(INVOCATIONS, json=body)
        assert resp.status_code == 200 and b'"nvext"' in resp.content, resp.text
        kind = "stream" if stream else "unary"
        want.counts[key("requests", endpoint="invocations", dialect="nvext", placement="auto", kind=kind)] += 1
        want.counts[key("reshaped_events", endpoint="invocations", kind=kind)] += (
            resp.content.count(b"\n\n") if stream else 1
        )
        want.timed.add(key("reshaping_seconds", endpoint="invocations", kind=kind))
    for path, fields, headers, param in REFUSALS:
        resp = client.post(path, json=greedy(path, **fields), headers=headers)
        assert resp.status_code == 400, resp.text
        want.counts[key("refusals", param=param, status="400")] += 1
    return want


def _client(url: str, *, fresh_connections: bool) -> httpx.Client:
    limits = httpx.Limits(max_keepalive_connections=0) if fresh_connections else httpx.Limits()
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120.0, limits=limits)


@pytest.mark.parametrize("mount", ["mw", "plugin"])
def test_counters_on_vllms_metrics_follow_a_known_mix_of_requests(mount, mw_server, plugin_server):
    url = (mw_server if mount == "mw" else plugin_server).url
    before, _ = scrape(url)
    with _client(url, fresh_connections=False) as client:
        want = send_mix(client)
    after, text = scrape(url)
    want.check(delta(before, after))
    for name in METRICS:  # every counter is registered on vLLM's /metrics, the unused one too
        assert f"# TYPE {PREFIX}{name} counter" in text or f"# TYPE {PREFIX}{name}_total counter" in text, name
    assert "vllm:num_requests_running" in text, "vLLM's own metrics are still there"
    assert SECRET not in text


def test_two_api_server_processes_report_the_sum_of_what_both_counted(scale_server):
    url = scale_server.url
    files_before = _per_process_requests(scale_server)
    before, _ = scrape(url)
    want = Expected()
    with _client(url, fresh_connections=True) as client:  # a new connection per request: both processes serve
        # Which process accepts a connection is the kernel's choice: send mixes until both have
        # counted some (bounded), so the sum below really adds two processes' counts.
        for rounds in range(1, 21):
            sent = send_mix(client)
            want.counts.update(sent.counts)
            want.timed |= sent.timed
            now = _per_process_requests(scale_server)
            if now is None or (rounds >= 3 and sum(n > (files_before or {}).get(p, 0) for p, n in now.items()) >= 2):
                break
    for _ in range(6):  # each scrape is answered by either process: every one must show the total
        after, text = scrape(url)
        want.check(delta(before, after))
        assert SECRET not in text
    files_after = _per_process_requests(scale_server)
    if files_after is not None and files_before is not None:  # None: a server run elsewhere (no local files)
        gained = {pid: n - files_before.get(pid, 0) for pid, n in files_after.items()}
        sent_requests = sum(v for k, v in want.counts.items() if k[0] == PREFIX + "requests_total")
        assert sum(gained.values()) == sent_requests
        assert sum(1 for n in gained.values() if n > 0) == 2, f"requests counted per API-server process: {gained}"


def test_a_proxy_in_front_of_a_mounted_server_names_each_family_once(mw_server):
    """`vllm-nvext proxy` in front of a vLLM that mounts vllm-nvext (`--middleware`): both count `vllm_nvext:*`;
    the proxy's `/metrics` is the upstream's families then its own others, each `# TYPE` / `# HELP` name once, as
    Prometheus reads a scrape (a name twice refuses it whole)."""
    from tests.support.servers import listen_port
    from vllm_nvext.tools.server import ProxyServer

    with ProxyServer(
        upstream=mw_server.url, args=["--api-key", API_KEY], name="proxy-mounted", port=listen_port()
    ) as proxy:
        proxy.wait_ready()
        with _client(proxy.url, fresh_connections=False) as client:
            got = client.post(CHAT, json={**greedy(CHAT), **DIALECTS["nvext"]})
            assert got.status_code == 200, got.text
        text = httpx.get(proxy.url + "/metrics", timeout=30).text
    assert "vllm:num_requests_running" in text and "# TYPE vllm_nvext:requests_total counter" in text
    for kind in ("TYPE", "HELP"):
        names = re.findall(rf"^# {kind} (\S+)", text, re.MULTILINE)
        assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


# --- the per-process files of prometheus_client's multiprocess mode ---------------------------


def _per_process_requests(server: Any) -> dict[str, float] | None:
    """`vllm_nvext:requests_total` summed per API-server process file, or None when not visible."""
    proc = getattr(server, "proc", None)
    if proc is None:
        return None
    directory = _multiproc_dir(proc.pid)
    assert directory is not None, "no API-server process of this server has PROMETHEUS_MULTIPROC_DIR set"
    from prometheus_client.mmap_dict import MmapedDict

    out: dict[str, float] = {}
    for path in sorted(Path(directory).glob("counter_*.db")):
        total = 0.0
        for raw, value, _ts, _pos in MmapedDict.read_all_values_from_file(str(path)):
            if json.loads(raw)[1] == PREFIX + "requests_total":
                total += value
        out[path.stem] = total
    return out


def _multiproc_dir(root: int) -> str | None:
    for pid in _descendants(root):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"PROMETHEUS_MULTIPROC_DIR="):
                return entry.split(b"=", 1)[1].decode()
    return None


def _descendants(root: int) -> Iterator[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rpartition(")")[2].split()[1])
            children[ppid].append(int(entry))
    stack = list(children[root])
    while stack:
        pid = stack.pop()
        yield pid
        stack.extend(children[pid])

"""Prometheus counters for what the middleware does, served on vLLM's own `/metrics`.

The counters go to prometheus_client's default registry, which vLLM's `/metrics` serves; with
`--api-server-count > 1` vLLM sets `PROMETHEUS_MULTIPROC_DIR` before it spawns the API-server
processes, so each process's counters are files that vLLM's multiprocess collector sums. They
are created on first use, once per process (after that set-up). Without prometheus_client
every function here does nothing.

Every label value comes from a fixed set (endpoints, dialects, modes, a known `param` name):
no prompt, id or other client-supplied string ever becomes one. Pure: nothing here knows ASGI.
"""

from __future__ import annotations

import logging
import sys
import threading
from functools import partial
from typing import Any

from . import _vllm_compat
from .config import MODE_HEADER
from .inbound.client_params import REQUEST_ID_HEADER
from .inbound.fields import DECISION_FIELDS
from .inbound.nvext_schema import param_names
from .protocol import Dialect

PREFIX = "vllm_nvext:"

STREAM, UNARY, UNKNOWN = "stream", "unary", "unknown"
# Refusals without a field to name: the body-size cap.
BODY = "body"

# The `param` of a refusal names a request field the middleware knows (those it reads, and a request
# id a kv connector would join into a file path: docs/hidden-states.md); a key the client made up is
# reported as `<unknown>` under the object it was found in, never by its name.
_TOP_LEVEL_PARAMS = frozenset({"nvext", MODE_HEADER, *DECISION_FIELDS, REQUEST_ID_HEADER, "request_id"})
_NVEXT_PARAMS = param_names()
UNKNOWN_KEY = "<unknown>"
OTHER = "other"

# A stream's reshaping time is sampled: its first two body messages and one in STRIDE after
# that are timed, each standing for the messages up to the next sample (see StreamTally).
STRIDE = 32

_lock = threading.Lock()
_state: _Counters | None = None
_disabled = False


class _Noop:
    """Stands in for a counter child when prometheus_client is absent."""

    __slots__ = ()

    def inc(self, amount: float = 1) -> None:
        return None


_NOOP = _Noop()


class _One:
    """A counter child's `inc()` by one, through `_adder`."""

    __slots__ = ("inc",)

    def __init__(self, add: Any) -> None:
        self.inc = partial(add, 1)


def _adder(child: Any) -> Any:
    """`child.inc(amount)` for a non-negative amount, entering one function of prometheus_client's
    instead of four: a plain Counter's child (its labels set, no exemplar) checks only what is always
    so here, then adds to its value (`MutexValue`, or the multiprocess file's value), which is what
    this returns. Any other child (another prometheus_client, `_NOOP`): its own `inc`."""
    add = getattr(getattr(child, "_value", None), "inc", None)
    if _COUNTER_INC is not None and getattr(type(child), "inc", None) is _COUNTER_INC and callable(add):
        return add
    return child.inc


_COUNTER_INC: Any = None  # prometheus_client.Counter.inc, once imported


class _Counters:
    __slots__ = ("requests", "refusals", "unchanged", "events", "seconds")

    def __init__(self, counter: Any) -> None:
        self.requests = counter(
            PREFIX + "requests",
            "Requests to the token endpoints handed to vLLM, by endpoint, dialect asked "
            "(none: opted into nothing, never parsed), placement served (the mode after the "
            "x-nvext-mode header) and kind (stream, unary; unknown when never parsed).",
            ["endpoint", "dialect", "placement", "kind"],
        )
        self.refusals = counter(
            PREFIX + "refusals",
            "Requests the middleware refused itself, by the request field named in the error (param) and HTTP status.",
            ["param", "status"],
        )
        self.unchanged = counter(
            PREFIX + "forwarded_unchanged",
            "Unary bodies or stream events forwarded as vLLM sent them because reshaping them failed.",
            ["endpoint", "kind"],
        )
        self.events = counter(
            PREFIX + "reshaped_events",
            "Response events that went through the reshaper: SSE events of a stream, whole unary bodies.",
            ["endpoint", "kind"],
        )
        self.seconds = counter(
            PREFIX + "reshaping_seconds",
            "Time spent reshaping those events (streams: estimated from timing the first two body "
            "messages and one in 32 after them).",
            ["endpoint", "kind"],
        )


def _counters() -> _Counters | None:
    global _state, _disabled
    if _state is not None or _disabled:
        return _state
    with _lock:
        if _state is None and not _disabled:
            try:
                from prometheus_client import Counter
            except ImportError:
                _disabled = True
                return None
            global _COUNTER_INC
            _COUNTER_INC = getattr(Counter, "inc", None)
            _state = _Counters(Counter)
    return _state


_stream_path: str | None = None


def set_stream_path(impl: str) -> None:
    """`vllm_nvext_stream_path_info{impl="c"|"python"}`: which stream path runs (the last middleware built says)."""
    global _stream_path
    if impl == _stream_path or _counters() is None:
        return
    with _lock:
        from prometheus_client import Gauge

        gauge = _info_gauge(Gauge)
        if _stream_path is not None:
            gauge.labels(impl=_stream_path).set(0)
        gauge.labels(impl=impl).set(1)
        _stream_path = impl


_gauges: dict[str, Any] = {}


def _info_gauge(gauge: Any) -> Any:
    if "stream_path" not in _gauges:
        _gauges["stream_path"] = gauge(
            PREFIX + "stream_path_info",
            "The stream path that runs: 1 for the compiled one (impl=c) or the pure-Python one (impl=python).",
            ["impl"],
            multiprocess_mode="max",  # several API-server processes run the same path
        )
    return _gauges["stream_path"]


UNTESTED_VLLM = (
    "vllm-nvext: vLLM %s is outside the releases vllm-nvext is tested on (%s to %s): it runs, but this release's "
    "wire format and the rules copied from vLLM were not checked on it (docs/supported-vllm.md)"
)
_reported_version: list[str] = []


def report_vllm_version() -> None:
    """Once per process: `vllm_nvext:vllm_version_tested{version}` (1: in the tested range, 0: not), and a
    warning at start-up for a vLLM outside it (never a refusal). Nothing without vLLM installed."""
    version = _vllm_compat.vllm_version()
    if version is None or _reported_version:
        return
    _reported_version.append(version)
    tested = _vllm_compat.version_tested(version) is True
    if not tested:
        low, high = (".".join(map(str, release)) for release in _vllm_compat.TESTED_RANGE)
        logging.getLogger("vllm_nvext").warning(UNTESTED_VLLM, version, low, high)
        if "vllm.logger" in sys.modules:  # vLLM's server prints only its own `vllm` loggers: say it there too
            logging.getLogger("vllm.nvext").warning(UNTESTED_VLLM, version, low, high)
    if _counters() is None:
        return
    with _lock:
        from prometheus_client import Gauge

        if "vllm_version" not in _gauges:
            _gauges["vllm_version"] = Gauge(
                PREFIX + "vllm_version_tested",
                "The installed vLLM release (label version): 1 if vllm-nvext was tested on it, 0 if not "
                "(a warning at start-up says so; docs/supported-vllm.md).",
                ["version"],
                multiprocess_mode="max",  # every API-server process runs the same vLLM
            )
        _gauges["vllm_version"].labels(version=version).set(1 if tested else 0)


def enabled() -> bool:
    """Whether counting is on: prometheus_client is importable in this process."""
    return _counters() is not None


def _label(value: Any) -> str:
    return str(getattr(value, "value", value))  # an Endpoint, Dialect or Mode member, or a plain string


class _RequestCounters(dict[tuple[Any, Any, Any, str], Any]):
    """The `requests` counter's children by (endpoint, dialect, placement, kind), each resolved on
    first use (after vLLM's multiprocess set-up); after that a lookup is a plain dict hit."""

    __slots__ = ()

    def __missing__(self, key: tuple[Any, Any, Any, str]) -> Any:
        state = _counters()
        child = _NOOP if state is None else _One(_adder(state.requests.labels(*map(_label, key))))
        self[key] = child
        return child


# `REQUESTS[endpoint, dialect, placement, kind].inc()` counts one request handed to vLLM: the same
# as `count_request`, without entering it (every request to a token route counts one).
REQUESTS = _RequestCounters()


def count_request(endpoint: Any, dialect: Dialect, placement: Any, kind: str) -> None:
    """One request handed to vLLM. `endpoint` and `placement` are Endpoint and Mode members."""
    REQUESTS[endpoint, dialect, placement, kind].inc()


def refusal_param(param: str | None) -> str:
    """The label value for a refusal's `param`: a field the middleware knows, never a client's key."""
    if param is None:
        return BODY
    if param in _TOP_LEVEL_PARAMS or param in _NVEXT_PARAMS:
        return param
    where = param.rpartition(".")[0]
    if where == "nvext" or where in _NVEXT_PARAMS:
        return f"{where}.{UNKNOWN_KEY}"
    return OTHER


def count_refusal(param: str | None, status: int) -> None:
    """One request the middleware answered with an error of its own."""
    state = _counters()
    if state is not None:
        state.refusals.labels(refusal_param(param), str(status)).inc()


_reshaping: dict[tuple[Any, str], tuple[Any, ...]] = {}  # the three counters' adders by (endpoint, kind)


def _reshaping_adders(endpoint: Any, kind: str) -> tuple[Any, ...]:
    """The adders of the events, seconds and unchanged counters for (endpoint, kind), made on first use."""
    children = _reshaping.get((endpoint, kind))
    if children is None:
        state = _counters()
        if state is None:
            children = (_NOOP.inc, _NOOP.inc, _NOOP.inc)
        else:
            labels = (_label(endpoint), kind)
            children = tuple(_adder(c.labels(*labels)) for c in (state.events, state.seconds, state.unchanged))
        _reshaping[(endpoint, kind)] = children
    return children


def count_reshaping(endpoint: Any, kind: str, events: int, seconds: float, unchanged: int = 0) -> None:
    """One response's reshaping, added once when the response is over (a stream's: `StreamTally.count`)."""
    children = _reshaping.get((endpoint, kind)) or _reshaping_adders(endpoint, kind)
    if events > 0:
        children[0](events)
    if seconds > 0:
        children[1](seconds)
    if unchanged > 0:
        children[2](unchanged)


class StreamTally:
    """A stream's body messages and its estimated reshaping time, from timing a sample of them.

    The caller counts down body messages from `FIRST`, times the message on which the countdown
    reaches zero, and restarts the countdown from what `add` returns: the first two messages
    are timed, then one in STRIDE. The first (always decoded, dearer than the deltas) stands
    for itself; every other timed message for itself and the untimed ones after it. So an
    untimed message costs the caller one decrement and one test, and nothing else per message.
    """

    FIRST = 1

    __slots__ = ("_ns", "_last_ns", "_samples", "_last_index")

    def __init__(self) -> None:
        self._ns = 0
        self._last_ns = 0
        self._samples = 0
        self._last_index = 0  # the number of the last timed message

    def add(self, ns: int) -> int:
        """A timed message took `ns`; returns the countdown to the next timed one."""
        self._samples += 1
        if self._samples == 1:
            self._ns += ns
            self._last_index = 1
            return 1
        self._ns += self._last_ns * STRIDE  # the previous sample stood for a whole stride
        self._last_ns = ns
        self._last_index += 1 if self._samples == 2 else STRIDE
        return STRIDE

    def count(self, endpoint: Any, left: int, beside: int, unchanged: int) -> None:
        """The stream is over, with `left` the countdown then: its events (the body messages seen, plus `beside`:
        the events framed beyond one per message, less the messages framed), its estimated time and the events
        forwarded unchanged, added to the counters in one call (`count_reshaping`'s, inlined)."""
        samples = self._samples
        events = beside + (self._last_index + (1 if samples == 1 else STRIDE) - left if samples else 0)
        seconds = (self._ns + self._last_ns * (1 + STRIDE - left)) / 1e9
        children = _reshaping.get((endpoint, STREAM)) or _reshaping_adders(endpoint, STREAM)
        if events > 0:
            children[0](events)
        if seconds > 0:
            children[1](seconds)
        if unchanged > 0:
            children[2](unchanged)


class CaptureCounts:
    """What the capture sink reports (`capture.store.Counts`): turns recorded, turns dropped by reason
    (`queue_full`, `store_full`, `store_error`), and the bytes the store holds (docs/capture.md)."""

    __slots__ = ("_families",)

    def __init__(self) -> None:
        self._families: tuple[Any, Any, Any] | None = None

    def _get(self) -> tuple[Any, Any, Any] | None:
        if self._families is None and _counters() is not None:
            with _lock:
                if self._families is None:
                    from prometheus_client import Counter, Gauge

                    self._families = (
                        Counter(PREFIX + "capture_turns_recorded", "Turns the capture store recorded."),
                        Counter(
                            PREFIX + "capture_turns_dropped",
                            "Turns the capture dropped, by reason: queue_full (the writer fell behind), "
                            "store_full (the size cap), store_error (the store failed), invalid_turn, shutdown, "
                            "not_on_this_mount (/v1/messages without the plugin mount).",
                            ["reason"],
                        ),
                        Gauge(
                            PREFIX + "capture_store_bytes",
                            "Bytes the capture store holds (SQLite: its used pages; Redis: the server's used_memory).",
                            multiprocess_mode="max",  # every process sees the same store
                        ),
                    )
        return self._families

    def recorded(self, n: int) -> None:
        families = self._get()
        if families is not None:
            families[0].inc(n)

    def dropped(self, reason: str, n: int) -> None:
        families = self._get()
        if families is not None:
            families[1].labels(reason).inc(n)

    def store_bytes(self, n: int) -> None:
        families = self._get()
        if families is not None:
            families[2].set(n)


CAPTURE = CaptureCounts()

"""Pure stream side, bytes in and bytes out: one vLLM SSE response reshaped as a Plan says.

`StreamReshaper` owns the SSE framer and every hot-path shortcut. The general path frames the
bytes into events, decodes each `data:` payload, lets `chunks.ChunkReshaper` reshape the
chunk and encodes it again; each shortcut below names the test that proves it gives the same
bytes as that path. A mid-stream delta is read and served at the byte level by `delta`, the
first and finish chunks by `finish`. `splice.Splice`, the cheapest, is also what the `send` handed to vLLM serves
deltas with (`kernels.python_stream_send`, csrc/stream_send.c). Nothing here knows ASGI.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from .. import _json
from ..inbound.plan import Plan
from .chunks import ChunkReshaper
from .delta import chunk_root, delta_bytes, ids_between, scanned_root, tail_match
from .finish import Scanner, finish_chunk, finishes, first_chunk, reshape_single, serves
from .nvext_values import Clock
from .plain import plain_chunk
from .splice import FinishArm, Learner, Splice, SpliceArm, learn_splice
from .sse import EventFramer, data_payload

logger = logging.getLogger("vllm_nvext")

# The shape vLLM writes each event in: `data: ` + one JSON object + a blank line.
_DATA = b"data: "
_JSON_AT = len(_DATA)  # where the chunk's JSON object starts
_EVENT_END = b"\n\n"
_LIST = ord("[")
_NOT_JSON = object()
_FINISH_KEY = b'"finish_reason":'  # vllm-rs writes none on a delta


class StreamKernels(Protocol):
    """The kernels a stream runs (`kernels.Kernels`, compiled or Python): the splice learner and the plain
    chunk scanner (taken where `scans_plain`: else every such chunk is decoded)."""

    @property
    def learn_splice(self) -> Learner: ...
    @property
    def plain_chunk(self) -> Scanner: ...
    @property
    def scans_plain(self) -> bool: ...


# A record (a NamedTuple) from all its fields in order, without its generated Python `__new__`: an arm of a short
# stream costs ~0.1 µs for its two records instead of ~0.9 (a stream arms once or twice).
_record = tuple.__new__

# How many times a stream learns a splice (its first delta, then after a layout change).
ARMINGS = 3


def _is_plain_data_event(event: bytes) -> bool:
    """`data: ...` on one LF-ended line and a blank line: the shape vLLM writes."""
    return (
        event[-1:] == b"\n"
        and event.find(b"\n") == len(event) - 2
        and event.find(b"\r") < 0
        and event.startswith(_DATA)
    )


class StreamReshaper:
    """One streamed response: `feed` each body message's bytes, `flush` at the end of the stream.

    What comes out is what the client gets; an event that cannot be reshaped goes out as vLLM
    sent it, and at most one partial event is held back.
    """

    __slots__ = ("chunks", "_framer", "_fast", "_strip", "_trio", "root", "splice", "_armings", "_head", "_tail",
                 "_held", "_waiting", "framed", "framed_events", "unchanged", "_renames", "_finishes",
                 "_scan", "_learn", "_finish_head", "_arm_scan")  # fmt: skip

    def __init__(self, plan: Plan, clock: Clock, kernels: StreamKernels | None = None) -> None:
        self.chunks = ChunkReshaper(plan, clock)
        self._finishes = finishes = serves(plan)  # single-choice shortcuts for the trio (finish.py)
        # The kernels (None: the Python twins): a plain chunk's scanner skips its decode (finish.first_chunk),
        # the learner learns and checks the splice a delta teaches.
        self._scan = kernels.plain_chunk if kernels is not None and kernels.scans_plain and finishes else None
        self._learn = learn_splice if kernels is None else kernels.learn_splice
        # What reads a chunk the splice is armed from where nothing else can (vllm-rs writes no finish reason on a
        # delta: no byte-level tier matches it) and its root from the first chunk: the scanner, or its Python twin
        # (a decode, once or twice a stream); None: the plan's chunks are not served so (`serves`).
        self._arm_scan = (self._scan or plain_chunk) if finishes else None
        self._framer: EventFramer | None = None  # made for the first message that is not one whole event
        self._strip = plan.strip_vllm_ids  # plan flags the per-event path reads, as plain slots
        self._trio = plan.nvext_trio
        self._renames = bool(plan.error_params)  # the general path may rename an error in a chunk
        self._fast = False  # the byte-level path serves deltas once the first chunk was decoded
        # The bytes up to `"choices":[` of the chunk that armed the byte-level path: vLLM writes the
        # same root keys before `choices` on every chunk of a stream, and a delta must repeat them.
        self.root = b""
        self.splice: Splice | None = None  # serves mid-stream deltas once armed (see Splice)
        self._finish_head: bytes | None = None  # the splice's finish_head when it may serve finish chunks
        self._armings = ARMINGS
        self._head = b""  # the bytes from finish_reason to the ids, and after them, of the last delta matched
        self._tail = b""
        self._held = False  # the framer holds a partial event (the `buffered` property, as a plain slot)
        # A finish chunk waiting for the usage chunk (plan.finish_waits_for_usage): the bytes before its JSON,
        # the decoded chunk, the bytes after. It goes out with the next event, whatever that is.
        self._waiting: tuple[bytes, Any, bytes] | None = None
        # For the metrics: messages and events that went through the framer (every other message
        # is one event), and events forwarded unchanged after a failure.
        self.framed = 0
        self.framed_events = 0
        self.unchanged = 0

    @property
    def buffered(self) -> int:
        """Bytes held back: at most one partial event."""
        return 0 if self._framer is None else self._framer.buffered

    def feed(self, body: bytes) -> bytes:
        """The bytes the client gets for one body message of vLLM's stream (held-back bytes excepted)."""
        if (
            body.endswith(b"\n\n")
            and body.find(b"\n") == len(body) - 2
            and body.find(b"\r") < 0
            and body.startswith(b"data: ")
            and not self._held
        ):
            # Shortcut: vLLM's usual message is exactly one event, so framing is skipped
            # (_is_plain_data_event inlined, with _DATA and _EVENT_END as literals: no global lookups).
            # Same bytes as framing it:
            # tests/unit/test_stream.py::test_feeding_whole_events_equals_feeding_split_bytes.
            try:
                new = self.reshape_event(body)
                return body if new is None else new
            except Exception:
                logger.exception("vllm-nvext could not reshape a stream event; forwarded unchanged")
                self.unchanged += 1
                return body
        self.framed += 1
        if not body and not self._held:
            return b""  # the stream's closing empty message, usually: what framing it gives
        framer = self._framer
        if framer is None:
            framer = self._framer = EventFramer()
        events = framer.feed(body)
        self._held = framer.buffered > 0
        if not events:
            return b""
        self.framed_events += len(events)
        return b"".join([self._reshape_framed(event) for event in events])

    def flush(self) -> bytes:
        """Whatever is held back at the end of the stream (an unterminated tail), as it came."""
        framer = self._framer
        tail = framer.flush() if self._held and framer is not None else b""  # nothing held: the framer holds nothing
        self._held = False
        return tail if self._waiting is None else self._release() + tail

    def _unchanged_usage_chunk(self, event: bytes) -> bool:
        """Shortcut: a chunk whose only `choices` is empty (the usage chunk) goes out as vLLM wrote
        it: the general path changes only errors in it, and only with error_params. Same bytes as
        decoding: tests/unit/test_stream_layouts.py and test_stream_send.py."""
        root = self.root
        return (
            event[len(root) : len(root) + 1] == b"]"
            and not self._renames
            and event.startswith(root)
            and event.find(b'"choices":', len(root)) < 0
        )

    def reshape_event(self, event: bytes) -> bytes | None:
        """The new bytes for one whole `data: {...}\\n\\n` event, or None to forward it as sent.

        Shortcut: mid-stream deltas take the byte-level path (delta.py; same bytes as decoding:
        tests/unit/test_stream_layouts.py::test_byte_level_path_gives_the_general_paths_bytes). vLLM writes the
        same bytes around every delta of a stream, so the bytes around the last match are checked literally
        first. Everything else, the first and final chunks among them, is decoded. Cheapest of all, an
        armed `Splice` (same bytes: tests/unit/test_stream_layouts.py and test_stream_send.py).
        """
        if event == b"data: [DONE]\n\n":  # first: no shortcut below takes it (none matches a non-JSON event)
            return None if self._waiting is None else self._release() + event
        if self._fast and self._waiting is None:
            splice = self.splice
            if splice is not None:
                start = splice.locate(event)
                if start >= 0:
                    self.chunks.delta_ids(event, start, len(event) - len(splice.tail))
                    return splice.render(event, start)
            lr = len(self.root)
            if event[lr : lr + 1] == b"]" and self._unchanged_usage_chunk(event):
                return None  # before the delta checks: `"choices":[]` holds no delta
            if splice is not None and (out := self._plain_finish(event, splice)) is not None:
                return out
            tail = self._tail
            if tail and event.endswith(tail) and (start := ids_between(event, self.root, self._head, tail)) >= 0:
                end = len(event) - len(tail)
                out = delta_bytes(event, start, end, self.chunks, self._strip, self._trio)
                if self._armings and (splice is None or not event.startswith(splice.prefix)):
                    return self._arm(event, start, end, out)  # the layout changed
                return out
            return self._matched_delta(event, splice)
        elif (scan := self._scan) is not None and self._waiting is None:
            return self._plain_chunk(event, scan)
        return self._decoded_event(event)

    def _matched_delta(self, event: bytes, splice: Splice | None) -> bytes | None:
        """`reshape_event` for a delta whose bytes around the ids are not the last delta's: while a splice is to be
        armed, one served as the first chunk is (`_first_delta`); else matched by `delta.tail_match` (and its bytes
        learned when it lists ids), else decoded."""
        # A splice is to be armed: the first delta, or the layout changed.
        arms = self._armings and (splice is None or not event.startswith(splice.prefix))
        if arms and self._scan is not None and (out := self._first_delta(event, self._scan)) is not None:
            return out
        m = tail_match(event, self.root)
        if m is None:
            # A delta without a finish reason (vllm-rs's), which no byte-level tier reads: on the Python path, read as
            # a first chunk is, by the scanner's twin, and the splice armed from it.
            scan = self._arm_scan if arms and self._scan is None else None
            if scan is not None and event.find(_FINISH_KEY) < 0 and (out := self._first_delta(event, scan)) is not None:
                return out
            return self._decoded_event(event)
        start, end = m.span(1)
        if event[start] == _LIST:  # learn the bytes around a list of ids
            self._head = event[m.start() : start]
            self._tail = m.group(2)
        out = delta_bytes(event, start, end, self.chunks, self._strip, self._trio)
        return self._arm(event, start, end, out) if arms and event[start] == _LIST else out

    def _first_delta(self, event: bytes, scan: Scanner) -> bytes | None:
        """A delta served as the first chunk is (finish.first_chunk: the general path's bytes without a decode), and the
        splice it teaches armed from those bytes when it lists ids; None (nothing recorded): not served so."""
        served = first_chunk(event, self.chunks.plan, self.chunks, scan) if event.startswith(self.root) else None
        if served is None:
            return None
        out, start, end = served
        return out if start < 0 else self._arm(event, start, end, out)

    def _plain_chunk(self, event: bytes, scan: Scanner) -> bytes:
        """The general path's bytes for a plain chunk without a decode (finish.first_chunk), and what the
        general path learns from a decoded chunk; else the chunk decoded."""
        chunks = self.chunks
        served = first_chunk(event, chunks.plan, chunks, scan)
        if served is None:
            return self._decoded_event(event)
        self._fast = not chunks.decode_every_chunk and self._learn_root(event)
        return served[0]

    def _plain_finish(self, event: bytes, splice: Splice) -> bytes | None:
        """The general path's bytes for a finish chunk (finish.finish_chunk); None: not served (and, without a
        finish reason after the splice's prefix, not tried: finish.finish_ids finds one there or serves none)."""
        if self._finish_head is None or event.find(b'"finish_reason":"', len(splice.prefix)) < 0:
            return None
        return finish_chunk(event, splice.prefix, self._finish_head, len(self.root), self._strip, self.chunks)

    def _arm(self, event: bytes, start: int, end: int, served: bytes | None) -> bytes:
        """Arm the splice the delta `event` (its ids at event[start:end]) teaches if it reproduces what a byte-level
        path has served the delta with (`served`; None: the delta as it came), and give those bytes back.

        Either path gives the general path's bytes for the deltas it takes (`_delta`:
        tests/unit/test_stream_layouts.py::test_byte_level_path_gives_the_general_paths_bytes; finish.first_chunk:
        test_stream_finish.py), so the splice is checked against them without decoding the delta; the stream tests
        run the armed splice against the decoding path.
        """
        out = event if served is None else served
        self._armings -= 1
        self.splice = splice = None
        if (parts := self._learn(event, start, end, self._strip, self._trio, out)) is not None:
            self.splice = splice = Splice(*parts, self._strip, self._trio)
        self._finish_head = None  # the finish chunks it may serve (finish.finish_chunk)
        if splice is not None and self._finishes and splice.finish_head is not None and finishes(splice.prefix):
            self._finish_head = splice.finish_head
        return out

    def arm_parts(self) -> SpliceArm | None:
        """What the send handed to vLLM is armed with (`splice.SpliceArm`); None: not armed, the next message may
        not be served by the splice alone (something held back or waiting)."""
        splice = self.splice
        if splice is None or not self._fast or self._held or self._waiting is not None:
            return None
        chunks = self.chunks
        finish = None
        if self._finish_head is not None and not chunks.first.finished:  # finish.finish_chunk's bytes
            finish = _record(FinishArm, (self._finish_head, len(self.root), chunks.finish_first_choice))
        usage_root = b"" if self._renames else self.root  # the general path may rename an error in it
        on_ids = chunks.delta_ids if chunks.engine or (chunks.timed and chunks.ttft_ms is None) else None
        parts = (splice.prefix, splice.head, splice.tail, splice.mid, self._strip, self._trio, on_ids, usage_root)
        return _record(SpliceArm, (*parts, finish))

    def _decoded_event(self, event: bytes) -> bytes:
        return self._data_event(_DATA, event[_JSON_AT : -len(_EVENT_END)], _EVENT_END, event)

    def _data_event(self, before: bytes, payload: bytes, after: bytes, event: bytes) -> bytes:
        """The general path for one `data:` event whose JSON payload sits between `before` and `after`."""
        try:
            obj = _json.loads(payload)
        except ValueError:
            obj = _NOT_JSON  # forwarded untouched ([DONE] among them)
        released = b""
        if self._waiting is not None:
            if isinstance(obj, dict) and obj.get("choices") == []:
                self.chunks.complete_from_usage(obj)  # the usage chunk the finish chunk waited for
            released = self._release()
        if obj is _NOT_JSON:
            return released + event
        chunks = self.chunks
        changed = reshape_single(chunks, obj) if self._finishes else None  # the same in fewer steps, or None
        if changed is None:
            changed = chunks.reshape(obj)
        if chunks.pending is not None:
            self._waiting = (before, obj, after)  # a finish chunk that waits for the usage chunk
            return released
        if isinstance(obj, dict) and obj.get("choices") and before == _DATA:
            # engine_data with logprobs or several choices needs every chunk decoded.
            self._fast = not chunks.decode_every_chunk and self._learn_root(event)
        return released + (before + _json.dumps(obj) + after if changed else event)

    def _learn_root(self, event: bytes) -> bool:
        """Learn the root bytes before `choices` from a decoded chunk (`delta.chunk_root`); False if deltas must
        stay decoded."""
        root = chunk_root(event)
        if root is None and self._arm_scan is not None and event.find(_FINISH_KEY) < 0:
            root = scanned_root(event, self._arm_scan)  # a chunk without a finish reason (vllm-rs)
            if root is None:
                self._arm_scan = None  # tried once a stream: its chunks are decoded
        if root is not None:
            self.root = root
        return root is not None

    def _release(self) -> bytes:
        """The waiting finish chunk, as it stands (completed from the usage chunk if one came)."""
        waiting, self._waiting = self._waiting, None
        self.chunks.drop_pending()
        if waiting is None:
            return b""
        before, obj, after = waiting
        return before + _json.dumps(obj) + after

    def _reshape_framed(self, event: bytes) -> bytes:
        """One event the framer delimited: any SSE shape, only single-line `data:` JSON is read."""
        try:
            if _is_plain_data_event(event):
                new = self.reshape_event(event)
                return event if new is None else new
            span = data_payload(event)
            if span is None:  # comments, keep-alives, other fields, multi-line data
                return event if self._waiting is None else self._release() + event
            start, end = span
            return self._data_event(event[:start], event[start:end], event[end:], event)
        except Exception:
            logger.exception("vllm-nvext could not reshape a stream event; forwarded unchanged")
            self.unchanged += 1
            return event if self._waiting is None else self._release() + event

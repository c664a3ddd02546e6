"""Which tier of `StreamReshaper` serves each body message, before and after the stream send is armed: counts.

Every recorded stream of every layout (tests/fixtures: vLLM 0.32, 0.33, 0.34, vllm-rs 0.33 and 0.34), planned as a
client asking for `nvext.extra_fields: ["completion_token_ids"]` in `nvext` and `both` mode (vllm-rs's also as
`vllm-nvext proxy` plans it, its keys deleted: `plan.for_upstream`), through `send.ReshapingSend` and the stream send
of the kernels that run (compiled where built), three ways:

  vLLM       one event a body message, as vLLM's serving code sends it
  split      the stream's bytes in 97-byte messages (what a proxy's reads look like: the framer holds a partial event,
             and the send is not armed while it does)
  captured   one event a message, the stream captured (`outbound.captured.CapturedStreamReshaper`, whose arm leaves the
             finish and usage chunks to Python)

A message the stream send serves itself never reaches `StreamReshaper` (`armed send`); every event of the others is
counted under the tier that served it (`StreamReshaper.reshape_event`'s order), by probes around the tiers' functions
(counts, no timing). `before` / `armed`: whether the send was armed when the message came.

Run: python -m benchmarks.bench_tiers [--pure-python]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm_nvext.config import Mode
from vllm_nvext.inbound.plan import for_upstream
from vllm_nvext.inbound.request import plan_request
from vllm_nvext.kernels import pick
from vllm_nvext.outbound import stream as stream_module
from vllm_nvext.outbound.nvext_values import Clock
from vllm_nvext.outbound.splice import Splice
from vllm_nvext.outbound.stream import StreamReshaper
from vllm_nvext.protocol import ENDPOINT_PATHS, RequestError
from vllm_nvext.send import ReshapingSend

from ._common import LAYOUT_DIRS, SSE_HEADERS, print_table, run_sync

ARMED_SEND = "armed send (never reaches StreamReshaper)"
# (label, where the probe goes, how its result says it served the message), in reshape_event's order.
TIERS: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("splice, Python (Splice.locate)", "Splice.locate", lambda r: r >= 0),
    ("usage chunk as it came", "StreamReshaper._unchanged_usage_chunk", bool),
    ("finish chunk (finish.finish_chunk)", "StreamReshaper._plain_finish", lambda r: r is not None),
    ("delta, the last delta's bytes (delta.ids_between)", "ids_between", lambda r: r >= 0),
    ("delta read as a first chunk (arming)", "StreamReshaper._first_delta", lambda r: r is not None),
    ("delta, tail pattern (delta.tail_match)", "tail_match", lambda r: r is not None),
    ("chunk scanned, not decoded (_plain_chunk)", "StreamReshaper._plain_chunk", lambda r: True),
    ("decoded (the general path)", "StreamReshaper._data_event", lambda r: True),
)
DECODED = TIERS[-1][0]
PIECE = 97


class _Tap:
    """A capture tap that keeps nothing."""

    def stream_bytes(self, body: bytes) -> None:
        return None


@contextmanager
def _probes(fired: list[str]) -> Iterator[None]:
    """Each tier's function wrapped: its label appended to `fired` when it served."""
    owners: dict[str, Any] = {"Splice": Splice, "StreamReshaper": StreamReshaper}
    undo: list[tuple[Any, str, Any]] = []

    def probe(real: Callable[..., Any], label: str, served: Callable[[Any], bool]) -> Callable[..., Any]:
        def probed(*args: Any) -> Any:
            before = len(fired)
            result = real(*args)
            if served(result) and DECODED not in fired[before:]:  # a tier that handed its event to the decode did not
                fired.append(label)
            return result

        return probed

    for label, where, served in TIERS:
        owner_name, _, attr = where.rpartition(".")
        owner = owners[owner_name] if owner_name else stream_module
        real = owner.__dict__[attr] if owner_name else getattr(owner, attr)
        undo.append((owner, attr, real))
        setattr(owner, attr, probe(real, label, served))
    try:
        yield
    finally:
        for owner, attr, real in reversed(undo):
            setattr(owner, attr, real)


def _streams() -> Iterator[tuple[str, str, bytes, bytes]]:
    """(layout, name, request body, recorded stream) of every recorded stream that asked for ids."""
    for vllm, directory in LAYOUT_DIRS.items():
        cases = json.loads((directory / "index.json").read_text())["cases"]
        for name, case in sorted(cases.items()):
            if case["request"].get("stream") and "_ids" in name and case.get("status", 200) == 200:
                request = {**case["request"], "nvext": {"extra_fields": ["completion_token_ids"]}}
                yield vllm, name, json.dumps(request).encode(), (directory / case["file"]).read_bytes()


def _messages(stream: bytes, how: str) -> list[bytes]:
    if how == "split":
        return [stream[i : i + PIECE] for i in range(0, len(stream), PIECE)]
    return [block + b"\n\n" for block in stream.split(b"\n\n") if block]


def count(how: str, counts: Counter[tuple[str, str]], fired: list[str], pure_python: bool) -> None:
    kernels = pick(pure_python)
    for vllm, name, body, stream in _streams():
        path = "/v1/chat/completions" if name.startswith("chat") else "/v1/completions"
        for mode in (Mode.NVEXT, Mode.BOTH):
            try:
                plan = plan_request(body, ENDPOINT_PATHS[path], mode)
            except RequestError:
                continue  # n=2, echo: no nvext selector
            if plan is None:
                continue
            plans = [plan]
            if vllm.endswith("-rust"):
                plans.append(for_upstream(plan, vllm.replace("-rust", ".0")))
            for each in plans:

                async def nothing(message: Any) -> None:
                    return None

                reshaping = ReshapingSend(each, Clock(), nothing, kernels, tap=_Tap() if how == "captured" else None)
                run_sync(
                    reshaping.app_send({"type": "http.response.start", "status": 200, "headers": list(SSE_HEADERS)})
                )
                for piece in [*_messages(stream, how), b""]:
                    phase = "armed" if reshaping._armed else "before"
                    fired.clear()
                    message = {"type": "http.response.body", "body": piece, "more_body": bool(piece)}
                    with _probes(fired):
                        run_sync(reshaping.app_send(message))
                    if not fired and phase == "armed" and piece:
                        counts[(ARMED_SEND, f"{how} {phase}")] += 1
                    for label in fired:  # one a served event
                        counts[(label, f"{how} {phase}")] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pure-python", action="store_true", help="the Python twins' stream send")
    args = parser.parse_args()
    counts: Counter[tuple[str, str]] = Counter()
    fired: list[str] = []
    ways = ("vLLM", "split", "captured")
    for how in ways:
        count(how, counts, fired, args.pure_python)
    columns = [f"{how} {phase}" for how in ways for phase in ("before", "armed")]
    labels = [ARMED_SEND, *(label for label, _, _ in TIERS)]
    rows = [[label, *(str(counts[(label, column)]) for column in columns)] for label in labels]
    print_table(
        f"Events served by each tier of StreamReshaper, every recorded stream with ids ({pick(args.pure_python).impl})",
        ["tier", *columns],
        rows,
        notes=[
            "before / armed: whether the stream send was armed when the message came",
            "each event counted under the tier that served it ([DONE] and the stream's end, passed as they came, are"
            " left out); armed send: messages",
        ],
    )


if __name__ == "__main__":
    main()

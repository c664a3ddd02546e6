"""Access to the responses recorded by scripts/record_fixtures.py, for every vLLM layout.

Five fixture sets, each recorded from the real serving code, never typed:
- vLLM 0.32 (tests/fixtures/): the real engine on the tiny model;
- vLLM 0.33 (tests/fixtures/vllm-0.33/): vLLM 0.33's own `vllm serve` over a scripted engine
  core (scripts/vllm_harness.py): 0.33's bytes around scripted token ids;
- vLLM 0.34 (tests/fixtures/vllm-0.34/): the same with vLLM 0.34's `vllm serve` (its streams are
  0.33's bytes; its unary bodies leave out `annotations` and `prompt_tokens_details`);
- vLLM 0.33's Rust frontend (tests/fixtures/vllm-0.33-rust/): stock `vllm-rs` over vLLM 0.33's
  engine core with a scripted executor (scripts/vllm_executor.py): what `vllm-nvext proxy`
  reads in front of it;
- vLLM 0.34's Rust frontend (tests/fixtures/vllm-0.34-rust/): the same with vLLM 0.34's `vllm-rs`
  (`make fixtures-rust034`).

`recordings()` holds them all: the 0.32 recordings under their own names, the others under
`vllm-0.33/<name>`, `vllm-0.34/<name>`, `vllm-0.33-rust/<name>` and `vllm-0.34-rust/<name>`, so a test
that iterates over `recordings()` covers every layout, and
`recording("chat_stream_ids")` stays the 0.32 one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# vLLM version -> (fixture directory, prefix of its recordings' names in `recordings()`)
FIXTURE_SETS: dict[str, tuple[Path, str]] = {
    "0.32": (FIXTURES, ""),
    "0.33": (FIXTURES / "vllm-0.33", "vllm-0.33/"),
    "0.34": (FIXTURES / "vllm-0.34", "vllm-0.34/"),
    "0.33-rust": (FIXTURES / "vllm-0.33-rust", "vllm-0.33-rust/"),
    "0.34-rust": (FIXTURES / "vllm-0.34-rust", "vllm-0.34-rust/"),
}
VLLM_VERSIONS = tuple(FIXTURE_SETS)


@dataclass(frozen=True)
class Recording:
    name: str
    path: str
    request: dict[str, Any]
    status: int
    content_type: str
    body: bytes
    vllm: str = "0.32"  # which fixture set: a key of FIXTURE_SETS

    @property
    def stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    @property
    def endpoint(self):
        from vllm_nvext.protocol import ENDPOINT_PATHS

        return ENDPOINT_PATHS[self.path]

    def events(self) -> list[dict[str, Any]]:
        """The JSON events of a recorded stream, in order ([DONE] excluded), vLLM's framing checked."""
        from tests.helpers import sse_events

        return sse_events(self.body)

    def json(self) -> Any:
        return json.loads(self.body)


@cache
def recordings_of(vllm: str) -> dict[str, Recording]:
    """One fixture set, under the names the recorder gave its cases."""
    directory, _ = FIXTURE_SETS[vllm]
    index = json.loads((directory / "index.json").read_text())
    return {
        name: Recording(
            name=name,
            path=case["path"],
            request=case["request"],
            status=case["status"],
            content_type=case["content_type"],
            body=(directory / case["file"]).read_bytes(),
            vllm=vllm,
        )
        for name, case in index["cases"].items()
    }


@cache
def recordings() -> dict[str, Recording]:
    """Every fixture set; names of all but 0.32's are prefixed with their set (see module doc)."""
    out: dict[str, Recording] = {}
    for vllm, (_, prefix) in FIXTURE_SETS.items():
        out.update({prefix + name: rec for name, rec in recordings_of(vllm).items()})
    return out


def recording(name: str) -> Recording:
    return recordings()[name]

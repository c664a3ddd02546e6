"""Access to the responses recorded from a real vLLM server by scripts/record_fixtures.py."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures"


@dataclass(frozen=True)
class Recording:
    name: str
    path: str
    request: dict[str, Any]
    status: int
    content_type: str
    body: bytes

    @property
    def stream(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    @property
    def endpoint(self):
        from vllm_nvext.request import ENDPOINT_PATHS

        return ENDPOINT_PATHS[self.path]

    def events(self) -> list[dict[str, Any]]:
        """The JSON events of a recorded stream, in order ([DONE] excluded)."""
        out = []
        for block in self.body.split(b"\n\n"):
            if block.startswith(b"data: ") and block != b"data: [DONE]":
                out.append(json.loads(block[6:]))
        return out

    def json(self) -> Any:
        return json.loads(self.body)


@cache
def recordings() -> dict[str, Recording]:
    index = json.loads((FIXTURES / "index.json").read_text())
    return {
        name: Recording(
            name=name,
            path=case["path"],
            request=case["request"],
            status=case["status"],
            content_type=case["content_type"],
            body=(FIXTURES / case["file"]).read_bytes(),
        )
        for name, case in index["cases"].items()
    }


def recording(name: str) -> Recording:
    return recordings()[name]

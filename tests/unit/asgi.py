"""A minimal ASGI driver and a replaying upstream, for testing the middleware without a network."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Upstream:
    """Stands in for vLLM: records the request it got and replays recorded response bytes."""

    status: int = 200
    content_type: str = "application/json"
    body: bytes = b"{}"
    cuts: Sequence[int] = ()  # split the body into several http.response.body messages here
    extra_headers: Sequence[tuple[bytes, bytes]] = ()
    received: bytes | None = None
    received_headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    received_scope: dict[str, Any] | None = None
    calls: int = 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        self.received_scope = scope
        self.received_headers = list(scope.get("headers", []))
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.received = b"".join(chunks)
        headers = [(b"content-type", self.content_type.encode()), *self.extra_headers]
        if not self.content_type.startswith("text/event-stream"):
            headers.append((b"content-length", str(len(self.body)).encode()))
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        prev = 0
        bounds = [*sorted(set(self.cuts)), len(self.body)]
        for i, cut in enumerate(bounds):
            await send({"type": "http.response.body", "body": self.body[prev:cut], "more_body": i < len(bounds) - 1})
            prev = cut


@dataclass
class Result:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    body_messages: list[bytes]

    def header(self, name: bytes) -> bytes | None:
        for n, v in self.headers:
            if n.lower() == name:
                return v
        return None


async def call(
    app,
    path: str,
    body: bytes,
    *,
    method: str = "POST",
    headers: Sequence[tuple[bytes, bytes]] = ((b"content-type", b"application/json"),),
    request_cuts: Sequence[int] = (),
    root_path: str = "",
    scope_extra: dict[str, Any] | None = None,
    app_state: Any = None,
    disconnect_after_body: bool = False,
) -> Result:
    """Send one request through `app`, the body split at `request_cuts`; collect the response.

    `disconnect_after_body`: the client goes as soon as its body is sent.
    """
    hdrs = [*headers, (b"content-length", str(len(body)).encode())]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "root_path": root_path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": hdrs,
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 8000),
        **(scope_extra or {}),
    }
    if app_state is not None:
        scope["app"] = app_state  # what vLLM's app carries: `state.args` (the key check reads it)
    bounds = [*sorted(set(request_cuts)), len(body)]
    pending = []
    prev = 0
    for i, cut in enumerate(bounds):
        pending.append({"type": "http.request", "body": body[prev:cut], "more_body": i < len(bounds) - 1})
        prev = cut

    answered = asyncio.Event()

    async def receive():
        if pending:
            return pending.pop(0)
        if disconnect_after_body:
            return {"type": "http.disconnect"}
        await answered.wait()  # as a server does: the disconnect comes once the response is complete
        return {"type": "http.disconnect"}

    start: dict[str, Any] = {}
    messages: list[bytes] = []

    async def send(message):
        if message["type"] == "http.response.start":
            assert not start, "response started twice"
            start.update(message)
        elif message["type"] == "http.response.body":
            assert start, "body before start"
            messages.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                answered.set()

    await app(scope, receive, send)
    return Result(start["status"], list(start.get("headers", [])), b"".join(messages), messages)

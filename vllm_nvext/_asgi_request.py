"""ASGI plumbing for the request side: replaying a body, passing a large one through, headers.

Nothing here decides anything about either dialect; `middleware.py` wires these together.
"""

from __future__ import annotations

import email.message
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from . import _vllm_compat
from ._optin import OptInScan

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Replay:
    """Hands the app the (possibly rewritten) body, then the server's own `receive`."""

    __slots__ = ("_messages", "_receive")

    def __init__(self, parts: list[bytes], more_body: bool, receive: Receive) -> None:
        last = len(parts) - 1
        self._messages: list[Message] = [
            {"type": "http.request", "body": part, "more_body": more_body or i < last} for i, part in enumerate(parts)
        ]
        self._messages.reverse()
        self._receive = receive

    async def __call__(self) -> Message:
        if self._messages:
            return self._messages.pop()
        return await self._receive()


class PassThrough:
    """The `receive` for a body over the cap that does not opt in so far: it streams to vLLM.

    The rest of the body is checked as it passes. Should it turn out to opt in after all, vLLM is
    told the client went away (it has not answered yet: it answers once the body is complete) and
    the client gets the 413 the middleware owes it.
    """

    __slots__ = ("_replay", "_receive", "_scan", "aborted")

    def __init__(self, parts: list[bytes], scan: OptInScan, receive: Receive) -> None:
        self._replay = Replay(parts, True, receive)
        self._receive = receive
        self._scan = scan
        self.aborted = False

    async def __call__(self) -> Message:
        if self.aborted:
            return {"type": "http.disconnect"}
        if self._replay._messages:
            return await self._replay()
        message = await self._receive()
        if message["type"] == "http.request" and self._scan.feed(bytes(message.get("body", b""))):
            self.aborted = True
            return {"type": "http.disconnect"}
        return message


# Content-Type value -> its media type, for the values seen: a client's header repeats, and parsing
# it costs more than the rest of an opt-out request. Bounded, so made-up values cannot grow it.
_MEDIA_TYPES: dict[bytes, str] = {}
_MEDIA_TYPES_MAX = 256


def media_type(content_type: bytes) -> str:
    """`maintype/subtype`, lower case, as FastAPI reads a Content-Type (`email.message`: parameters
    and spaces ignored, an unparsable value is `text/plain`)."""
    known = _MEDIA_TYPES.get(content_type)
    if known is None:
        message = email.message.Message()
        message["content-type"] = content_type.decode("latin-1")
        known = message.get_content_type()
        if len(_MEDIA_TYPES) < _MEDIA_TYPES_MAX:
            _MEDIA_TYPES[content_type] = known
    return known


def is_json(content_type: bytes) -> bool:
    """FastAPI's rule for a JSON body: `application/json` or `application/<anything>+json`."""
    maintype, _, subtype = media_type(content_type).partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


def is_event_stream(content_type: bytes) -> bool:
    return media_type(content_type) == "text/event-stream"


def read_as_json(content_type: bytes | None) -> bool:
    """Whether vLLM's FastAPI route parses the body as JSON (its own rule, on the first header)."""
    if content_type is None:
        return _vllm_compat.untyped_body_is_json()
    return is_json(content_type)


def set_header(scope: Scope, name: bytes, value: bytes, *, replace: bool = True) -> None:
    """Set a request header in the scope's own list (never a copy of the scope).

    With replace=False a header the client already sent is kept.
    """
    headers = scope["headers"]
    if not isinstance(headers, list):
        headers = scope["headers"] = list(headers)
    if any(n == name for n, _ in headers):
        if not replace:
            return
        headers[:] = [(n, v) for n, v in headers if n != name]
    headers.append((name, value))

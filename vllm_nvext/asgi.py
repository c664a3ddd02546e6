"""ASGI plumbing for the request side: the headers the middleware reads, replaying a body, passing a
large one through, and the sub-request to one of vLLM's own routes (echo's `/detokenize`).

Nothing here decides anything about either dialect; `middleware/` wires these together.
"""

from __future__ import annotations

import asyncio
import email.message
import itertools
import sys
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from . import _json, _vllm_compat, metrics
from .asgi_types import ASGIApp, Message, Receive, Scope, Send
from .config import MODE_HEADER, keep
from .inbound.optin import OptInScan
from .protocol import RequestError, error_body

# Set on the scope by the first instance, so a second mount (plugin and --middleware) is inert.
HANDLED = "vllm_nvext.handled"
_MODE_HEADER = MODE_HEADER.encode()


@dataclass(slots=True, init=False)
class RequestHeaders:
    """The request headers the middleware reads, each as vLLM (starlette) reads it."""

    content_type: bytes | None  # the first one
    content_length: int  # the last one; -1 when absent or not a number
    dp_rank: bytes | None  # the first `x-data-parallel-rank`
    modes: list[bytes]  # every `x-nvext-mode` (repeats must agree)
    json_body: bool  # vLLM reads the body as JSON (`read_as_json` of the first Content-Type)

    @classmethod
    def read(cls, scope: Scope) -> RequestHeaders:
        content_type = dp_rank = None
        content_length = -1
        modes: list[bytes] = []
        for name, value in scope["headers"]:
            if name == b"content-type":
                content_type = value if content_type is None else content_type
            elif name == _MODE_HEADER:
                modes.append(value)
            elif name == b"x-data-parallel-rank":
                dp_rank = value if dp_rank is None else dp_rank
            elif name == b"content-length":
                if not value.isdigit():
                    content_length = -1
                elif len(value) <= 18:
                    content_length = int(value)
                else:  # `int` refuses over 4300 digits: past 18 significant ones, more than any cap
                    digits = value.lstrip(b"0")
                    content_length = int(digits or b"0") if len(digits) <= 18 else sys.maxsize
        headers = cls()  # no `__init__` of its own (one function per request): every field is set here
        headers.content_type = content_type
        headers.content_length = content_length
        headers.dp_rank = dp_rank
        headers.modes = modes
        if content_type is None:
            headers.json_body = _vllm_compat.untyped_body_is_json()
        else:
            known = _JSON_TYPES.get(bytes(content_type))  # `read_as_json`'s memo, without entering it
            headers.json_body = read_as_json(bytes(content_type)) if known is None else known
        return headers


async def _replayed(message: Message) -> Message:
    return message


def replay_body(body: bytes, receive: Receive) -> Receive:
    """`Replay([body], False, receive)` for a body that came in one message: the body, then the
    server's own `receive()`.

    Chained C iterators: the body's message is one coroutine (made when the app first asks), and
    every later call of the app's reaches the server's `receive` without entering Python of ours.
    """
    message: Message = {"type": "http.request", "body": body, "more_body": False}
    return itertools.chain(map(_replayed, (message,)), iter(receive, None)).__next__


class Replay:
    """Hands the app the (possibly rewritten) body, then the server's own `receive`."""

    __slots__ = ("_messages", "_receive")

    def __init__(self, parts: list[bytes], more_body: bool, receive: Receive) -> None:
        if len(parts) == 1:  # a whole body (the common case), as the general case builds it
            self._messages: list[Message] = [{"type": "http.request", "body": parts[0], "more_body": more_body}]
        else:
            last = len(parts) - 1
            self._messages = [
                {"type": "http.request", "body": part, "more_body": more_body or i < last}
                for i, part in enumerate(parts)
            ]
            self._messages.reverse()
        self._receive = receive

    @classmethod
    def again(cls, message: Message, receive: Receive) -> Replay:
        """A `receive` that gives `message` (already received) once more, then the server's `receive`."""
        replay = cls([], False, receive)
        replay._messages.append(message)
        return replay

    def __call__(self) -> Awaitable[Message]:
        if self._messages:
            return _replayed(self._messages.pop())
        return self._receive()  # the server's own, awaited by the app without a layer of ours


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
        known = keep(_MEDIA_TYPES, content_type, message.get_content_type(), _MEDIA_TYPES_MAX)
    return known


def is_json(content_type: bytes) -> bool:
    """FastAPI's rule for a JSON body: `application/json` or `application/<anything>+json`."""
    maintype, _, subtype = media_type(content_type).partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


def is_event_stream(content_type: bytes) -> bool:
    return media_type(content_type) == "text/event-stream"


# Content-Type value -> `is_json`'s answer, for the values seen (bounded as _MEDIA_TYPES is).
_JSON_TYPES: dict[bytes, bool] = {}


def read_as_json(content_type: bytes | None) -> bool:
    """Whether vLLM's FastAPI route parses the body as JSON (its own rule, on the first header)."""
    if content_type is None:
        return _vllm_compat.untyped_body_is_json()
    known = _JSON_TYPES.get(content_type)
    if known is None:
        known = keep(_JSON_TYPES, content_type, is_json(content_type), _MEDIA_TYPES_MAX)
    return known


def set_header(scope: Scope, name: bytes, value: bytes, *, replace: bool = True) -> None:
    """Set a request header in the scope's own list (never a copy of the scope).

    With replace=False a header the client already sent is kept.
    """
    headers = scope["headers"]
    if not isinstance(headers, list):
        headers = scope["headers"] = list(headers)
    # One pass: where the header is and whether it repeats (a client's Content-Length: once).
    found = -1
    repeated = False
    for i, (n, _) in enumerate(headers):
        if n == name:
            if not replace:
                return
            if found >= 0:
                repeated = True
                break
            found = i
    if repeated:
        headers[:] = [(n, v) for n, v in headers if n != name]
    elif found >= 0:
        del headers[found]
    headers.append((name, value))


def first_header(scope: Scope, name: bytes) -> bytes | None:
    """The first of a repeated request header, the one starlette's `headers.get` gives vLLM."""
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


async def internal_post(
    app: ASGIApp, scope: Scope, route: str, model: Any, tokens: tuple[int, ...]
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """POST `{"model", "tokens"}` to one of vLLM's own routes in this process, with the client's credentials."""
    payload = {"tokens": list(tokens)} if model is None else {"model": model, "tokens": list(tokens)}
    body = _json.dumps(payload)
    root = scope.get("root_path", "")
    headers = [(n, v) for n, v in scope["headers"] if n == b"authorization"]
    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    sub: Scope = {
        **{k: v for k, v in scope.items() if k != HANDLED},
        "path": root + route,
        "raw_path": (root + route).encode(),
        "query_string": b"",
        "headers": headers,
    }
    result: dict[str, Any] = {"status": 500, "headers": [], "body": []}
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if sent:  # vLLM listens for a disconnect while it answers: none comes
            await asyncio.Event().wait()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            result["status"] = message["status"]
            result["headers"] = list(message.get("headers", ()))
        elif message["type"] == "http.response.body":
            result["body"].append(bytes(message.get("body", b"")))

    await app(sub, receive, send)
    return result["status"], result["headers"], b"".join(result["body"])


async def send_error(send: Send, error: RequestError, payload: bytes | None = None) -> None:
    """Answer a refusal (vLLM's OpenAI error envelope); `payload`: the error body when it is not that
    envelope (the Anthropic route's)."""
    metrics.count_refusal(error.param, error.status)
    if payload is None:
        payload = error_body(error.message, error.param, error.status)
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def too_large(cap: int) -> RequestError:
    return RequestError(f"Request body exceeds the {cap}-byte limit of vllm-nvext", None, 413)


async def decode_echo_prompts(
    app: ASGIApp, scope: Scope, receive: Receive, plan: Any, model: Any
) -> tuple[str | tuple[int, ...], ...] | None:
    """Each echoed id prompt as vLLM echoes it: decoded by vLLM's own `/detokenize`.

    Called when vLLM's successful answer starts, so after vLLM checked the key, the model and
    the ids and did its own work for them (an error of vLLM's reaches the client as stock).
    One call per distinct id prompt, stopped as soon as the client goes (None then).
    """
    decoding = asyncio.ensure_future(_decode_distinct(app, scope, plan.echo_prompts, model))
    watching = asyncio.ensure_future(receive())  # the body is read: only a disconnect comes
    try:
        await asyncio.wait((decoding, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (decoding, watching):
            if not task.done():
                task.cancel()
    if watching.done() and not watching.cancelled() or not decoding.done() or decoding.cancelled():
        return None  # the client went away (the only message that can come after the body)
    texts = decoding.result()
    return tuple(texts.get(p, p) if not isinstance(p, str) else p for p in plan.echo_prompts)


async def _decode_distinct(
    app: ASGIApp, scope: Scope, prompts: tuple[str | tuple[int, ...], ...], model: Any
) -> dict[tuple[int, ...], str]:
    texts: dict[tuple[int, ...], str] = {}
    for prompt in dict.fromkeys(p for p in prompts if not isinstance(p, str)):
        status, _, body = await internal_post(app, scope, "/detokenize", model, prompt)
        try:
            decoded = _json.loads(body) if status == 200 else None
        except ValueError:
            decoded = None
        if not isinstance(decoded, dict) or not isinstance(decoded.get("prompt"), str):
            break  # vLLM, which accepted these ids, answered otherwise: the text stays as vLLM wrote it
        texts[prompt] = decoded["prompt"]
    return texts

"""The ASGI interface's types, and nothing else: what a server hands an app (`Scope`, `Receive`, `Send`) and what
passes through them (`Message`). Every side names them from here, so a module that only passes messages on (the
reshaping `send`, the kernels, the proxy) imports no plumbing, no store, no server along with them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

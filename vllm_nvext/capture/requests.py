"""Reading a captured request that opts into nothing, as vLLM reads it (docs/capture.md)."""

from __future__ import annotations

from .. import _json
from ..inbound.fields import invocation_route, read_fields
from ..inbound.request import Request
from ..protocol import Endpoint


def read_for_capture(body: bytes, endpoint: Endpoint) -> Request | None:
    """A body that opts into nothing, read as vLLM will so that the operator's capture can plan it; None
    when vLLM refuses it itself (not an object, no route of /invocations takes it) or it is a chat batch
    (not captured). Raises RequestError as `read_request` does."""
    data = _json.object_as_vllm(body)
    if data is None:
        return None
    if endpoint is Endpoint.INVOCATIONS:
        route = invocation_route(data)
        if route is None:
            return None
        endpoint = route
    if endpoint is Endpoint.CHAT_BATCH:
        return None
    return Request(endpoint, body, data, read_fields(data, endpoint), {})

"""Reading and planning a captured request that opts into nothing, as vLLM reads it (docs/capture.md)."""

from __future__ import annotations

from dataclasses import replace

from .. import _json
from ..config import Mode
from ..inbound.fields import invocation_route, read_fields
from ..inbound.plan import Plan
from ..inbound.reading import Request
from ..inbound.request import plan
from ..protocol import Dialect, Endpoint, RequestError


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


def plan_for_capture(
    body: bytes, endpoint: Endpoint, mode: Mode, hides_reasoning_ids: bool, logprobs: bool = False
) -> tuple[Request | None, Plan | None]:
    """A captured request that opts into nothing, planned with ids on for the tap alone (and with `logprobs`,
    VLLM_NVEXT_CAPTURE_LOGPROBS, the sampled tokens' logprobs); (None, None): one the plan refuses, which goes to
    vLLM untouched (capture never answers otherwise than vLLM would)."""
    try:
        request = read_for_capture(body, endpoint)
        if request is None:
            return None, None
        planned = plan(request, mode, hides_reasoning_ids=hides_reasoning_ids, capture=True, logprobs=logprobs)
    except RequestError:
        return None, None
    return request, replace(planned, dialect=Dialect.NONE)

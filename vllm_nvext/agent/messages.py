"""/v1/messages (Claude Code) with token ids, served by the endpoint plugin mount (docs/protocol.md §11.2).

vLLM's Anthropic route converts the request into a chat request without `return_token_ids` and
builds the Anthropic answer from the chat answer, so the ids never reach an ASGI layer. The
plugin mount (inside vLLM's app, after vLLM's key check) therefore serves a request that opts in
itself, with vLLM's own code: vLLM's Anthropic handler does the conversion and the answer, on a
per-request copy whose chat request has `return_token_ids` on and whose chat answer is read for
the ids on the way. The `--middleware` mount refuses such a request (400, Anthropic's envelope)
unless the plugin is mounted too, in which case it leaves the route to the plugin. The plan of a
body (`plan_messages`) is read here too, from what it opts into (`responses.opt_in`).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .. import _json
from ..asgi_types import ASGIApp, Receive, Scope, Send
from ..config import Mode
from ..protocol import COMPLETION_TOKEN_IDS, ID_SELECTORS, PROMPT_TOKEN_IDS, Dialect, RequestError
from .responses import opt_in, root_flag

logger = logging.getLogger("vllm_nvext")

# Set on vLLM's app state by the plugin: the plugin mount serves /v1/messages with ids.
PLUGIN_STATE = "vllm_nvext_serves_messages"


def plugin_serves_messages(scope: Scope) -> bool:
    """Is the plugin mounted in the app this request goes to (so that it serves /v1/messages)?"""
    state = getattr(scope.get("app"), "state", None)
    return getattr(state, PLUGIN_STATE, False) is True


class IdPlacements(NamedTuple):
    """What a /v1/messages answer carries (docs/protocol.md §11.2)."""

    vllm: bool  # vLLM's placement: root `prompt_token_ids`, `token_ids`
    nvext_trio: bool  # under `nvext`: completion_token_ids, prompt_token_ids, kv_transfer_params
    nvext_prompt_ids: bool  # `nvext.prompt_token_ids` alone


@dataclass(frozen=True, slots=True)
class MessagesPlan:
    """One /v1/messages request that opts in (docs/protocol.md §11.2)."""

    # None of them set means no ids were asked.
    placements: IdPlacements
    # The param the client asked for ids with (named by a refusal).
    param: str
    stream: bool
    body: bytes | None
    headers: tuple[tuple[bytes, bytes], ...] = ()
    dialect: Dialect = Dialect.VLLM
    # The client's `nvext` / `return_token_ids`, which vLLM's model ignores but its errors count.
    dropped: tuple[tuple[str, Any], ...] = ()
    # The operator captures it (docs/capture.md): served with ids (by the plugin mount) for the tap.
    capture: bool = False

    @property
    def ids(self) -> bool:
        return any(self.placements)

    def refusal(self) -> RequestError:
        """Where the ids cannot be served: a 400 naming the field, never a 200 without them."""
        return RequestError(
            f"`{self.param}` cannot be answered on /v1/messages by the --middleware mount alone: vLLM's "
            "Messages API converts the request to chat without token ids, so they need the vllm-nvext "
            "endpoint plugin (VLLM_PLUGINS=nvext) serving that route (docs/protocol.md §11)",
            self.param,
        )


def plan_messages(
    body: bytes, mode: Mode, *, dp_rank_header: bytes | None = None, capture: bool = False
) -> MessagesPlan | None:
    """The plan for a /v1/messages body; None means pass it through untouched. Raises RequestError.

    `capture`: the operator captures the request (a body that opts into nothing is then planned too,
    with no ids to answer; vLLM gets the client's bytes).
    """
    opt = opt_in(body, mode, "/v1/messages")
    if opt is None:
        data = _json.object_as_vllm(body) if capture else None
        none = IdPlacements(False, False, False)
        return (
            None
            if data is None
            else MessagesPlan(none, "", root_flag(data, "stream"), None, (), Dialect.NONE, capture=True)
        )
    asked = set(opt.nvext.get("extra_fields") or []) & ID_SELECTORS
    param = "nvext.extra_fields" if asked else "return_token_ids"
    rewrite, headers = opt.rewrite(body, dp_rank_header)
    return MessagesPlan(
        placements=IdPlacements(opt.vllm_placement, opt.nvext_trio, opt.nvext_prompt_ids),
        param=param,
        stream=root_flag(opt.data, "stream"),
        body=rewrite.apply(body),
        headers=headers,
        dialect=opt.dialect,
        dropped=tuple((key, opt.data[key]) for key in ("nvext", "return_token_ids") if key in opt.data),
        capture=capture,
    )


def anthropic_error_body(error: RequestError) -> bytes:
    """vLLM's Anthropic error envelope (what its /v1/messages answers errors in)."""
    return _json.dumps({"type": "error", "error": {"type": "BadRequestError", "message": error.message}})


@dataclass
class CapturedIds:
    """The ids of one chat answer, read as vLLM's Anthropic handler consumes it."""

    completion: list[int] | None = field(default_factory=list)
    prompt: list[int] | None = None
    # The capture tap (`capture.tap.Collector`): told each chat chunk or answer as vLLM made it.
    tap: Any = None

    def add_chunk(self, item: str) -> None:
        """One chat stream event (`data: {...}\\n\\n`)."""
        if not item.startswith("data: {"):
            return
        try:
            chunk = _json.loads(item[6:].strip().encode())
        except ValueError:
            return
        if isinstance(chunk, dict):
            self._add(chunk)

    def add_chunk_object(self, chunk: Any) -> None:
        """One chunk of vLLM's raw chat stream (a ChatCompletionStreamResponse: vLLM 0.33's handler
        turns those objects into Anthropic events itself, so no chat event is ever written)."""
        dump = getattr(chunk, "model_dump", None)
        if dump is not None and getattr(chunk, "choices", None) is not None:
            # What vLLM's chat stream would write of them (exclude_unset): the ids alone, or the whole chunk for
            # the capture tap (its id, model, deltas, finish reason and usage make the turn: docs/capture.md).
            fields = None if self.tap is not None else {"prompt_token_ids": True, "choices": {"__all__": {"token_ids"}}}
            self._add(dump(exclude_unset=True, include=fields))

    def _add(self, chunk: dict[str, Any]) -> None:
        if self.tap is not None:
            self.tap.chunk(chunk)
        prompt = chunk.get("prompt_token_ids")
        if isinstance(prompt, list) and self.prompt is None:
            self.prompt = prompt
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or "token_ids" not in choice:
                continue
            ids = choice["token_ids"]
            if ids is None:
                self.completion = None  # withheld by vLLM: not reported
            elif self.completion is not None:
                self.completion += ids

    def add_answer(self, answer: Any) -> None:
        """A unary chat answer (vLLM's ChatCompletionResponse)."""
        if self.tap is not None and hasattr(answer, "model_dump"):
            self.tap.body(answer.model_dump(mode="json"))
        self.prompt = getattr(answer, "prompt_token_ids", None)
        choices = getattr(answer, "choices", None) or []
        self.completion = getattr(choices[0], "token_ids", None) if choices else None


def place_ids(message: dict[str, Any], ids: CapturedIds, vllm_ids: bool, nvext_trio: bool, nvext_prompt: bool) -> None:
    """The placements of docs/protocol.md §11.2 on a unary message object (in place)."""
    if vllm_ids:
        message[PROMPT_TOKEN_IDS] = ids.prompt
        message["token_ids"] = ids.completion
    if nvext_trio or nvext_prompt:
        nvext: dict[str, Any] = {}
        if nvext_trio:
            nvext[COMPLETION_TOKEN_IDS] = ids.completion
            if message.get("kv_transfer_params") is not None:
                nvext["kv_transfer_params"] = message["kv_transfer_params"]
        nvext[PROMPT_TOKEN_IDS] = ids.prompt
        message["nvext"] = nvext


def place_ids_in_event(event: str, ids: CapturedIds, vllm_ids: bool, nvext_trio: bool, nvext_prompt: bool) -> str:
    """One Anthropic stream event: prompt ids on `message_start` (vLLM placement), the rest on `message_delta`."""
    is_start = event.startswith("event: message_start\n")
    if not (is_start and vllm_ids) and not event.startswith("event: message_delta\n"):
        return event
    head, _, data = event.partition("\ndata: ")
    try:
        obj = _json.loads(data.strip().encode())
    except ValueError:
        return event
    if not isinstance(obj, dict):
        return event
    if is_start:
        message = obj.get("message")
        if not isinstance(message, dict):
            return event
        message[PROMPT_TOKEN_IDS] = ids.prompt
    else:
        if vllm_ids:
            obj["token_ids"] = ids.completion
        if nvext_trio or nvext_prompt:
            nvext: dict[str, Any] = {}
            if nvext_trio:
                nvext[COMPLETION_TOKEN_IDS] = ids.completion
            nvext[PROMPT_TOKEN_IDS] = ids.prompt
            obj["nvext"] = nvext
    return f"{head}\ndata: {_json.dumps(obj).decode()}\n\n"


def _handler_copy(handler: Any, ids: CapturedIds, logprobs: bool = False) -> Any:
    """A per-request copy of vLLM's Anthropic handler: its chat request asks for ids (and with `logprobs`, the
    capture's, the sampled tokens' logprobs: its Anthropic answer has no place for them), its chat answer is read."""
    proxy = copy.copy(handler)
    convert = handler.to_chat_completion_request
    chat = handler.create_chat_completion
    raw = getattr(handler, "chat_completion_stream_generator_raw", None)
    if raw is not None and getattr(chat, "__self__", None) is handler:
        # vLLM 0.33: its stream converter reads the raw chat chunks through `self`: chat runs on the
        # copy, whose raw chat stream is read for the ids on the way.
        chat = chat.__func__.__get__(proxy)

        def chat_completion_stream_generator_raw(*args: Any, **kwargs: Any) -> Any:
            return _tee_objects(raw(*args, **kwargs), ids)

        proxy.chat_completion_stream_generator_raw = chat_completion_stream_generator_raw

    def to_chat_completion_request(*args: Any, **kwargs: Any) -> Any:
        request = convert(*args, **kwargs)
        request.return_token_ids = True
        if logprobs and not request.logprobs:
            request.logprobs = True  # vLLM's default top_logprobs (0): the sampled token's alone
        return request

    async def create_chat_completion(request: Any, raw_request: Any = None) -> Any:
        answer = await chat(request, raw_request)
        if hasattr(answer, "__aiter__"):
            return _tee(answer, ids)
        if hasattr(answer, "choices"):
            ids.add_answer(answer)
        return answer

    proxy.to_chat_completion_request = to_chat_completion_request
    proxy.create_chat_completion = create_chat_completion
    return proxy


async def _tee(events: AsyncIterator[str], ids: CapturedIds) -> AsyncIterator[str]:
    async for item in events:
        ids.add_chunk(item)
        yield item


async def _tee_objects(chunks: AsyncIterator[Any], ids: CapturedIds) -> AsyncIterator[Any]:
    async for chunk in chunks:
        ids.add_chunk_object(chunk)
        yield chunk


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def serve(
    app: ASGIApp,
    scope: Scope,
    receive: Receive,
    send: Send,
    data: dict[str, Any],
    placements: IdPlacements,
    tap: Any = None,
    logprobs: bool = False,
) -> bool:
    """Answer one /v1/messages request with ids through vLLM's own Anthropic handler.

    `data`: the body `receive` replays, which vLLM is to read, with the client's `nvext` /
    `return_token_ids` (which vLLM's model ignores, and its errors count: as in the body sent); `logprobs`: the
    capture asks for the sampled tokens' logprobs (VLLM_NVEXT_CAPTURE_LOGPROBS). A body
    that is not a valid Messages request gets vLLM's own 400 from this one validation.
    False, with nothing sent, when this vLLM has no Anthropic handler to serve it with.
    """
    try:
        from pydantic import ValidationError
        from starlette.requests import Request
        from vllm.entrypoints.anthropic.api_router import translate_error_response  # noqa: F401  (_response's)
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    except ImportError:
        return False
    handler = getattr(getattr(scope.get("app"), "state", None), "anthropic_serving_messages", None)
    needed = ("create_messages", "to_chat_completion_request", "create_chat_completion")
    if handler is None or not all(hasattr(handler, name) for name in needed):
        return False
    try:
        request = AnthropicMessagesRequest.model_validate(data)
    except ValidationError as exc:
        await _refuse_invalid(exc, data, app, scope, receive, send)
        return True
    ids = CapturedIds(tap=tap)
    # As vLLM's route (`with_cancellation`): a client that goes away cancels the work, nothing outlives it.
    served = _handler_copy(handler, ids, logprobs)
    work = asyncio.ensure_future(served.create_messages(request, Request(scope, receive)))
    gone = asyncio.ensure_future(_until_disconnect(receive))
    await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if not work.done():
        work.cancel()
        return True
    try:
        result = work.result()
    except Exception as exc:  # as vLLM's route answers it
        logger.exception("Error in create_messages")
        result = create_error_response(exc)
    await _response(result, ids, placements)(scope, receive, send)
    return True


async def _refuse_invalid(exc: Any, data: Any, app: ASGIApp, scope: Scope, receive: Receive, send: Send) -> None:
    """vLLM's 400 for a body its model refuses, from the errors of the one validation already run.

    As FastAPI hands them to the handler vLLM registered (`loc` under `body`, no `url`), so the answer
    is stock's, without validating the body again. Without that handler, vLLM's route answers it.
    """
    from fastapi.exceptions import RequestValidationError
    from starlette.requests import Request

    handler = getattr(scope.get("app"), "exception_handlers", {}).get(RequestValidationError)
    if handler is None:
        await app(scope, receive, send)
        return
    errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
    response = handler(Request(scope, receive), RequestValidationError(errors, body=data))
    if asyncio.iscoroutine(response):
        response = await response
    await response(scope, receive, send)


def _response(result: Any, ids: CapturedIds, placements: IdPlacements) -> Any:
    """The ASGI response for the handler's result, as vLLM's route makes it, with the ids placed."""
    from starlette.responses import JSONResponse, StreamingResponse
    from vllm.entrypoints.anthropic.api_router import translate_error_response
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesResponse
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    if isinstance(result, ErrorResponse):
        return translate_error_response(result)
    if isinstance(result, AnthropicMessagesResponse):
        message = result.model_dump(exclude_none=True)
        place_ids(message, ids, *placements)
        return JSONResponse(content=message)

    async def events() -> AsyncIterator[str]:
        async for event in result:
            # No ids asked (a captured request): each event as vLLM's handler wrote it.
            yield place_ids_in_event(event, ids, *placements) if any(placements) else event

    return StreamingResponse(content=events(), media_type="text/event-stream")

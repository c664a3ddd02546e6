"""Read token ids out of any response a vllm-nvext (or stock vLLM, or Dynamo) server sends.

One call gives the prompt ids, the generated ids per choice and `kv_transfer_params`, wherever
the server put them (docs/protocol.md §1 and §3):

- ``"vllm"``: vLLM's own placement (`return_token_ids: true`): root `prompt_token_ids` (chat)
  or `choices[i].prompt_token_ids` (completions), `choices[i].token_ids`, root
  `kv_transfer_params`;
- ``"nvext"``: Dynamo's root `nvext` object: `completion_token_ids`, `prompt_token_ids`,
  `kv_transfer_params`;
- ``"engine_data"``: `nvext.engine_data` (`extra_fields: ["engine_data"]`).

Works for chat and completions, unary bodies and streams, plain dicts and OpenAI SDK objects
(the SDK keeps `nvext`, `token_ids` and `prompt_token_ids` as extra attributes, which
`model_dump()` returns). Standard library only::

    from vllm_nvext.client import extract, extract_stream, parse_sse

    ids = extract(client.chat.completions.create(..., extra_body={"return_token_ids": True}))
    ids.prompt_token_ids, ids.completion_token_ids[0], ids.kv_transfer_params

    ids = extract_stream(client.completions.create(..., stream=True, extra_body=...))
    ids = extract_stream(parse_sse(httpx_response.iter_bytes()))
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from .outbound.shapes import choice_logprobs, first_difference
from .outbound.sse import EventFramer, data_payload
from .protocol import Placement

__all__ = [
    "ENGINE_DATA",
    "NVEXT",
    "VLLM",
    "TokenIds",
    "TokenIdsError",
    "extract",
    "extract_stream",
    "first_difference",
    "parse_sse",
]

VLLM = Placement.VLLM.value
NVEXT = Placement.NVEXT.value
ENGINE_DATA = "engine_data"
# When a response carries several placements, the one reported first (all are cross-checked).
_PRECEDENCE = (NVEXT, ENGINE_DATA, VLLM)
_EOL = re.compile(rb"\r\n|\r|\n")


class TokenIdsError(ValueError):
    """The response carries no token ids, carries an error, or its placements disagree."""


@dataclass(frozen=True)
class TokenIds:
    """The token ids of one response (unary) or one whole stream.

    `completion_token_ids[i]` belongs to the choice with `index` i; it is `[]` (no choices)
    when the response carried prompt ids only. For a completions batch (several prompts),
    `prompt_token_ids` is the first choice's prompt.
    """

    prompt_token_ids: list[int] | None
    completion_token_ids: list[list[int]]
    kv_transfer_params: dict[str, Any] | None
    # Where the ids were read: "vllm", "nvext" or "engine_data".
    placement: str
    # Every placement the response carried, in the order nvext, engine_data, vllm (they agreed).
    placements: tuple[str, ...] = ()
    # Per-choice logprobs of the generated tokens, when the response has them.
    completion_logprobs: list[list[float | None]] | None = None
    # Per-choice finish_reason (None while unfinished, e.g. a stream cut short).
    finish_reasons: list[str | None] = field(default_factory=list)


def extract(response: Any) -> TokenIds:
    """Token ids of a unary chat.completion or text_completion.

    `response` may be a dict, an OpenAI SDK object (anything with `model_dump()`), an HTTP
    response object with a `.json()` method (httpx, requests), or the JSON body as str/bytes.
    Raises TokenIdsError for an error body, or a body that carries no token ids.
    """
    acc = _Accumulator()
    acc.add(_as_dict(response))
    return acc.result()


def extract_stream(chunks: Iterable[Any]) -> TokenIds:
    """Token ids of a whole stream: deltas concatenated per choice, prompt ids from wherever sent.

    `chunks` yields decoded chunks: dicts, OpenAI SDK chunk objects (an SDK `Stream` itself
    works), or JSON strings; use `parse_sse` for raw `text/event-stream` bytes. Raises
    TokenIdsError on an error event or a stream that carried no token ids.
    """
    acc = _Accumulator()
    for chunk in chunks:
        acc.add(_as_dict(chunk))
    return acc.result()


def parse_sse(source: bytes | str | Iterable[bytes | str], *, lines: bool = False) -> Iterator[dict[str, Any]]:
    """Decode a `text/event-stream` body into its JSON `data:` payloads; stops at `data: [DONE]`.

    `source` is the whole body, or an iterable of arbitrary byte/str chunks (e.g. httpx's
    `iter_bytes()`); with `lines=True` it is an iterable of lines without their line ends
    (e.g. httpx's `iter_lines()`). LF, CRLF and CR line ends, comments (`: keep-alive`) and
    multi-line `data:` fields are handled as the SSE spec says. Non-JSON payloads raise
    TokenIdsError. Framing is the middleware's own (`vllm_nvext.outbound.sse`): each byte is scanned
    once, however the body is split.
    """
    framer = EventFramer()
    chunks = (_utf8(line) + b"\n" for line in _iterable(source)) if lines else map(_utf8, _iterable(source))
    for chunk in chunks:
        for event in framer.feed(chunk):
            payload = _event_data(event)
            if payload is not None:
                if payload == b"[DONE]":
                    return
                yield _json_payload(payload)
    payload = _event_data(framer.flush())  # an unterminated last event still counts
    if payload is not None and payload != b"[DONE]":
        yield _json_payload(payload)


# --- internals -------------------------------------------------------------------------------


def _iterable(source: bytes | str | Iterable[bytes | str]) -> Iterable[bytes | str]:
    if isinstance(source, (bytearray, memoryview)):
        return [bytes(source)]
    if isinstance(source, (bytes, str)):
        return [source]
    return source


def _utf8(part: bytes | str) -> bytes:
    return part.encode("utf-8") if isinstance(part, str) else bytes(part)


def _event_data(event: bytes) -> bytes | None:
    """The `data` of one framed event (its `data:` lines joined by LF), or None when it has none."""
    span = data_payload(event)
    if span is not None:  # the common case: one `data:` line
        return event[span[0] : span[1]]
    data: list[bytes] = []
    for line in _EOL.split(event):
        if not line or line.startswith(b":"):
            continue  # the blank terminator, or a comment such as a keep-alive
        name, _, value = line.partition(b":")
        if name == b"data":
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


def _json_payload(payload: bytes | str) -> dict[str, Any]:
    try:
        obj = json.loads(payload)
    except ValueError as exc:  # UnicodeDecodeError included
        raise TokenIdsError(f"stream event is not JSON: {_preview(payload)!r}") from exc
    if not isinstance(obj, dict):
        raise TokenIdsError(f"stream event is not a JSON object: {_preview(payload)!r}")
    return obj


def _preview(payload: bytes | str) -> str:
    text = payload if isinstance(payload, str) else payload[:200].decode("utf-8", "replace")
    return text[:200]


def _as_dict(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (str, bytes, bytearray)):
        return _json_payload(obj if isinstance(obj, str) else bytes(obj).decode("utf-8"))
    dump = getattr(obj, "model_dump", None)
    if callable(dump):  # pydantic v2 / OpenAI SDK; extra fields (nvext, token_ids) included
        result = dump()
    else:
        as_json = getattr(obj, "json", None)
        if not callable(as_json):
            raise TypeError(f"cannot read token ids from {type(obj).__name__}: expected a dict or a response object")
        result = as_json()
        if isinstance(result, (str, bytes, bytearray)):  # pydantic v1's .json() returns text
            return _as_dict(result)
    if not isinstance(result, Mapping):
        raise TokenIdsError(f"response is not a JSON object: {type(result).__name__}")
    return dict(result)


def _int_list(value: Any, where: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TokenIdsError(f"`{where}` is not a list of integers: {value!r:.200}")
    return list(value)


class _Accumulator:
    """Collects every placement over one body or all chunks of a stream, then cross-checks them."""

    def __init__(self) -> None:
        self.root_prompt: list[int] | None = None
        self.choice_prompts: dict[int, list[int]] = {}
        self.vllm_ids: dict[int, list[int]] = {}
        self.vllm_logprobs: dict[int, list[float | None]] = {}
        self.nvext_prompt: list[int] | None = None
        self.nvext_ids: list[int] | None = None
        self.nvext_kv: dict[str, Any] | None = None
        self.engine: Mapping[str, Any] | None = None
        self.root_kv: dict[str, Any] | None = None
        self.finish: dict[int, str | None] = {}
        self.objects = 0

    def add(self, obj: dict[str, Any]) -> None:
        error = obj.get("error")
        if error is not None and "choices" not in obj:
            message = error.get("message") if isinstance(error, Mapping) else error
            raise TokenIdsError(f"the server answered with an error: {message}")
        if "message" in obj and "choices" not in obj and "code" in obj:  # Dynamo's flat error body
            raise TokenIdsError(f"the server answered with an error: {obj['message']}")
        self.objects += 1
        root_prompt = _int_list(obj.get("prompt_token_ids"), "prompt_token_ids")
        if root_prompt is not None and self.root_prompt is None:  # chat streams: first chunk only
            self.root_prompt = root_prompt
        kv = obj.get("kv_transfer_params")
        if isinstance(kv, Mapping):
            self.root_kv = dict(kv)
        choices = obj.get("choices")
        for position, choice in enumerate(choices if isinstance(choices, list) else ()):
            if not isinstance(choice, Mapping):
                continue
            index = choice.get("index", position)
            index = index if isinstance(index, int) else position
            prompt = _int_list(choice.get("prompt_token_ids"), f"choices[{index}].prompt_token_ids")
            if prompt is not None:  # completions streams: that choice's first chunk only
                self.choice_prompts.setdefault(index, prompt)
            ids = _int_list(choice.get("token_ids"), f"choices[{index}].token_ids")
            if ids is not None:
                self.vllm_ids.setdefault(index, []).extend(ids)
            logprobs = choice_logprobs(choice if isinstance(choice, dict) else dict(choice))
            if logprobs is not None:
                self.vllm_logprobs.setdefault(index, []).extend(logprobs)
            reason = choice.get("finish_reason")
            if reason is not None:
                self.finish[index] = str(reason)
            else:
                self.finish.setdefault(index, None)
        nvext = obj.get("nvext")
        if isinstance(nvext, Mapping):
            ids = _int_list(nvext.get("completion_token_ids"), "nvext.completion_token_ids")
            if ids is not None:
                if self.nvext_ids is None:
                    self.nvext_ids = []
                self.nvext_ids.extend(ids)
            prompt = _int_list(nvext.get("prompt_token_ids"), "nvext.prompt_token_ids")
            if prompt is not None:
                self.nvext_prompt = prompt
            kv = nvext.get("kv_transfer_params")
            if isinstance(kv, Mapping):
                self.nvext_kv = dict(kv)
            engine = nvext.get("engine_data")
            if isinstance(engine, Mapping):
                self.engine = engine

    def _candidates(self) -> dict[str, tuple[list[int] | None, list[list[int]] | None]]:
        found: dict[str, tuple[list[int] | None, list[list[int]] | None]] = {}
        if self.nvext_ids is not None or self.nvext_prompt is not None:
            found[NVEXT] = (self.nvext_prompt, [self.nvext_ids] if self.nvext_ids is not None else None)
        if self.engine is not None:
            ids = _int_list(self.engine.get("completion_token_ids"), "nvext.engine_data.completion_token_ids")
            prompt = _int_list(self.engine.get("prompt_token_ids"), "nvext.engine_data.prompt_token_ids")
            found[ENGINE_DATA] = (prompt, [ids] if ids is not None else None)
        prompt = self.root_prompt
        if prompt is None and self.choice_prompts:
            prompt = self.choice_prompts[min(self.choice_prompts)]
        if self.vllm_ids or prompt is not None:
            width = max(self.vllm_ids, default=-1) + 1
            per_choice = [self.vllm_ids.get(i, []) for i in range(width)] if self.vllm_ids else None
            found[VLLM] = (prompt, per_choice)
        return found

    def result(self) -> TokenIds:
        if not self.objects:
            raise TokenIdsError("the stream carried no events (an error answered without `data:` events?)")
        found = self._candidates()
        if not found:
            raise TokenIdsError(
                "the response carries no token ids: ask for them with `return_token_ids: true` or "
                '`nvext.extra_fields: ["completion_token_ids"]`'
            )
        placements = tuple(p for p in _PRECEDENCE if p in found)
        primary = placements[0]
        prompt, completions = found[primary]
        for other in placements[1:]:
            o_prompt, o_completions = found[other]
            if prompt is None:
                prompt = o_prompt
            elif o_prompt is not None and o_prompt != prompt:
                raise TokenIdsError(
                    f"prompt ids differ between placements {primary} and {other}: {first_difference(prompt, o_prompt)}"
                )
            if completions is None:
                completions = o_completions
            elif o_completions is not None and o_completions[0] != completions[0]:
                raise TokenIdsError(
                    f"completion ids differ between placements {primary} and {other}: "
                    f"{first_difference(completions[0], o_completions[0])}"
                )
        width = max(len(completions or ()), max(self.finish, default=-1) + 1)
        completion_ids = list(completions or [])
        if completions is not None:  # choices the server sent no delta for generated nothing
            completion_ids += [[] for _ in range(width - len(completion_ids))]
        return TokenIds(
            prompt_token_ids=prompt,
            completion_token_ids=completion_ids,
            kv_transfer_params=self.nvext_kv if self.nvext_kv is not None else self.root_kv,
            placement=primary,
            placements=placements,
            completion_logprobs=self._logprobs(width),
            finish_reasons=[self.finish.get(i) for i in range(width)],
        )

    def _logprobs(self, width: int) -> list[list[float | None]] | None:
        if self.engine is not None and isinstance(self.engine.get("completion_logprobs"), list):
            return [list(self.engine["completion_logprobs"])] + [[] for _ in range(width - 1)]
        if self.vllm_logprobs:
            return [self.vllm_logprobs.get(i, []) for i in range(width)]
        return None


def read_session(
    base_url: str, session_id: str, *, api_key: str | None = None, format: str = "json", timeout: float = 60.0
) -> dict[str, Any]:
    """A captured session from a vllm-nvext server (`GET /v1/nvext/sessions/{id}`, docs/capture.md).

    `format="json"`: `{"session_id", "turns": [...]}` with every turn (the pages the server sends
    are followed); `format="atif"`: the ATIF trajectory (its first page; `extra.next_index` names
    the next). Raises `urllib.error.HTTPError` for an error answer (404: no such session). Standard
    library only::

        from vllm_nvext.client import read_session

        turns = read_session("http://127.0.0.1:8000", "my-agent-run", api_key="KEY")["turns"]
    """
    from urllib.parse import quote, urlencode
    from urllib.request import Request, urlopen

    headers = {"Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    base = f"{base_url.rstrip('/')}/v1/nvext/sessions/{quote(session_id, safe='')}"
    session: dict[str, Any] | None = None
    start: int | None = 0
    while start is not None:
        query = urlencode({"format": format, **({"start": start} if start else {})})
        with urlopen(Request(f"{base}?{query}", headers=headers), timeout=timeout) as answer:  # noqa: S310
            page = json.loads(answer.read())
        if format != "json":
            return dict(page)
        if session is None:
            session = {"session_id": page["session_id"], "turns": []}
        session["turns"].extend(page["turns"])
        start = page.get("next_index")
    assert session is not None
    return session

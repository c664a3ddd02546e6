"""Comparing vllm-nvext's `nvext` answers with a real NVIDIA Dynamo's, case by case (pure).

The same request bytes go to a Dynamo frontend and to vllm-nvext; per case the two answers are
reduced to what an nvext client can rely on: status; per stream, which `nvext` keys (in order)
ride on which kind of chunk -- judged by the chunk's own content (a delta, a choice's finish
chunk, the usage-only chunk), never by where chunk boundaries fall; key order inside `nvext`,
`engine_data` and `timing`; JSON types; and the values that must agree (all ids, prompt ids,
logprobs, stop_reason, finish reasons). Every remaining difference must be on the allow-list in
`vllm_nvext.tools.dynamo_differences` (the table of docs/dynamo-differences.md).

Used by the conformance tests (tests/e2e/test_dynamo_conformance.py) and by
`vllm-nvext parity --dynamo-url`. Nothing here does I/O: callers send `Case.content()` and read
the reply with `parse_answer`.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any

from ..outbound.shapes import choice_logprobs
from ..protocol import (
    COMPLETION_TOKEN_IDS,
    DETAILED_FINISH_REASON,
    ENGINE_DATA,
    PATHS,
    PROMPT_TOKEN_IDS,
    STOP_REASON,
    TIMING,
    WORKER_ID,
    Endpoint,
)
from . import dynamo_differences

CHAT, COMPLETIONS = PATHS[Endpoint.CHAT], PATHS[Endpoint.COMPLETIONS]
# The selectors the cases ask for all at once, and one by one with n=2.
SIX = (COMPLETION_TOKEN_IDS, PROMPT_TOKEN_IDS, ENGINE_DATA, TIMING, STOP_REASON, DETAILED_FINISH_REASON)
TOKEN_DATA = [257, 84, 82, 68, 81, 198, 39, 68, 75, 75, 78, 258, 198, 257, 64]
# The tiny model's greedy continuations: chat "Say something." -> ")+b..." (ids 8, 10, 65, ...),
# completions "Once upon a time" -> ids 248, 21 ("6"), ...; these prompts end in its EOS (258).
# On another model the same requests are still valid; the stop cases then may not stop early.
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6},
    COMPLETIONS: {"prompt": "Once upon a time", "max_tokens": 6},
}
STOP = {CHAT: ("b", 65), COMPLETIONS: ("6", 21)}
EOS_PROMPT: dict[str, dict[str, Any]] = {
    CHAT: {"messages": [{"role": "user", "content": "Tell Once"}]},
    COMPLETIONS: {"prompt": "something Once"},
}
LOGPROBS: dict[str, dict[str, Any]] = {CHAT: {"logprobs": True}, COMPLETIONS: {"logprobs": 1}}
TRANSPORTS: dict[str, dict[str, Any]] = {
    "unary": {},
    "stream": {"stream": True},
    "usage": {"stream": True, "stream_options": {"include_usage": True}},
}
SAMPLING_SEED = 11  # sampled (n=2) cases are seeded, so both servers draw the same tokens


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    def content(self) -> bytes:
        """The exact request bytes sent to both servers."""
        return json.dumps(self.body).encode()


def _nvext(*selectors: str, **fields: Any) -> dict[str, Any]:
    return {"nvext": {"extra_fields": list(selectors), **fields}}


def cases(model: str) -> list[Case]:
    """The case matrix, for the served model `model`.

    Chat and completions; unary, stream, stream with usage; completion ids only, all six
    selectors, logprobs + engine_data, stop string, stop token id, EOS, token_data, worker_id;
    n=2 with each selector (temperature > 0, seeded); unknown/mistyped nvext keys; a completions
    batch.
    """
    out: list[Case] = []
    for path, ep in ((CHAT, "chat"), (COMPLETIONS, "completions")):
        base: dict[str, Any] = {"model": model, **BASE[path]}
        greedy = {**base, "temperature": 0}
        stop_text, stop_id = STOP[path]
        kinds: dict[str, dict[str, Any]] = {
            "ids": _nvext(COMPLETION_TOKEN_IDS),
            "six": _nvext(*SIX),
            "logprobs-engine": {**LOGPROBS[path], **_nvext(ENGINE_DATA)},
            "stop-string": {"stop": [stop_text], **_nvext(*SIX)},
            "stop-token": {"stop_token_ids": [stop_id], **_nvext(*SIX)},
            "eos": {**EOS_PROMPT[path], "max_tokens": 10, **_nvext(*SIX)},
            "token-data": _nvext(COMPLETION_TOKEN_IDS, ENGINE_DATA, token_data=TOKEN_DATA),
            "worker-id": _nvext(WORKER_ID, TIMING),
        }
        if path == CHAT:
            kinds["token-data"]["messages"] = [{"role": "user", "content": "(token_data)"}]
        for kind, extra in kinds.items():
            for transport, t_extra in TRANSPORTS.items():
                out.append(Case(f"{ep}-{kind}-{transport}", path, {**greedy, **extra, **t_extra}))
        sampled = {**base, "n": 2, "temperature": 0.8, "seed": SAMPLING_SEED}
        for selector in SIX:
            for transport in ("unary", "stream"):
                body = {**sampled, **_nvext(selector), **TRANSPORTS[transport]}
                out.append(Case(f"{ep}-n2-{selector}-{transport}", path, body))
        out.append(Case(f"{ep}-unknown-key", path, {**greedy, "nvext": {"extra_fields": [TIMING], "bogus_key": 1}}))
        out.append(Case(f"{ep}-mistyped-key", path, {**greedy, "nvext": {"extra_fields": TIMING}}))
    batch: dict[str, Any] = {
        "model": model,
        **BASE[COMPLETIONS],
        "temperature": 0,
        "prompt": ["Once upon a time", "Say"],
    }
    out.append(Case("completions-batch-ids", COMPLETIONS, {**batch, **_nvext(COMPLETION_TOKEN_IDS)}))
    out.append(Case("completions-batch-engine_data", COMPLETIONS, {**batch, **_nvext(ENGINE_DATA)}))
    out.append(Case("completions-batch-timing", COMPLETIONS, {**batch, **_nvext(TIMING, STOP_REASON)}))
    return out


# --- an answer, reduced to what an nvext client relies on ---------------------------------------


@dataclass
class Answer:
    status: int
    body: Any = None  # unary JSON, or the error body
    events: list[Any] = field(default_factory=list)  # stream JSON events before [DONE]


class AnswerError(ValueError):
    """A 200 answer that cannot be read as the case's shape (not JSON, a stream without [DONE])."""


def parse_answer(status: int, content: bytes, stream: bool) -> Answer:
    """Read one reply: a unary or error body as JSON (or text), a 200 stream as its `data:` events."""
    if status != 200 or not stream:
        try:
            body: Any = json.loads(content)
        except ValueError:
            body = content.decode("utf-8", "replace")
        if status == 200 and not isinstance(body, dict):
            raise AnswerError(f"the 200 answer is not a JSON object: {str(body)[:80]!r}")
        return Answer(status, body=body)
    if not content.rstrip(b"\r\n").endswith(b"data: [DONE]"):
        raise AnswerError("the stream does not end with data: [DONE]")
    events = []
    for block in content.replace(b"\r\n", b"\n").split(b"\n\n"):
        lines = [line for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines and lines[0][5:].strip() != b"[DONE]":
            try:
                event = json.loads(lines[0][5:].strip())
            except ValueError as exc:
                raise AnswerError(f"a stream event is not JSON: {exc}") from None
            if not isinstance(event, dict):
                raise AnswerError(f"a stream event is not a JSON object: {event!r}")
            events.append(event)
    return Answer(status, events=events)


def set_aside(answer: Answer, paths: list[str]) -> Answer:
    """A copy of the answer without these `nvext` key paths (allowed differences)."""
    if not paths:
        return answer
    copy = Answer(answer.status, json.loads(json.dumps(answer.body)), json.loads(json.dumps(answer.events)))
    for obj in [copy.body, *copy.events]:
        nv = obj.get("nvext") if isinstance(obj, dict) else None
        if not isinstance(nv, dict):
            continue
        for path in paths:
            *parents, leaf = path.split(".")
            owner: Any = nv
            for key in parents:
                owner = owner.get(key) if isinstance(owner, dict) else None
            if isinstance(owner, dict):
                owner.pop(leaf, None)
        for key in [k for k, v in nv.items() if v == {}]:
            del nv[key]  # an object left empty is not written
        if not nv:
            del obj["nvext"]  # nor is an empty nvext
    return copy


def json_shape(value: Any) -> Any:
    """A JSON value's shape: key order and types, list items collapsed to their distinct shapes."""
    if isinstance(value, dict):
        return {k: json_shape(v) for k, v in value.items()}
    if isinstance(value, list):
        shapes: list[Any] = []
        for item in value:
            shape = json_shape(item)
            if shape not in shapes:
                shapes.append(shape)
        return ["list", *shapes]
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return type(value).__name__


def f32(values: Any) -> Any:
    """Logprobs at float32 precision: Dynamo's frontend writes the choices' logprobs as f32."""
    if not isinstance(values, list):
        return values
    return [struct.unpack("f", struct.pack("f", v))[0] if isinstance(v, float) else v for v in values]


def _has_content(choice: dict[str, Any]) -> bool:
    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
    return bool(text) or bool(choice.get("token_ids"))


def _nvext_values(prefix: str, nv: Any, out: dict[str, Any]) -> None:
    """The values that must agree; timing's are measurements (only their keys and types count)."""
    if not isinstance(nv, dict):
        return
    for key, value in nv.items():
        if key == TIMING:
            continue
        if key == ENGINE_DATA and isinstance(value, dict):
            value = {**value, "completion_logprobs": f32(value.get("completion_logprobs"))}
            value = {k: v for k, v in value.items() if v is not None}
        out[f"{prefix}.{key}"] = value


def facts(case: Case, answer: Answer) -> dict[str, Any]:
    """Everything compared for one case, as {aspect: value}.

    Streams are judged chunk by chunk by each chunk's own content -- a delta (generated text or
    ids), a choice's finish chunk, the usage-only chunk, an error event -- and by per-choice
    concatenations, never by where the chunk boundaries fall.
    """
    out: dict[str, Any] = {"status": answer.status}
    if answer.status != 200:
        body = answer.body
        out["error_shape"] = sorted(body) if isinstance(body, dict) else type(body).__name__
        return out
    if not case.stream:
        body = answer.body if isinstance(answer.body, dict) else {}
        nv = body.get("nvext")
        out["nvext.keys"] = list(nv) if isinstance(nv, dict) else None
        out["nvext.types"] = json_shape(nv)
        for i, choice in enumerate(body.get("choices") or []):
            out[f"choice{i}.finish_reason"] = choice.get("finish_reason")
            out[f"choice{i}.logprobs"] = f32(choice_logprobs(choice))
            out[f"choice{i}.nvext_inside_choice"] = "nvext" in choice
        _nvext_values("nvext", nv, out)
        return out
    kinds: dict[str, list[Any]] = {}
    per_choice: dict[int, dict[str, Any]] = {}
    for event in answer.events:
        choices = event.get("choices")
        nv = event.get("nvext")
        if not isinstance(choices, list):
            kind = "error"
        elif not choices:
            kind = "usage"
        elif any(c.get("finish_reason") is not None for c in choices):
            kind = "finish"
        elif any(_has_content(c) for c in choices) or nv is not None:
            kind = "delta"
        else:
            continue  # no generated content and no nvext: nothing an nvext client reads
        shape = [list(nv) if isinstance(nv, dict) else None, json_shape(nv) if kind != "delta" else None]
        seen = kinds.setdefault(kind, [])
        if shape not in seen:
            seen.append(shape)
        for choice in choices or []:
            state = per_choice.setdefault(choice.get("index", 0), {"ids": [], "finish": None, "final": None})
            if isinstance(nv, dict) and isinstance(nv.get(COMPLETION_TOKEN_IDS), list) and len(choices) == 1:
                state["ids"].extend(nv[COMPLETION_TOKEN_IDS])
            if choice.get("finish_reason") is not None:
                state["finish"] = choice["finish_reason"]
                state["final"] = nv
            if "nvext" in choice:
                out["nvext_inside_choice"] = True
    for kind, shapes in kinds.items():
        out[f"{kind}.nvext"] = sorted(shapes, key=json.dumps)
    for index, state in sorted(per_choice.items()):
        out[f"choice{index}.finish_reason"] = state["finish"]
        out[f"choice{index}.nvext.completion_token_ids(concatenated)"] = state["ids"]
        final = state["final"]
        if isinstance(final, dict):
            final = {k: v for k, v in final.items() if k != COMPLETION_TOKEN_IDS}
        _nvext_values(f"choice{index}.finish.nvext", final, out)
    return out


class _Missing:
    def __repr__(self) -> str:
        return "<absent>"


_MISSING = _Missing()


def unexplained_differences(case: Case, dynamo: Answer, ours: Answer) -> list[str]:
    """Every difference between the two answers that the allow-list does not explain, in order."""
    allowed = dynamo_differences.find(case.body)
    dynamo = set_aside(dynamo, [p for d in allowed for p in d.dynamo_only])
    ours = set_aside(ours, [p for d in allowed for p in d.nvext_only])
    expected, got = facts(case, dynamo), facts(case, ours)
    aspects = {a for d in allowed for a in d.aspects}
    if "status" in aspects and expected["status"] != got["status"]:
        return []  # an allowed refusal: nothing else to compare
    out = []
    for aspect in [*expected, *(k for k in got if k not in expected)]:
        theirs, mine = expected.get(aspect, _MISSING), got.get(aspect, _MISSING)
        if aspect == "delta.nvext" and _MISSING in (theirs, mine):
            # A server that lags merges a stream's deltas into its finish chunk: then there is no
            # content-only chunk to judge, and the finish chunk and the concatenations still are.
            continue
        if theirs != mine and aspect not in aspects:
            theirs_text, mine_text = json.dumps(theirs, default=repr), json.dumps(mine, default=repr)
            out.append(f"{aspect}: Dynamo {theirs_text} vs vllm-nvext {mine_text}")
    return out

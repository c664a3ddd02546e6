"""A Dynamo client cannot tell vllm-nvext from a real NVIDIA Dynamo 1.6.1 by its `nvext` answers.

The same request bytes go to a real Dynamo (its frontend + its `dynamo.vllm` worker on the same
vLLM and tiny model, tests/dynamo_reference.py) and to `vllm serve` + vllm-nvext (in `nvext`
mode and in `auto` mode). Per case the answers are reduced to what an nvext client can rely on:
status; per stream, which `nvext` keys (in order) ride on which kind of chunk -- judged by the
chunk's own content (a delta, a choice's finish chunk, the usage-only chunk), never by where
chunk boundaries fall; key order inside `nvext`, `engine_data` and `timing`; JSON types; and the
values that must agree (all ids, prompt ids, logprobs, stop_reason, finish reasons). Every
remaining difference must be on the allow-list in `vllm_nvext.dynamo_differences`, which is also
the README's "Differences from Dynamo 1.6.1" table; a new difference fails.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from vllm_nvext import dynamo_differences

pytestmark = pytest.mark.e2e

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
SIX = ("completion_token_ids", "prompt_token_ids", "engine_data", "timing", "stop_reason", "detailed_finish_reason")
TOKEN_DATA = [257, 84, 82, 68, 81, 198, 39, 68, 75, 75, 78, 258, 198, 257, 64]
# The tiny model's greedy continuations: chat "Say something." -> ")+b..." (ids 8, 10, 65, ...),
# completions "Once upon a time" -> ids 248, 21 ("6"), ...; these prompts end in its EOS (258).
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6},
    COMPLETIONS: {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 6},
}
STOP = {CHAT: ("b", 65), COMPLETIONS: ("6", 21)}
EOS_PROMPT = {CHAT: {"messages": [{"role": "user", "content": "Tell Once"}]}, COMPLETIONS: {"prompt": "something Once"}}
LOGPROBS = {CHAT: {"logprobs": True}, COMPLETIONS: {"logprobs": 1}}
TRANSPORTS: dict[str, dict[str, Any]] = {
    "unary": {},
    "stream": {"stream": True},
    "usage": {"stream": True, "stream_options": {"include_usage": True}},
}


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def _nvext(*selectors: str, **fields: Any) -> dict[str, Any]:
    return {"nvext": {"extra_fields": list(selectors), **fields}}


def _cases() -> list[Case]:
    out: list[Case] = []
    for path, ep in ((CHAT, "chat"), (COMPLETIONS, "completions")):
        greedy = {**BASE[path], "temperature": 0}
        stop_text, stop_id = STOP[path]
        kinds: dict[str, dict[str, Any]] = {
            "ids": _nvext("completion_token_ids"),
            "six": _nvext(*SIX),
            "logprobs-engine": {**LOGPROBS[path], **_nvext("engine_data")},
            "stop-string": {"stop": [stop_text], **_nvext(*SIX)},
            "stop-token": {"stop_token_ids": [stop_id], **_nvext(*SIX)},
            "eos": {**EOS_PROMPT[path], "max_tokens": 10, **_nvext(*SIX)},
            "token-data": _nvext("completion_token_ids", "engine_data", token_data=TOKEN_DATA),
            "worker-id": _nvext("worker_id", "timing"),
        }
        if path == CHAT:
            kinds["token-data"]["messages"] = [{"role": "user", "content": "(token_data)"}]
        for kind, extra in kinds.items():
            for transport, t_extra in TRANSPORTS.items():
                out.append(Case(f"{ep}-{kind}-{transport}", path, {**greedy, **extra, **t_extra}))
        sampled = {**BASE[path], "n": 2, "temperature": 0.8, "seed": 11}
        for selector in SIX:
            for transport in ("unary", "stream"):
                body = {**sampled, **_nvext(selector), **TRANSPORTS[transport]}
                out.append(Case(f"{ep}-n2-{selector}-{transport}", path, body))
        out.append(Case(f"{ep}-unknown-key", path, {**greedy, "nvext": {"extra_fields": ["timing"], "bogus_key": 1}}))
        out.append(Case(f"{ep}-mistyped-key", path, {**greedy, "nvext": {"extra_fields": "timing"}}))
    batch = {**BASE[COMPLETIONS], "temperature": 0, "prompt": ["Once upon a time", "Say"]}
    out.append(Case("completions-batch-ids", COMPLETIONS, {**batch, **_nvext("completion_token_ids")}))
    out.append(Case("completions-batch-engine_data", COMPLETIONS, {**batch, **_nvext("engine_data")}))
    out.append(Case("completions-batch-timing", COMPLETIONS, {**batch, **_nvext("timing", "stop_reason")}))
    return out


CASES = _cases()


# --- capture: one answer reduced to what an nvext client relies on -----------------------------


@dataclass
class Answer:
    status: int
    body: Any = None  # unary JSON, or the error body
    events: list[Any] = field(default_factory=list)  # stream JSON events before [DONE]


def exchange(client: httpx.Client, case: Case, headers: dict[str, str] | None = None) -> Answer:
    """POST the case's exact bytes; a stream is read as its `data:` JSON events."""
    content = json.dumps(case.body).encode()
    resp = client.post(case.path, content=content, headers={"content-type": "application/json", **(headers or {})})
    if resp.status_code != 200 or not case.stream:
        try:
            body = resp.json()
        except ValueError:
            body = resp.text
        return Answer(resp.status_code, body=body)
    assert resp.content.endswith(b"data: [DONE]\n\n"), "a stream ends with [DONE]"
    events = []
    for block in resp.content.split(b"\n\n"):
        lines = [line for line in block.split(b"\n") if line.startswith(b"data:")]
        if lines and lines[0][5:].strip() != b"[DONE]":
            events.append(json.loads(lines[0][5:].strip()))
    return Answer(resp.status_code, events=events)


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


def _type(value: Any) -> Any:
    """A JSON value's shape: key order and types, list items collapsed to their distinct shapes."""
    if isinstance(value, dict):
        return {k: _type(v) for k, v in value.items()}
    if isinstance(value, list):
        shapes: list[Any] = []
        for item in value:
            shape = _type(item)
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


def _f32(values: Any) -> Any:
    """Logprobs at float32 precision: Dynamo's frontend writes the choices' logprobs as f32."""
    if not isinstance(values, list):
        return values
    return [struct.unpack("f", struct.pack("f", v))[0] if isinstance(v, float) else v for v in values]


def _choice_logprobs(path: str, choice: dict[str, Any]) -> Any:
    lp = choice.get("logprobs")
    if not isinstance(lp, dict):
        return None
    return [c.get("logprob") for c in lp.get("content") or []] if path == CHAT else lp.get("token_logprobs")


def _has_content(choice: dict[str, Any]) -> bool:
    text = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
    return bool(text) or bool(choice.get("token_ids"))


def _nvext_values(prefix: str, nv: Any, out: dict[str, Any]) -> None:
    """The values that must agree; timing's are measurements (only their keys and types count)."""
    if not isinstance(nv, dict):
        return
    for key, value in nv.items():
        if key == "timing":
            continue
        if key == "engine_data" and isinstance(value, dict):
            value = {**value, "completion_logprobs": _f32(value.get("completion_logprobs"))}
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
        body = answer.body
        nv = body.get("nvext")
        out["nvext.keys"] = list(nv) if isinstance(nv, dict) else None
        out["nvext.types"] = _type(nv)
        for i, choice in enumerate(body.get("choices") or []):
            out[f"choice{i}.finish_reason"] = choice.get("finish_reason")
            out[f"choice{i}.logprobs"] = _f32(_choice_logprobs(case.path, choice))
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
        shape = [list(nv) if isinstance(nv, dict) else None, _type(nv) if kind != "delta" else None]
        seen = kinds.setdefault(kind, [])
        if shape not in seen:
            seen.append(shape)
        for choice in choices or []:
            state = per_choice.setdefault(choice.get("index", 0), {"ids": [], "finish": None, "final": None})
            if isinstance(nv, dict) and isinstance(nv.get("completion_token_ids"), list) and len(choices) == 1:
                state["ids"].extend(nv["completion_token_ids"])
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
            final = {k: v for k, v in final.items() if k != "completion_token_ids"}
        _nvext_values(f"choice{index}.finish.nvext", final, out)
    return out


class _Missing:
    def __repr__(self) -> str:
        return "<absent>"


_MISSING = _Missing()


def unexplained_differences(case: Case, dynamo: Answer, ours: Answer) -> list[str]:
    """Every difference between the two answers that the allow-list does not explain."""
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
        if theirs != mine and aspect not in aspects:
            theirs_text, mine_text = json.dumps(theirs, default=repr), json.dumps(mine, default=repr)
            out.append(f"{aspect}: Dynamo {theirs_text} vs vllm-nvext {mine_text}")
    return out


# --- the test ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dynamo_pair(dynamo_server: Any, nvext_dynamo_server: Any) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    with (
        httpx.Client(base_url=dynamo_server.url, timeout=120.0) as dyn,
        httpx.Client(base_url=nvext_dynamo_server.url, timeout=120.0) as ours,
    ):
        yield dyn, ours


@pytest.mark.parametrize("mode", ["nvext", "auto"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_nvext_answer_matches_dynamo(dynamo_pair: tuple[httpx.Client, httpx.Client], case: Case, mode: str) -> None:
    dyn, ours = dynamo_pair
    dynamo_answer = exchange(dyn, case)
    assert dynamo_answer.status in (200, 400), f"the reference Dynamo failed: {dynamo_answer.body}"
    ours_answer = exchange(ours, case, {"x-nvext-mode": mode})
    unexplained = unexplained_differences(case, dynamo_answer, ours_answer)
    assert not unexplained, (
        f"{case.name} ({mode} mode) differs from Dynamo {dynamo_differences.DYNAMO_VERSION} in ways "
        "vllm_nvext/dynamo_differences.py does not list:\n" + "\n".join(unexplained)
    )

"""Pure response side: reshape vLLM's decoded unary bodies and stream chunks as a Plan says.

Bytes and SSE framing live in `stream.py` and `unary.py`; this module only sees parsed JSON.

vLLM placement (docs/protocol.md §1) is what vLLM writes; nvext placement (§3) is a root
`nvext` object. Only what the middleware caused is removed: a vLLM copy is set back to
`null`, exactly what vLLM writes when `return_token_ids` is off.
"""

from __future__ import annotations

import re
from typing import Any

from .. import _json
from ..inbound.plan import Plan
from ..protocol import (
    ENGINE_DATA,
    TIMING,
)
from .moves import (
    final_nvext,
    prompt_ids_in,
    put_back_echo,
    reported_ids,
    strip_logprobs,
    strip_vllm_ids,
    take_kv,
    take_prompt_logprobs,
    take_routed_experts,
)
from .nvext_values import Clock, engine_data, kv_cache_hit, timing
from .prompt_ids import PromptIds
from .shapes import choice_logprobs

_LIST = ord("[")


def reshape_unary(obj: Any, plan: Plan, clock: Clock) -> bool:
    """Reshape a unary chat.completion / text_completion in place; False if left unchanged.

    With several choices (n > 1) the one root `nvext` describes the last choice, as Dynamo's
    answer does when its choices finish together (it keeps the last choice to finish).
    """
    if not isinstance(obj, dict):
        return False
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[-1], dict):
        return False
    choice = choices[-1]
    prompt_ids = prompt_ids_in(obj, choice, plan.endpoint)
    completion_ids = reported_ids(choice)
    kv = take_kv(obj, plan) if plan.nvext_trio else None
    prompt_logprobs = take_prompt_logprobs(obj, choice, plan)
    routed_experts = take_routed_experts(choice, plan)
    engine = None
    if ENGINE_DATA in plan.nvext_only_selectors:
        engine = engine_data(
            prompt_ids=prompt_ids,
            cache_hit=kv_cache_hit(prompt_ids, obj.get("usage")) if len(choices) == 1 else None,
            prompt_logprobs=prompt_logprobs,
            kv_transfer_params=obj.get("kv_transfer_params") if kv is None else kv,
            routed_experts=routed_experts,
            completion_ids=None if completion_ids is None else list(completion_ids),
            finished=True,
            logprobs=choice_logprobs(choice) if plan.logprobs_requested else None,
        )
    nv = final_nvext(
        plan,
        unary=True,
        completion_ids=completion_ids if plan.nvext_trio else None,
        prompt_ids=prompt_ids,
        kv=kv,
        timing_obj=timing(clock, None, obj.get("metrics")) if TIMING in plan.nvext_only_selectors else None,
        engine=engine,
        choice=choice,
        prompt_logprobs=prompt_logprobs,
        routed_experts=routed_experts,
    )
    if plan.strip_vllm_ids:
        strip_vllm_ids(obj, choices, plan)
    if plan.strip_logprobs:
        strip_logprobs(choices)
    if plan.echo_prompts:
        for each in choices:
            if isinstance(each, dict):
                put_back_echo(each, plan)
    if nv:
        obj["nvext"] = nv
    return True


# vLLM's errors about a field that name no `param`, told apart by the whole of vLLM's message
# template, never by a word a client could write into a message (a model name, a logit_bias key).
_TEMPLATES = {
    # an out-of-vocabulary id in a completions prompt
    "prompt": re.compile(r"Token id -?[0-9]+ is out of vocabulary"),
    # vLLM's messages about thinking_token_budget begin with its name
    "thinking_token_budget": re.compile(r"`?thinking_token_budget`? [^\n]*"),
}


def rename_error(obj: Any, plan: Plan) -> bool:
    """Make vLLM's error about a field the middleware set name the client's field instead; False if unchanged.

    vLLM names the field it validated in `param` (`kv_transfer_params.prompt_token_ids` for ids
    sent as `nvext.token_data`); where its `param` is null, the whole message must be one of
    vLLM's templates about the field (`_TEMPLATES`). Unary error bodies and the error events of a
    stream alike.
    """
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        return False
    param, message = error.get("param"), error.get("message")
    for vllm_field, client_field in plan.error_params:
        template = _TEMPLATES.get(vllm_field)
        about_it = param == vllm_field or (
            param is None and template is not None and isinstance(message, str) and template.fullmatch(message)
        )
        if about_it:
            error["param"] = client_field
            if isinstance(message, str):
                error["message"] = f"`{client_field}` (sent to vLLM as `{vllm_field}`): {message}"
            return True
    return False


class _Choice:
    """One choice's stream state (engine_data only): its ids and logprobs so far."""

    __slots__ = ("ids", "logprobs", "finished", "withheld")

    def __init__(self, ids: list[int], logprobs: list[Any] | None) -> None:
        self.ids = ids
        self.logprobs = logprobs
        self.finished = False
        self.withheld = False  # vLLM sent `token_ids: null` on a chunk: the ids are not reported


class ChunkReshaper(PromptIds):
    """Per-stream state for reshaping decoded `chat.completion.chunk` / streamed `text_completion` chunks.

    Each choice of an n > 1 stream is answered on its own finish chunk, as Dynamo does.
    `stream.StreamReshaper` drives it; its byte-level shortcut for mid-stream deltas reports each
    delta's ids to `delta_ids` (or `withhold_ids`), which records them exactly as `reshape` would,
    and is not taken while `decode_every_chunk` is set.
    """

    __slots__ = ("plan", "clock", "ids", "logprobs", "ttft_ms", "engine", "_choices", "first", "pending", "_echoed",
                 "decode_every_chunk", "timed")  # fmt: skip

    def __init__(self, plan: Plan, clock: Clock) -> None:
        self._prompt_ids = self._prompt_json = None  # PromptIds: none reported yet (no call: a stream's start)
        self.plan = plan
        self.clock = clock
        self.ids: list[int] = []  # choice 0's completion ids so far (engine_data only)
        self.logprobs: list[Any] | None = [] if plan.logprobs_requested else None
        self.ttft_ms: float | None = None
        self.engine, self.timed = ENGINE_DATA in plan.nvext_only_selectors, TIMING in plan.nvext_only_selectors
        # Choice 0's state, also read (never written) by the byte-level paths: `first_choice` records what they serve.
        self.first = _Choice(self.ids, self.logprobs)
        self._choices: dict[int, _Choice] = {0: self.first}
        # With plan.finish_waits_for_usage: the finish chunk's nvext and engine_data arguments, to be
        # completed from the usage chunk (`complete_from_usage`) before the chunk goes out.
        self.pending: tuple[dict[str, Any], dict[str, Any] | None] | None = None
        self._echoed: set[Any] = set()  # choice indexes whose echoed prompt was put back
        # engine_data with logprobs, or with several choices to keep apart, reads every chunk; so do logprobs the
        # capture turned on, taken out of every chunk (the byte-level paths keep a delta's other bytes as they came).
        self.decode_every_chunk = (
            (self.engine and (self.logprobs is not None or not plan.single_choice))
            or (
                plan.stream_ids_absent or plan.stream_prompt_ids_absent  # keys deleted (vllm-rs): the general path's
            )
            or plan.strip_logprobs
        )

    def delta_ids(self, event: bytes, start: int, end: int) -> None:
        """What `reshape` records from the only choice's listed ids, found by the byte-level path at
        event[start:end]: the first-token time (only `timing` reads it), the engine ids."""
        if end - start > 2:
            if self.timed and self.ttft_ms is None:
                self.ttft_ms = self.clock.elapsed_ms()
            if self.engine:
                self.ids.extend(_json.loads(event[start:end]))

    def first_choice(self, event: bytes, start: int, end: int, finishes: bool = False) -> bool:
        """What `reshape` records of choice 0 from a chunk a byte-level path serves, in one call: its ids at
        event[start:end] (a list, as `delta_ids` records it; `null`: withheld) and, where the chunk `finishes` it,
        its finish. False, nothing recorded: a finish chunk once choice 0 had finished (it counts once)."""
        state = self.first
        if finishes:
            if state.finished:
                return False
            state.finished = True
        if event[start] != _LIST:
            state.withheld = True
        elif end - start > 2:  # `delta_ids`, inlined: no call of its own
            if self.timed and self.ttft_ms is None:
                self.ttft_ms = self.clock.elapsed_ms()
            if self.engine:
                state.ids.extend(_json.loads(event[start:end]))
        return True

    def finish_first_choice(self, event: bytes, start: int, end: int) -> bytes | None:
        """What `reshape` records from choice 0's finish chunk (ids at event[start:end]; see finish.serves), for
        whoever serves it (finish_chunk, either stream send), and its `nvext`; None, nothing recorded, once finished."""
        if self.first.finished:
            return None
        kept, ids = self._prompt_json, self._prompt_ids  # the prompt ids as `_json.dumps` writes them
        prompt = b"" if kept is None and ids is None else b',"prompt_token_ids":' + (kept or _json.dumps(ids))
        self.first_choice(event, start, end, True)
        return b'{"completion_token_ids":' + event[start:end] + prompt + b"}"

    def record_choice(self, index: Any, withheld: bool, finishes: bool) -> bool:
        """What `reshape` records of a choice beside its ids: withheld, finished once (True: it finishes here)."""
        state = self.choice_state(index)
        state.withheld |= withheld
        finished, state.finished = state.finished, state.finished or finishes
        return finishes and not finished

    def withhold_ids(self) -> None:
        """The byte-level path saw `token_ids: null` on the only choice (see `reported_ids`)."""
        self.first.withheld = True

    def drop_pending(self) -> None:
        """The finish chunk waiting for the usage chunk goes out as it stands (no usage chunk came)."""
        self.pending = None

    def choice_state(self, index: Any) -> _Choice:
        """The state of the choice with this `index` (0 when it is not an integer), as `reshape` picks it."""
        return self._choice(index if isinstance(index, int) and not isinstance(index, bool) else 0)

    def _choice(self, index: int) -> _Choice:
        state = self._choices.get(index)
        if state is None:
            state = self._choices[index] = _Choice([], [] if self.plan.logprobs_requested else None)
        return state

    def reshape(self, obj: Any) -> bool:
        """Reshape one decoded chunk in place; False if it is to be forwarded as it came."""
        if not isinstance(obj, dict):
            return False
        plan = self.plan
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            # usage-only chunk or error event: never carries nvext (Dynamo sends neither)
            return bool(plan.error_params) and rename_error(obj, plan)
        nv: dict[str, Any] = {}
        changed = False
        for choice in choices:
            if isinstance(choice, dict) and self._reshape_choice(obj, choice, nv):
                changed = True
            if plan.echo_prompts and isinstance(choice, dict) and choice.get("index") not in self._echoed:
                # vLLM echoes the prompt in each choice's first chunk.
                self._echoed.add(choice.get("index"))
                if put_back_echo(choice, plan):
                    changed = True
        if plan.strip_vllm_ids and strip_vllm_ids(obj, choices, plan):
            changed = True
        if plan.strip_logprobs and strip_logprobs(choices):
            changed = True
        if nv:
            obj["nvext"] = nv
            changed = True
        return changed  # an untouched chunk goes out as vLLM wrote it, without a re-encode

    def _reshape_choice(self, obj: dict[str, Any], choice: dict[str, Any], nv: dict[str, Any]) -> bool:
        plan = self.plan
        if self.prompt_ids is None:
            self.prompt_ids = prompt_ids_in(obj, choice, plan.endpoint)
        delta = choice.get("token_ids")
        # No key: a chunk before any token (the role chunk), "no tokens" unless the plan knows the ids
        # are withheld; null: vLLM withheld this chunk's ids.
        delta_ids: list[int] | None = (
            delta if isinstance(delta, list) else None if "token_ids" in choice or plan.ids_withheld else []
        )
        if delta_ids and self.timed and self.ttft_ms is None:
            self.ttft_ms = self.clock.elapsed_ms()
        state = self.choice_state(choice.get("index"))
        if delta_ids is None:
            state.withheld = True
        elif self.engine:
            state.ids.extend(delta_ids)
            if state.logprobs is not None:
                chunk_lp = choice_logprobs(choice)
                if chunk_lp is None and (delta_ids or delta_ids is None):
                    state.logprobs = None  # counts can no longer align
                elif chunk_lp:
                    state.logprobs.extend(chunk_lp)
        finished = choice.get("finish_reason") is not None
        if not finished or state.finished:
            if plan.nvext_trio:
                nv["completion_token_ids"] = delta_ids
            return False
        self._finish_choice(obj, choice, nv, state, delta_ids)
        return True  # the final selectors may move values out of the chunk

    def _finish_choice(
        self,
        obj: dict[str, Any],
        choice: dict[str, Any],
        nv: dict[str, Any],
        state: _Choice,
        delta_ids: list[int] | None,
    ) -> None:
        """A choice's finish chunk: its final `nvext` (or, with `finish_waits_for_usage`, held for the usage chunk)."""
        plan = self.plan
        state.finished = True
        kv = take_kv(obj, plan) if plan.nvext_trio else None  # vLLM >= 0.33 sends it on the finish chunk
        prompt_logprobs = take_prompt_logprobs(obj, choice, plan)
        routed_experts = take_routed_experts(choice, plan)
        engine = engine_args = None
        if self.engine:
            engine_args = {
                "prompt_ids": self.prompt_ids,
                "prompt_logprobs": prompt_logprobs,
                "kv_transfer_params": obj.get("kv_transfer_params") if kv is None else kv,
                "routed_experts": routed_experts,
                "completion_ids": None if state.withheld else list(state.ids),
                "finished": True,
                "logprobs": state.logprobs,
            }
            engine = engine_data(**engine_args)
        if plan.finish_waits_for_usage:
            self.pending = (nv, engine_args)
        nv.update(
            final_nvext(
                plan,
                unary=False,
                completion_ids=delta_ids if plan.nvext_trio else None,
                prompt_ids=self.prompt_ids,
                kv=kv,
                timing_obj=timing(self.clock, self.ttft_ms) if TIMING in plan.nvext_only_selectors else None,
                engine=engine,
                choice=choice,
                prompt_logprobs=prompt_logprobs,
                routed_experts=routed_experts,
            )
        )

    def complete_from_usage(self, usage_chunk: Any) -> None:
        """Fill the pending finish chunk's nvext with what vLLM reports on its usage chunk.

        vLLM sends its per-request metrics (`--enable-per-request-metrics`) and cached-token count
        (`--enable-prompt-tokens-details`) only there; Dynamo has them on the finish chunk.
        """
        pending, self.pending = self.pending, None
        if pending is None or not isinstance(usage_chunk, dict):
            return
        nv, engine_args = pending
        if "timing" in nv:  # replaced in place: the key keeps its position
            nv["timing"] = timing(self.clock, self.ttft_ms, usage_chunk.get("metrics"))
        if engine_args is not None and "engine_data" in nv:
            cache_hit = kv_cache_hit(self.prompt_ids, usage_chunk.get("usage"))
            nv["engine_data"] = engine_data(**engine_args, cache_hit=cache_hit)

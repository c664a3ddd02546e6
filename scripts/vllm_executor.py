"""A vLLM release's real engine core with a scripted executor (run inside its reference venv: 0.33 or
0.34, scripts/setup_vllm_cuda.sh).

`vllm serve MODEL --distributed-executor-backend scripts.vllm_executor.ScriptedExecutor`:
the release's own engine-core process, scheduler, KV-cache manager, stop checks and ZMQ protocol,
behind either of its frontends (the Python API server, or the Rust frontend `vllm-rs` with
`VLLM_USE_RUST_FRONTEND=1`). Exactly one thing is replaced: the executor, which would run the
model on workers. These releases have no CPU build, and its CUDA wheel's worker dies on a machine
without a GPU (`torch.ops._C.init_cpu_memory_env` is missing), so this executor answers the
KV-cache questions from the model's config and samples scripted ids.

The ids are the harness's (scripts/vllm_harness.py: `scripted_ids`, SCRIPTED_TEXT) and
so are the logprob values: id_i = (crc32(prompt ids, seed) + 7 * i + 31 * choice_index) % 94
at step i, or SCRIPTED_TEXT's ids then EOS; the engine core's scheduler ends each request as it
would a model's (max_tokens: `length`; EOS: `stop`), the frontend's detokenizer applies stop
strings. Not scripted here: `kv_transfer_params` (it comes from a KV connector, and none runs).

The engine core runs in a process of its own: this module must be importable there (the
repository root on PYTHONPATH); it imports vLLM, so only that process imports it.
`scripts.vllm_harness.RsServer` starts such a server with the Rust frontend; tests and
fixtures use it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch
from vllm.tasks import SupportedTask
from vllm.v1.attention.backends.utils import record_kv_cache_layout
from vllm.v1.executor.abstract import Executor
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsLists, LogprobsTensors, ModelRunnerOutput

from scripts.vllm_harness import _VOCAB_PRINTABLE, scripted_logprob, text_ids

_CHILD_ID = re.compile(r"^(\d+)_")
_HAS_INDEX = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
# What the KV cache may hold: nothing is allocated, so any size works; enough for many requests.
_KV_CACHE_BYTES = 256 << 20


@dataclass
class _Request:
    """What the executor keeps of one scheduled request: enough to script its next id."""

    prompt: list[int]
    seed: int | None
    index: int
    logprobs: int | None
    prompt_logprobs: int | None
    computed: int = 0
    sampled: int = 0
    base: int = field(init=False)

    def __post_init__(self) -> None:
        self.base = zlib.crc32(repr((list(self.prompt), self.seed)).encode())

    def next_id(self, text: list[int] | None) -> int:
        """The harness's id at this step (`scripted_ids(...)[step]`), or the scripted text's."""
        step = self.sampled
        if text is not None:
            return text[min(step, len(text) - 1)]
        return (self.base + 7 * step + 31 * self.index) % _VOCAB_PRINTABLE


def _rows(ids: list[int], width: int, steps: Sequence[int]) -> tuple[list[list[int]], list[list[float]]]:
    """Logprob rows as the harness scripts them: the chosen id first, then width-1 alternatives."""
    tok = [[t, *((t + j) % _VOCAB_PRINTABLE for j in range(1, width))] for t in ids]  # the chosen id itself
    lps = [[scripted_logprob(s) - j for j in range(width)] for s in steps]
    return tok, lps


class ScriptedExecutor(Executor):
    """A `vllm.v1.executor.abstract.Executor` with no worker: KV-cache answers from the config,
    scripted ids from `execute_model`."""

    uses_ray = False
    supports_pp = False

    def _init_executor(self) -> None:
        self.requests: dict[str, _Request] = {}
        text = os.environ.get("SCRIPTED_TEXT")
        self.text = None if text is None else text_ids(self.model_config.tokenizer or self.model_config.model, text)
        if self.cache_config.block_size is None:
            self.cache_config.block_size = 16

    # --- the KV-cache questions, from the config --------------------------------------------------
    def get_kv_cache_specs(self) -> list[dict[str, Any]]:
        model = self.model_config
        spec = FullAttentionSpec(
            block_size=self.cache_config.block_size,
            num_kv_heads=model.get_num_kv_heads(self.parallel_config),
            head_size=model.get_head_size(),
            dtype=cast(torch.dtype, model.dtype),  # resolved to a torch dtype by now
        )
        layers = model.get_num_layers(self.parallel_config)
        return [{f"model.layers.{i}.self_attn.attn": spec for i in range(layers)}]

    def get_supported_kv_cache_layouts(self) -> list[list[str]]:
        return [["NHD"]]

    # vLLM 0.33's and 0.34's signature (mypy reads .venv's 0.32, whose executor takes the layout alone).
    def set_kv_cache_layout(self, layout_name: str, cp_kv_cache_interleave_size: int) -> None:  # type: ignore[override]
        record_kv_cache_layout(self.cache_config, layout_name)
        self.parallel_config.cp_kv_cache_interleave_size = cp_kv_cache_interleave_size

    def determine_available_memory(self) -> list[int]:
        return [int(self.cache_config.kv_cache_memory_bytes or _KV_CACHE_BYTES)]

    def initialize_from_config(self, kv_cache_configs: list[Any]) -> None:
        return None

    def compile_or_warm_up_model(self) -> None:
        return None

    def get_kv_connector_handshake_metadata(self) -> list[dict[Any, Any]]:
        return [{}]

    @property
    def supported_tasks(self) -> tuple[SupportedTask, ...]:
        return ("generate",)

    # --- the engine core's steps -------------------------------------------------------------------
    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        output = self._step(scheduler_output)
        if not non_block:
            return output
        future: Future[Any] = Future()
        future.set_result(output)
        return future

    def sample_tokens(self, grammar_output: Any, non_block: bool = False) -> Any:
        raise RuntimeError("the scripted executor samples in execute_model")

    def take_draft_token_ids(self) -> None:
        return None

    def _step(self, scheduler_output: Any) -> Any:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            assert params is not None, "the scripted executor only generates"
            child = _CHILD_ID.match(new.req_id)
            self.requests[new.req_id] = _Request(
                prompt=list(new.prompt_token_ids or ()),
                seed=params.seed,
                index=int(child.group(1)) if child else 0,
                logprobs=params.logprobs,
                prompt_logprobs=params.prompt_logprobs,
                computed=new.num_computed_tokens,
            )
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            self.requests[req_id].computed = computed
        scheduled = scheduler_output.num_scheduled_tokens
        if not scheduled:
            return EMPTY_MODEL_RUNNER_OUTPUT

        req_ids = list(scheduled)
        sampled: list[list[int]] = []
        prompt_logprobs: dict[str, Any] = {}
        for req_id in req_ids:
            request = self.requests[req_id]
            request.computed += scheduled[req_id]
            if request.computed < len(request.prompt) + request.sampled:
                sampled.append([])  # a prompt still being prefilled, in chunks: nothing sampled yet
                continue
            if request.sampled == 0 and request.prompt_logprobs is not None and len(request.prompt) > 1:
                width = max(request.prompt_logprobs, 0) + 1
                tok, lps = _rows(request.prompt[1:], width, range(len(request.prompt) - 1))
                prompt_logprobs[req_id] = LogprobsTensors(
                    torch.tensor(tok, dtype=torch.int32),
                    torch.tensor(lps, dtype=torch.float32),
                    torch.ones(len(tok), dtype=torch.int64),
                )
            sampled.append([request.next_id(self.text)])
            request.sampled += 1

        logprobs = None
        widths = [self.requests[r].logprobs for r in req_ids]
        if any(w is not None for w in widths):
            # One row per scheduled request, as wide as the widest ask (vLLM keeps each request's own).
            width = max(max(w, 0) for w in widths if w is not None) + 1
            tokens = [ids[0] if ids else 0 for ids in sampled]
            steps = [max(self.requests[r].sampled - 1, 0) for r in req_ids]
            tok, lps = _rows(tokens, width, steps)
            logprobs = LogprobsLists(
                np.array(tok, dtype=np.int32), np.array(lps, dtype=np.float32), np.ones(len(tok), dtype=np.int64)
            )
        # vLLM 0.34's output has no `req_id_to_index` (the position in `req_ids` is the index).
        index: dict[str, Any] = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if _HAS_INDEX else {}
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs_dict=prompt_logprobs, **index
        )

    # --- the rest of the executor interface ---------------------------------------------------------
    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        non_block: bool = False,
    ) -> Any:
        """Every other worker call (cache resets, profiling, device sync) has nothing to act on here."""
        result = [None]
        if not non_block:
            return result
        future: Future[Any] = Future()
        future.set_result(result)
        return future

    def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        self.requests.clear()

#!/usr/bin/env python
"""The real `vllm serve` of a vLLM release without a CPU build (0.33, 0.34) over a scripted engine
core; run with that release's reference venv (`bash scripts/setup_vllm_cuda.sh <version>`).

What this is: the release's own CLI, FastAPI app, routers, `--middleware`, endpoint plugins,
chat template, tokenizer, detokenizer, logprobs formatting, n>1 fan-out, stop strings and
`kv_transfer_params` plumbing, unchanged. One thing is replaced:
`EngineCoreClient.make_async_mp_client`, which here returns `ScriptedEngineCore` instead of
a client of the engine-core process (these releases have no CPU build, and their CUDA engine core
cannot run on a machine without a GPU); and, for vLLM 0.34, one check of its CPU platform sees Triton
while the config is resolved (`_cpu_config_without_triton`). So the token ids and logprob values are scripted,
deterministic functions of the prompt ids, the seed and the choice index; every byte of the
HTTP answer around them is the release's. The same code serves every release in `VERSIONS`:
their engine-core protocol (`EngineCoreRequest` in, `EngineCoreOutputs` out) is the same.

What this is not: a model. It proves the middleware on the release's serving layer and its wire
format (see docs/supported-vllm.md), not its engine.

Scripted behaviour, per engine-core request:
- `max_tokens` ids, one per step, each printable ASCII in the tiny model's byte vocabulary:
  id_i = (crc32(prompt ids, seed) + 7 * i + 31 * choice_index) % 94; finish reason `length`
  (vLLM's own detokenizer may end it earlier with `stop` on a stop string);
- sample logprobs when asked: the sampled id at -0.125 * (i % 8 + 1), then `logprobs`
  alternatives (id + j) % 94 at that minus j; prompt logprobs likewise, on the first step;
- when the request carries `kv_transfer_params`, the finishing output carries
  {"hidden_states_path": "/tmp/vllm-nvext-scripted/<crc>.safetensors", "num_tokens": N}.
- SCRIPTED_STEP_SECONDS (default 0) paces the steps.
- SCRIPTED_TEXT, when set (a server kind of its own: the default above is unchanged without it),
  makes every request sample that text instead: its ids under the served model's tokenizer and
  EOS, cut at `max_tokens` (finish `length`), else all of them (finish `stop`). E.g. a hermes `<tool_call>`,
  which a server with `--tool-call-parser hermes` turns into a tool call.
- SCRIPTED_TOOL_CALLS (with SCRIPTED_TEXT), a JSON list of [marker, text] pairs, makes an agent's loop:
  a request whose last message is not a tool's result (no `<tool_response>` in it, as a hermes template
  renders one) samples the text of the first pair whose marker is in its prompt (e.g. a word of the
  agent's system prompt, and the text a `<tool_call>` of that agent's shell tool); every other request
  samples SCRIPTED_TEXT. The prompt is read by ids (the markers' encodings), ChatML's `<|im_start|>`
  separating the messages.

Run it through `HarnessServer` (below; what tests, fixtures and benchmarks use), or by hand:
    "$(bash scripts/setup_vllm_cuda.sh 0.34.0 | tail -1)" scripts/vllm_harness.py serve MODEL_DIR [args...]
Importing this module is cheap and side-effect free: vLLM is imported only when serving.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_nvext.tools.reference_venvs import is_built, refs_dir
from vllm_nvext.tools.server import VllmServer

# The short name tests use -> the release its reference venv holds (`make setup-vllm0XY`).
VERSIONS = {"0.33": "0.33.0", "0.34": "0.34.0"}

_VOCAB_PRINTABLE = 94  # ids 0..93 of the tiny model are the bytes '!'..'~'
_CHILD_ID = re.compile(r"^(\d+)_")
KV_DIR = "/tmp/vllm-nvext-scripted"
REPO = Path(__file__).resolve().parents[1]


def scripted_ids(prompt: list[int], seed: int | None, index: int, count: int) -> list[int]:
    base = zlib.crc32(repr((list(prompt), seed)).encode())
    return [(base + 7 * i + 31 * index) % _VOCAB_PRINTABLE for i in range(count)]


def text_ids(model: str, text: str) -> list[int]:
    """The ids a model samples for `text`: its tokenizer's encoding, then EOS.

    EOS ends it as a model's answer ends (finish `stop`; vLLM leaves that id out of the text).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    eos = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    return [*tokenizer.encode(text, add_special_tokens=False), *eos]


def _contains(ids: list[int], part: list[int]) -> bool:
    width = len(part)
    return any(ids[i : i + width] == part for i in range(len(ids) - width + 1))


def scripted_replies(model: str, text: str, tool_calls: str | None) -> Callable[[list[int]], list[int]]:
    """What a request samples, by its prompt: SCRIPTED_TEXT, or an agent's tool call (SCRIPTED_TOOL_CALLS)."""
    from transformers import AutoTokenizer

    final = text_ids(model, text)
    if tool_calls is None:
        return lambda prompt: final
    tokenizer = AutoTokenizer.from_pretrained(model)
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    result = tokenizer.encode("<tool_response>", add_special_tokens=False)
    calls = [(tokenizer.encode(marker, add_special_tokens=False), text_ids(model, call))
             for marker, call in json.loads(tool_calls)]  # fmt: skip

    def reply(prompt: list[int]) -> list[int]:
        starts = [i for i, token in enumerate(prompt) if token == start]
        if len(starts) >= 2 and _contains(prompt[starts[-2] :], result):
            return final  # the last message is a tool's result: the answer
        return next((ids for marker, ids in calls if _contains(prompt, marker)), final)

    return reply


def scripted_logprob(step: int) -> float:
    return -0.125 * (step % 8 + 1)


class _Resources:
    engine_dead = False


def _install(reply: Callable[[list[int]], list[int]] | None = None) -> None:
    """Replace vLLM's engine-core client factory; nothing else is touched.

    `reply`: the ids a request samples, by its prompt (SCRIPTED_TEXT, SCRIPTED_TOOL_CALLS), instead of
    `scripted_ids`.
    """
    import numpy as np
    import torch
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
    from vllm.v1.engine.core_client import EngineCoreClient
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    def _rows(ids: list[int], width: int, steps: range) -> tuple[Any, Any, Any]:
        """Logprob rows: the chosen id first, then width-1 alternatives."""
        tok = [[t, *((t + j) % _VOCAB_PRINTABLE for j in range(1, width))] for t in ids]  # the chosen id itself
        lps = [[scripted_logprob(s) - j for j in range(width)] for s in steps]
        return tok, lps, [1] * len(ids)

    class ScriptedEngineCore(EngineCoreClient):
        """The engine core, scripted: each request becomes one `EngineCoreOutput` per step."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()
            self.tasks: dict[str, asyncio.Task[None]] = {}
            self.resources = _Resources()
            self.engine_ranks_managed = [0]
            self.weight_version = "scripted"
            self.step_seconds = float(os.environ.get("SCRIPTED_STEP_SECONDS", "0"))

        async def _generate(self, request: EngineCoreRequest) -> None:
            params = request.sampling_params
            assert params is not None, "the scripted engine core only generates"
            prompt = list(request.prompt_token_ids or ())
            child = _CHILD_ID.match(request.request_id)
            index = int(child.group(1)) if child else 0
            count = max(1, params.max_tokens or 16)
            ids = scripted_ids(prompt, params.seed, index, count) if reply is None else reply(prompt)[:count]
            finish = FinishReason.LENGTH if len(ids) == count else FinishReason.STOP
            count = len(ids)
            extra = params.extra_args or {}
            for step, token in enumerate(ids):
                last = step == count - 1
                out = EngineCoreOutput(request_id=request.request_id, new_token_ids=[token])
                if params.logprobs is not None:
                    width = max(params.logprobs, 0) + 1
                    tok, lps, ranks = _rows([token], width, range(step, step + 1))
                    out.new_logprobs = LogprobsLists(np.array(tok), np.array(lps), np.array(ranks))
                if step == 0 and params.prompt_logprobs is not None and len(prompt) > 1:
                    width = max(params.prompt_logprobs, 0) + 1
                    tok, lps, ranks = _rows(prompt[1:], width, range(len(prompt) - 1))
                    out.new_prompt_logprobs_tensors = LogprobsTensors(
                        torch.tensor(tok), torch.tensor(lps, dtype=torch.float32), torch.tensor(ranks)
                    )
                if last:
                    out.finish_reason = finish
                    if extra.get("kv_transfer_params") is not None:
                        crc = zlib.crc32(repr((prompt, ids)).encode())
                        out.kv_transfer_params = {
                            "hidden_states_path": f"{KV_DIR}/{crc:08x}.safetensors",
                            "num_tokens": len(prompt) + count,
                        }
                self.outputs.put_nowait(EngineCoreOutputs(outputs=[out]))
                if self.step_seconds:
                    await asyncio.sleep(self.step_seconds)
                else:
                    await asyncio.sleep(0)
            self.tasks.pop(request.request_id, None)

        # --- the calls AsyncLLM and the API server make ---------------------------------------
        async def get_output_async(self) -> EngineCoreOutputs:
            return await self.outputs.get()

        async def add_request_async(self, request: EngineCoreRequest) -> None:
            self.tasks[request.request_id] = asyncio.create_task(self._generate(request))

        async def abort_requests_async(self, request_ids: list[str]) -> None:
            for request_id in request_ids:
                task = self.tasks.pop(request_id, None)
                if task is not None:
                    task.cancel()

        # vLLM types this as a tuple of its own SupportedTask Literal, whose members differ between versions.
        async def get_supported_tasks_async(self) -> tuple[str, ...]:  # type: ignore[override]
            return ("generate",)

        async def is_sleeping_async(self) -> bool:
            return False

        async def reset_prefix_cache_async(self, *args: Any, **kwargs: Any) -> bool:
            return True

        async def reset_mm_cache_async(self) -> None:
            return None

        async def reset_encoder_cache_async(self) -> None:
            return None

        async def set_weight_version_async(self, weight_version: str) -> None:
            self.weight_version = weight_version

        async def get_weight_version_async(self) -> str:
            return self.weight_version

        def dp_engines_running(self) -> bool:
            return False

        def get_kv_event_sources(self) -> dict[int, Any]:
            return {}

        def shutdown(self, timeout: float | None = None) -> None:
            for task in self.tasks.values():
                task.cancel()
            self.tasks.clear()

    def make_async_mp_client(*args: Any, **kwargs: Any) -> ScriptedEngineCore:
        return ScriptedEngineCore(*args, **kwargs)

    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]


def venv_python(version: str = "0.33") -> Path:
    """`version`'s reference venv's python; a missing or incomplete venv names the make target."""
    release = VERSIONS[version]
    venv = refs_dir() / f"vllm-{release}"
    python = venv / "bin" / "python"
    if not is_built(venv, python):
        target = "make setup-vllm" + version.replace(".", "")
        raise RuntimeError(f"the vLLM {release} reference venv is missing at {venv}: run `{target}`")
    return python


@dataclass
class HarnessServer(VllmServer):
    """`VllmServer` running this harness (release `vllm`'s `vllm serve`, scripted engine core)."""

    vllm: str = "0.33"
    name: str = ""

    def __post_init__(self) -> None:
        self.name = self.name or f"vllm-{self.vllm}"
        # This checkout's vllm_nvext (and scripts/, for the executor), whichever one the venv's editable
        # install points at: the reference venvs are shared by every checkout on the machine.
        self.env = {"PYTHONPATH": str(REPO), **self.env}

    def command(self) -> list[str]:
        return [
            str(venv_python(self.vllm)), str(Path(__file__).resolve()), "serve", self.model,
            "--host", self.host, "--port", str(self.port), *self.args,
        ]  # fmt: skip


# `--distributed-executor-backend`: the release's real engine core, scripted ids (scripts/vllm_executor.py).
EXECUTOR = "scripts.vllm_executor.ScriptedExecutor"
# The Rust frontend on; config resolution on the CPU platform (the wheel is CUDA's).
RUST_ENV = {"VLLM_USE_RUST_FRONTEND": "1", "VLLM_TARGET_DEVICE": "cpu"}


@dataclass
class RsServer(HarnessServer):
    """Release `vllm`'s stock `vllm serve` with its Rust frontend (`vllm-rs`; `RUST_ENV` in its env) over
    the release's real engine core, whose executor samples this harness's ids: nothing of vLLM replaced."""

    def __post_init__(self) -> None:
        self.name = self.name or f"vllm-rs-{self.vllm}"
        super().__post_init__()

    def command(self) -> list[str]:
        return [
            str(venv_python(self.vllm)), str(Path(__file__).resolve()), "rs-serve", self.model,
            "--host", self.host, "--port", str(self.port), "--distributed-executor-backend", EXECUTOR, *self.args,
        ]  # fmt: skip


def _cpu_config_without_triton() -> None:
    """vLLM 0.34's CPU platform refuses an x86 machine without triton-cpu while resolving the config
    ("vLLM on x86 CPUs requires Triton"): its model runner would compile kernels with it. No model runs
    here, so that one check sees Triton while the CPU platform resolves the config (0.33 has no such
    check: nothing changes there); every other use of `HAS_TRITON` keeps the real answer."""
    import vllm.triton_utils as triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        has_triton = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True
        try:
            check(cls, vllm_config)
        finally:
            triton_utils.HAS_TRITON = has_triton

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)  # type: ignore[method-assign,assignment]


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # config resolution on the CPU platform
    if sys.argv[1:2] == ["rs-serve"]:
        # Stock `vllm serve` (the Rust frontend with RUST_ENV, the executor named in its arguments): nothing
        # replaced but the one CPU-platform check of 0.34 (`_cpu_config_without_triton`).
        sys.argv[1] = "serve"
        _cpu_config_without_triton()
        from vllm_nvext.tools._vllm_cli import main as stock_cli_main

        return stock_cli_main()
    text = os.environ.get("SCRIPTED_TEXT")
    _install(None if text is None else scripted_replies(sys.argv[2], text, os.environ.get("SCRIPTED_TOOL_CALLS")))
    _cpu_config_without_triton()
    # vLLM's CLI, through the project's own entry point (which must work on every release).
    from vllm_nvext.tools._vllm_cli import main as vllm_cli_main

    return vllm_cli_main()


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__" and os.environ.get("VLLM_USE_RUST_FRONTEND") == "1":
    # The engine-core process that `rs-serve` spawns (vLLM's CPU platform asks for `spawn`, which imports
    # this script as `__mp_main__` in the child): it resolves the config again, on the same terms.
    _cpu_config_without_triton()

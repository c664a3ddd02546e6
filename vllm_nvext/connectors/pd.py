"""A prefill/decode KV handoff that runs on CPU: vLLM's disk-based `ExampleConnector`, driven by
`kv_transfer_params` the way the network connectors are.

vLLM's `ExampleConnector` writes every prompt's KV cache to a shared folder and loads it for any
later prompt it finds there, whatever the request says. PD orchestrators (vllm-router
`--vllm-pd-disaggregation`, vLLM's disaggregated-serving proxies, production-stack's orchestrated
mode) speak the protocol of the network connectors instead: the prefill request carries a root
`kv_transfer_params: {"do_remote_decode": true, ...}`, the prefill answer's root
`kv_transfer_params` says where the KV cache is, and the orchestrator hands that object to the
decode server as the decode request's root `kv_transfer_params`. This subclass follows that
protocol, so a handoff happens only when `kv_transfer_params` made the whole trip:

- prefill side: only a request with `do_remote_decode: true` writes its prompt's KV cache (full
  blocks, as upstream), and its answer's `kv_transfer_params` is
  `{"do_remote_prefill": true, "do_remote_decode": false, "remote_engine_id": ...,
  "remote_key": <the prompt's key>, "remote_num_tokens": N}`;
- decode side: only a request with `do_remote_prefill: true` and the `remote_key` of its own
  prompt loads the KV cache (N tokens, counted by vLLM as external prefix-cache hits,
  `vllm:external_prefix_cache_hits`); any other request computes its prompt itself.

The key is the hash upstream names its folder by, recomputed from the decode request's own
prompt and compared: a `remote_key` from a client never reaches a file path, and a decode never
loads another prompt's KV cache. Load it in vLLM with (both servers, the same folder)::

    --kv-transfer-config '{"kv_connector": "CPUPDConnector",
        "kv_connector_module_path": "vllm_nvext.connectors.pd", "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/pd"}}'

It is a test and demonstration connector (one file per layer and prompt, never deleted), not a
production transport. This module imports vLLM and torch at import time; `vllm_nvext/__init__.py`
must not import it.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
    ExampleConnectorMetadata,
    align_to_block_size,
)
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["CPUPDConnector"]


class CPUPDConnector(ExampleConnector):
    """`ExampleConnector` that writes and loads only as `kv_transfer_params` ask."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._producing: set[str] = set()  # requests asked to leave their KV cache for a decode
        self._engine_id = self._kv_transfer_config.engine_id

    # --- the key of a prompt's KV cache -------------------------------------------------------

    def _key(self, token_ids: list[int], mm_hashes: list[str]) -> tuple[str, int]:
        """(folder name, number of tokens stored): upstream's layout (the full blocks before the
        last prompt token), the same on both sides."""
        num_tokens = align_to_block_size(len(token_ids), self._block_size)
        folder = self._generate_foldername_debug(torch.tensor(token_ids)[:num_tokens], mm_hashes)
        return os.path.basename(folder), num_tokens

    def _prompt_key(self, request: Request) -> tuple[str, int]:
        return self._key(list(request.prompt_token_ids or []), [f.identifier for f in request.mm_features])

    def _stored(self, key: str) -> bool:
        return os.path.isdir(os.path.join(self._storage_path, key))

    # --- scheduler side ---------------------------------------------------------------------

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if isinstance(params, dict) and params.get("do_remote_decode") is True:
            self._producing.add(request.request_id)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True:
            return 0, False
        key, num_tokens = self._prompt_key(request)
        if params.get("remote_key") != key:
            logger.warning("Request %s: remote_key is not its prompt's; computing the prompt", request.request_id)
            return 0, False
        if num_tokens <= num_computed_tokens or not self._stored(key):
            return 0, False
        return num_tokens - num_computed_tokens, False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ExampleConnectorMetadata()
        for new_req in scheduler_output.scheduled_new_reqs:
            token_ids = new_req.prompt_token_ids or []
            mm_hashes = [f.identifier for f in new_req.mm_features]
            load = new_req.req_id in self._requests_need_load
            if load or (new_req.req_id in self._producing and not self._stored(self._key(token_ids, mm_hashes)[0])):
                meta.add_request(
                    token_ids=token_ids,
                    block_ids=new_req.block_ids[0],
                    block_size=self._block_size,
                    is_store=not load,
                    mm_hashes=mm_hashes,
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A decode preempted before it ran loads again into its new blocks, as upstream.
            if req_id not in cached.resumed_req_ids or req_id not in self._requests_need_load:
                continue
            request = self._requests_need_load[req_id]
            total = cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id]
            new_block_ids = cached.new_block_ids[i]
            assert new_block_ids is not None
            meta.add_request(
                token_ids=request.all_token_ids[:total],
                block_ids=new_block_ids[0],
                block_size=self._block_size,
                is_store=False,
                mm_hashes=[f.identifier for f in request.mm_features],
            )
        self._requests_need_load.clear()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # The KV cache was written during the forward pass (upstream's save_kv_layer): nothing is
        # pending, the blocks may be freed at once.
        if request.request_id not in self._producing:
            return False, None
        self._producing.discard(request.request_id)
        key, num_tokens = self._prompt_key(request)
        if num_tokens <= 0 or not self._stored(key):
            return False, None  # a prompt shorter than a block: nothing to hand over
        return False, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._engine_id,
            "remote_key": key,
            "remote_num_tokens": num_tokens,
        }

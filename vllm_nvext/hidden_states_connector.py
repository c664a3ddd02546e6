"""A CPU-safe variant of vLLM's `ExampleHiddenStatesConnector`.

The upstream connector copies hidden states out of the KV cache on a CUDA stream into
pinned host memory and writes them from a thread pool; on a CPU-only vLLM that path
crashes (no CUDA events, no pinned memory). This subclass keeps everything else from
upstream (lock files pre-created with an exclusive flock before the client sees the
path, `kv_transfer_params.hidden_states_path`, file naming, `allow_custom_save_path`,
`use_synchronization_lock`, `include_output_tokens`) and only replaces the write: it
extracts, saves and then releases `<path>.lock` synchronously in the worker.

Load it in vLLM with::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}}'
    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "vllm_nvext.hidden_states_connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"}}'

This module imports vLLM and torch at import time; `vllm_nvext/__init__.py` must not
import it. Readers use `vllm_nvext.hidden_states.load`.
"""

from __future__ import annotations

import fcntl
import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)

__all__ = ["CPUHiddenStatesConnector"]


class _Written:
    """Stands in for upstream's CUDA copy event: the data is already on disk."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous CPU write."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        # Called by the upstream `get_finished` for each request that finished; the
        # upstream `get_finished` then reports the request as done sending once the
        # entry in `_req_copy_events` says so (ours always does).
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens)
        tensors = {
            # Fancy indexing already copied; `.cpu()` is a no-op on CPU.
            "hidden_states": hidden_states.cpu().contiguous(),
            "token_ids": pending.token_ids.clone(),
        }

        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            if lock_fd is None and self.use_lock:
                # Normally pre-created by `wait_for_save`; same fallback as upstream.
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            save_file(tensors, pending.filename)
        except Exception as exc:  # keep the engine alive, like upstream's thread pool
            logger.error("Hidden-states write failed for req_id=%s: %r", pending.req_id, exc)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers may now read the file
        self._req_copy_events[pending.req_id] = _Written()  # type: ignore[assignment]

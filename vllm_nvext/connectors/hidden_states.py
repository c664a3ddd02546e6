"""A CPU-safe, hardened variant of vLLM's `ExampleHiddenStatesConnector`.

The upstream connector copies hidden states out of the KV cache on a CUDA stream into
pinned host memory and writes them from a thread pool; on a CPU-only vLLM that path
crashes (no CUDA events, no pinned memory). This subclass writes synchronously in the
worker, and it changes how files are named and created, because upstream joins the
request id (which vLLM takes from the client's `X-Request-Id` header) into the path:

- Names: `<prefix>-<digest>.safetensors` from `vllm_nvext.hidden_states.capture_file_name`
  (a sanitized prefix of the request id, at most 64 characters, and a digest of the whole
  id salted with a per-engine serial number), directly in `shared_storage_path`. No
  request id can climb out of the directory, create directories, or make a name too long;
  requests that share an id get distinct files.
- Confinement: every path is resolved (`os.path.realpath`) and must lie inside
  `shared_storage_path`, on the scheduler side when the name is chosen and again on the
  worker side before each file is created; files are opened without following a symbolic
  link at their own name, and the data is written to a temporary file that is renamed into
  place.
- `allow_custom_save_path`: a client's `kv_transfer_params.hidden_states_path` is used
  only when it resolves inside `shared_storage_path` (a relative one is taken from there);
  otherwise the request is served without a capture and its `kv_transfer_params` is
  `{"hidden_states_error": "..."}`. Without the option the client's path is ignored.
- Failures: a lock or data file that cannot be created or written fails that request's
  capture only. The engine keeps serving; the failure is logged as
  `Hidden-states capture failed` with a running count (`failed_captures`), the data file
  never appears, and `vllm_nvext.hidden_states.load` reports it as not found once the
  writer's lock is released. The lock is taken without waiting: a lock someone else holds
  fails the capture instead of stalling the engine.

Everything else is upstream's: lock files pre-created with an exclusive flock before the
client sees the path, `kv_transfer_params.hidden_states_path`, `use_synchronization_lock`,
`include_output_tokens`.

Load it in vLLM with::

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}}'
    --kv-transfer-config '{"kv_connector": "CPUHiddenStatesConnector",
        "kv_connector_module_path": "vllm_nvext.connectors.hidden_states",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"}}'

This module imports vLLM and torch at import time; `vllm_nvext/__init__.py` must not
import it. Readers use `vllm_nvext.hidden_states.load`.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import secrets
import tempfile
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

from ..hidden_states import UnsafePathError, capture_file_name, path_inside

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

__all__ = ["CPUHiddenStatesConnector"]

ERROR_KEY = "hidden_states_error"
# O_NOFOLLOW: a symbolic link planted at a capture's own name is not followed.
_LOCK_FLAGS = os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class _Written:
    """Stands in for upstream's CUDA copy event: the write is over (done or failed)."""

    @staticmethod
    def query() -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """`ExampleHiddenStatesConnector` with a synchronous CPU write and safe file names."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._storage_dir = os.path.abspath(self._storage_path)
        with contextlib.suppress(OSError):  # a failure shows on each capture, with its reason
            os.makedirs(self._storage_dir, exist_ok=True)
        # Salt for the names: distinct per engine and per request, even for a repeated id.
        self._name_salt = secrets.token_hex(8)
        self._name_serial = itertools.count()
        self._refused: dict[str, str] = {}  # scheduler side: req_id -> why there is no capture
        self._failed: dict[str, str] = {}  # worker side: req_id -> why its lock could not be made
        self.failed_captures = 0

    # --- scheduler side ---------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = ExampleHiddenStatesConnectorMetadata()
        meta.pending_saves = list(self._pending_saves.values())
        self._pending_saves.clear()
        # Name new requests' files; the worker pre-creates their locks before the client
        # receives the path.
        for new_req in scheduler_output.scheduled_new_reqs:
            try:
                filename = self._capture_path(new_req)
            except Exception as exc:  # UnsafePathError, or a malformed request: never the engine
                reason = str(exc) if isinstance(exc, UnsafePathError) else f"{type(exc).__name__}: {exc}"
                self._refused[new_req.req_id] = f"no hidden states captured: {reason}"
                self._count_failure(new_req.req_id, "refused", reason)
                continue
            self._request_filenames[new_req.req_id] = filename
            meta.new_req_filenames[new_req.req_id] = filename
        return meta

    def _capture_path(self, new_req: NewRequestData) -> str:
        params = new_req.sampling_params
        kv_params = (params.extra_args.get("kv_transfer_params") if params and params.extra_args else None) or {}
        custom = kv_params.get("hidden_states_path") if isinstance(kv_params, dict) else None
        if custom is not None and not self.allow_custom_save_path:
            logger.warning(
                "Request %r provided hidden_states_path but allow_custom_save_path is disabled: "
                "the path is ignored and the default name is used.",
                new_req.req_id,
            )
            custom = None
        if custom is None:
            name = capture_file_name(new_req.req_id, f"{self._name_salt}:{next(self._name_serial)}")
            return path_inside(self._storage_dir, name)
        if not isinstance(custom, str) or not custom:
            raise UnsafePathError(f"hidden_states_path must be a non-empty string, got {custom!r:.80}")
        return path_inside(self._storage_dir, custom)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        reason = self._refused.pop(request.request_id, None)
        if reason is not None:
            return False, {ERROR_KEY: reason}
        if request.request_id not in self._request_filenames:
            # Never scheduled (cancelled while waiting): nothing was captured. vLLM 0.30's
            # upstream pops the name without a default and would raise in the scheduler.
            return False, None
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        reason = self._refused.pop(request.request_id, None)
        if reason is not None:
            return False, {ERROR_KEY: reason}
        return super().request_finished_all_groups(request, block_ids)

    # --- worker side ------------------------------------------------------------------------

    def wait_for_save(self) -> None:
        """Pre-create (and exclusively lock) the lock files of newly arrived requests.

        As upstream, before the scheduler returns the path to the client; a lock that cannot
        be created fails that request's capture, and its data is then not written.
        """
        if not self._is_tp_rank_zero or not self.use_lock or not self.has_connector_metadata():
            return
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, ExampleHiddenStatesConnectorMetadata):
            return
        for req_id, filename in metadata.new_req_filenames.items():
            if req_id in self._lock_fds or req_id in self._failed:
                continue
            try:
                self._lock_fds[req_id] = self._open_locked(filename)
            except Exception as exc:  # OSError, UnsafePathError: this capture fails, not the engine
                self._failed[req_id] = f"{type(exc).__name__}: {exc}"
                self._count_failure(req_id, "lock not created", self._failed[req_id])

    def _confined(self, filename: str) -> str:
        """`filename` checked again inside the storage directory, its directory created."""
        path = path_inside(self._storage_dir, filename)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if path_inside(self._storage_dir, path) != path:  # a link appeared on the way
            raise UnsafePathError(f"{path!r} no longer resolves to itself inside the storage directory")
        return path

    def _open_locked(self, filename: str) -> int:
        fd = os.open(self._confined(filename) + ".lock", _LOCK_FLAGS, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # never wait: a held lock fails the capture
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write(self, tensors: dict[str, torch.Tensor], filename: str) -> None:
        path = self._confined(filename)
        fd, temporary = tempfile.mkstemp(prefix=".hs-", suffix=".tmp", dir=os.path.dirname(path))
        try:
            os.fchmod(fd, 0o644)  # as the file upstream's save_file creates; mkstemp makes 0600
            os.close(fd)
            save_file(tensors, temporary)
            os.replace(temporary, path)  # replaces a link at `path` rather than following it
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise

    def _submit_async_write(self, pending: PendingSave) -> None:
        # Called by the upstream `get_finished` for each request that finished; the
        # upstream `get_finished` then reports the request as done sending once the
        # entry in `_req_copy_events` says so (ours always does, written or failed).
        if not self._is_tp_rank_zero:
            return
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        lock_failure = self._failed.pop(pending.req_id, None)
        try:
            if lock_failure is None:
                tensors = self._extract(pending)
                if lock_fd is None and self.use_lock:
                    lock_fd = self._open_locked(pending.filename)  # normally made by wait_for_save
                self._write(tensors, pending.filename)
        except Exception as exc:  # this capture fails, not the engine
            self._count_failure(pending.req_id, "not written", f"{type(exc).__name__}: {exc}")
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: readers may now read the file
            self._req_copy_events[pending.req_id] = _Written()  # type: ignore[assignment]

    def _extract(self, pending: PendingSave) -> dict[str, torch.Tensor]:
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids[:, None] * self._block_size + offsets[None, :]).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping.to(self._kv_cache.device), num_tokens)
        return {
            # Fancy indexing already copied; `.cpu()` is a no-op on CPU.
            "hidden_states": hidden_states.cpu().contiguous(),
            "token_ids": pending.token_ids.clone(),
        }

    def _count_failure(self, req_id: str, what: str, reason: str) -> None:
        self.failed_captures += 1
        logger.error(
            "Hidden-states capture failed (%s) for req_id=%r: %s [%d failed captures so far]",
            what,
            req_id,
            reason,
            self.failed_captures,
        )

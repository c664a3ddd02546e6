"""Read the hidden-states files that vLLM's hidden-states connectors write (docs/protocol.md §2).

One safetensors file per request, named by `kv_transfer_params.hidden_states_path`:
`hidden_states` `[num_tokens, num_layers, hidden_size]` and `token_ids` `[num_tokens]`.
The writer holds an exclusive flock on `<path>.lock` until the file is complete, so
`load` takes a shared flock on it first (polling, so the wait is bounded).

torch and safetensors are imported inside `load`: the package imports without them.
"""

from __future__ import annotations

import fcntl
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._shapes import first_mismatch

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = ["HiddenStates", "HiddenStatesError", "load"]

_POLL_S = 0.02


class HiddenStatesError(ValueError):
    """A hidden-states file that is missing, still locked, or malformed."""


@dataclass(frozen=True)
class HiddenStates:
    """A validated hidden-states file."""

    path: str
    hidden_states: torch.Tensor  # [num_tokens, num_layers, hidden_size]
    token_ids: list[int]
    num_tokens: int
    num_layers: int
    hidden_size: int


def load(
    path: str | os.PathLike[str],
    *,
    expect_token_ids: Sequence[int] | None = None,
    timeout: float = 30.0,
) -> HiddenStates:
    """Wait for the writer's lock (at most `timeout` seconds), load and check the file.

    Raises `HiddenStatesError` when the file is missing, the lock is still held after
    `timeout`, a tensor is missing or has the wrong shape or dtype, the ids differ from
    `expect_token_ids`, or a hidden state is not finite.
    """
    path = os.fspath(path)
    if timeout < 0:
        raise ValueError(f"timeout must be >= 0, got {timeout}")
    lock_path = path + ".lock"
    try:
        lock_fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        lock_fd = None  # no writer lock (e.g. use_synchronization_lock off): read as is
    try:
        if lock_fd is not None:
            _lock_shared(lock_fd, lock_path, timeout)
        tensors = _read(path)
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # also drops the shared lock
    return _validate(path, tensors, expect_token_ids)


def _lock_shared(fd: int, lock_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise HiddenStatesError(
                    f"timed out after {timeout:g}s waiting for the writer to release "
                    f"{lock_path} (hidden states still being written?)"
                ) from None
            time.sleep(min(_POLL_S, remaining))


def _read(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not os.path.isfile(path):
        raise HiddenStatesError(f"hidden-states file not found: {path}")
    try:
        return load_file(path, device="cpu")
    except Exception as exc:  # SafetensorError, OSError, ...
        raise HiddenStatesError(f"{path}: not a readable safetensors file: {exc}") from exc


def _validate(path: str, tensors: dict[str, torch.Tensor], expect_token_ids: Sequence[int] | None) -> HiddenStates:
    import torch

    for key in ("hidden_states", "token_ids"):
        if key not in tensors:
            raise HiddenStatesError(f"{path}: missing tensor {key!r} (found {sorted(tensors) or 'none'})")
    hs, ids = tensors["hidden_states"], tensors["token_ids"]
    if hs.ndim != 3:
        raise HiddenStatesError(
            f"{path}: 'hidden_states' must be [num_tokens, num_layers, hidden_size], got shape {list(hs.shape)}"
        )
    if ids.ndim != 1:
        raise HiddenStatesError(f"{path}: 'token_ids' must be [num_tokens], got shape {list(ids.shape)}")
    num_tokens, num_layers, hidden_size = hs.shape
    if ids.shape[0] != num_tokens:
        raise HiddenStatesError(f"{path}: 'hidden_states' has {num_tokens} tokens but 'token_ids' has {ids.shape[0]}")
    if num_layers == 0 or hidden_size == 0:
        raise HiddenStatesError(f"{path}: 'hidden_states' has an empty dimension: shape {list(hs.shape)}")
    if not hs.is_floating_point():
        raise HiddenStatesError(f"{path}: 'hidden_states' has non-float dtype {hs.dtype}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise HiddenStatesError(f"{path}: 'token_ids' has non-integer dtype {ids.dtype}")

    token_ids = [int(t) for t in ids.tolist()]
    if expect_token_ids is not None:
        expected = [int(t) for t in expect_token_ids]
        i = first_mismatch(token_ids, expected)
        if i is not None:
            got = token_ids[i] if i < len(token_ids) else "<end>"
            want = expected[i] if i < len(expected) else "<end>"
            raise HiddenStatesError(
                f"{path}: token_ids differ from the expected ids at index {i}: "
                f"file has {got}, expected {want} "
                f"(lengths {len(token_ids)} and {len(expected)})"
            )

    finite = torch.isfinite(hs)
    if not bool(finite.all()):
        bad = (~finite).nonzero()
        tok, layer, dim = (int(v) for v in bad[0])
        raise HiddenStatesError(
            f"{path}: 'hidden_states' has {bad.shape[0]} non-finite values; first at "
            f"token {tok}, layer {layer}, dim {dim}: {hs[tok, layer, dim].item()}"
        )
    return HiddenStates(
        path=path,
        hidden_states=hs,
        token_ids=token_ids,
        num_tokens=int(num_tokens),
        num_layers=int(num_layers),
        hidden_size=int(hidden_size),
    )

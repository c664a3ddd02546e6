"""Read the hidden-states files that vLLM's hidden-states connectors write (docs/protocol.md §2).

One safetensors file per request, named by `kv_transfer_params.hidden_states_path`:
`hidden_states` `[num_tokens, num_layers, hidden_size]` and `token_ids` `[num_tokens]`.
The writer holds an exclusive flock on `<path>.lock` until the file is complete, so
`load` takes a shared flock on it first (polling, so the wait is bounded).

The package's connector (`vllm_nvext.connectors.hidden_states`) names each file with
`capture_file_name` and writes only where `path_inside` allows: a request id (vLLM takes it
from the client's `X-Request-Id` header) never becomes a path.

torch and safetensors are imported inside `load`: the package imports without them.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .outbound.shapes import first_mismatch

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

__all__ = [
    "HiddenStates",
    "HiddenStatesError",
    "UnsafePathError",
    "capture_file_name",
    "load",
    "path_inside",
]

_POLL_S = 0.02
# A file name: the request id's first characters, sanitized, then a digest.
PREFIX_MAX = 64
DIGEST_HEX = 32  # 128 bits of SHA-256
SUFFIX = ".safetensors"
_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_-]+")
# Room the writer needs next to a file: `<name>.lock`.
_LOCK_SUFFIX = ".lock"
_NAME_MAX = 255  # bytes in one path component (Linux, macOS)
_PATH_MAX = 4096  # bytes in a whole path (Linux)


class HiddenStatesError(ValueError):
    """A hidden-states file that is missing, still locked, or malformed."""


class UnsafePathError(ValueError):
    """A capture path that would leave the storage directory, or that no file system takes."""


def capture_file_name(request_id: str, salt: str = "") -> str:
    """The file name of one request's capture: `<prefix>-<digest>.safetensors`.

    `prefix` is the request id's first 64 characters with each run of characters other than
    ASCII letters, digits, `_` and `-` replaced by one `_`, and leading `-` removed (`req`
    when nothing is left); `digest` is the first 32 hex digits of the SHA-256 of `salt` and
    the whole id. The name is at most 109 characters, has no `/`, no `.` before its suffix
    (never `.`, `..` or a hidden file) and no control or non-ASCII character, so it stays a
    plain name inside whatever directory it is joined to. Distinct ids give distinct names,
    and so does one id with distinct salts (the connector salts with a serial number, so
    requests that share an id keep their own files).
    """
    prefix = _NOT_IN_A_NAME.sub("_", request_id[:PREFIX_MAX]).lstrip("-") or "req"
    seed = salt.encode("utf-8", "surrogatepass") + b"\0" + request_id.encode("utf-8", "surrogatepass")
    return f"{prefix}-{hashlib.sha256(seed).hexdigest()[:DIGEST_HEX]}{SUFFIX}"


def path_inside(directory: str | os.PathLike[str], path: str | os.PathLike[str]) -> str:
    """`path` (relative ones are taken from `directory`) if it resolves inside `directory`.

    Both are resolved with `os.path.realpath` (symbolic links followed, `..` applied); the
    result must lie strictly below the resolved directory, and each of its components, with
    room for the writer's `.lock` companion, must fit a file system's limits. Returns the
    path spelled under `directory` as given (made absolute, not resolved: a client on
    another host may mount the same storage through other links). Raises
    `UnsafePathError` otherwise, never `OSError`.
    """
    if not isinstance(path, (str, os.PathLike)) or not isinstance(directory, (str, os.PathLike)):
        raise UnsafePathError(f"a path must be a string, got {type(path).__name__}")
    try:
        base = os.path.abspath(directory)
        real_base = os.path.realpath(base)
        real = os.path.realpath(os.path.join(base, path))
        encoded = os.fsencode(real)
    except (ValueError, OSError) as exc:  # an embedded NUL, a name the file system cannot encode
        raise UnsafePathError(f"not a usable path: {exc}") from None
    inside = real != real_base and os.path.commonpath([real, real_base]) == real_base
    if not inside:
        raise UnsafePathError(f"{str(path)[:200]!r} is not inside the storage directory {base!r}")
    relative = os.path.relpath(real, real_base)
    spelled = os.path.join(base, relative)
    if len(os.fsencode(spelled)) + len(_LOCK_SUFFIX) >= _PATH_MAX or len(encoded) + len(_LOCK_SUFFIX) >= _PATH_MAX:
        raise UnsafePathError(f"the path is longer than the file system allows ({len(encoded)} bytes)")
    for part in relative.split(os.sep):
        if len(os.fsencode(part)) + len(_LOCK_SUFFIX) > _NAME_MAX:
            raise UnsafePathError(f"a path component is longer than the file system allows: {part[:60]!r}...")
    return spelled


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
    except (FileNotFoundError, NotADirectoryError):
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
        raise HiddenStatesError(
            f"hidden-states file not found: {path} (a capture the server could not write is "
            "logged there as 'Hidden-states capture failed')"
        )
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

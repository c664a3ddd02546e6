"""Tests for vllm_nvext.hidden_states.load (files written here with safetensors)."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from vllm_nvext.hidden_states import HiddenStates, HiddenStatesError, load  # noqa: E402

IDS = [5, 17, 3, 250]


def _tensors(num_tokens=4, num_layers=3, hidden=8, ids=None):
    hs = torch.arange(num_tokens * num_layers * hidden, dtype=torch.float32)
    hs = hs.reshape(num_tokens, num_layers, hidden) / 7.0
    token_ids = torch.tensor(IDS[:num_tokens] if ids is None else ids, dtype=torch.int64)
    return {"hidden_states": hs, "token_ids": token_ids}


def _write(path: Path, tensors) -> str:
    safetensors_torch.save_file(tensors, str(path))
    return str(path)


def _hold_exclusive(lock_path: str) -> int:
    """Take the writer's lock through a separate open file (flock conflicts across opens)."""
    fd = os.open(lock_path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_load_returns_tensors_and_metadata(tmp_path):
    tensors = _tensors()
    path = _write(tmp_path / "a.safetensors", tensors)
    hs = load(path, expect_token_ids=IDS)
    assert isinstance(hs, HiddenStates)
    assert hs.path == path
    assert hs.token_ids == IDS
    assert (hs.num_tokens, hs.num_layers, hs.hidden_size) == (4, 3, 8)
    assert torch.equal(hs.hidden_states, tensors["hidden_states"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        hs.num_tokens = 1  # type: ignore[misc]


def test_load_accepts_pathlike_and_free_lock_file(tmp_path):
    path = tmp_path / "a.safetensors"
    _write(path, _tensors())
    (tmp_path / "a.safetensors.lock").touch()  # writer done: lock file left, not held
    hs = load(path, timeout=0.5)
    assert hs.path == str(path)
    assert hs.token_ids == IDS


def test_held_lock_times_out_with_clear_error(tmp_path):
    path = _write(tmp_path / "a.safetensors", _tensors())
    fd = _hold_exclusive(path + ".lock")
    try:
        start = time.monotonic()
        with pytest.raises(HiddenStatesError, match=r"timed out after 0\.3s") as info:
            load(path, timeout=0.3)
        elapsed = time.monotonic() - start
    finally:
        os.close(fd)
    assert path + ".lock" in str(info.value)
    assert elapsed >= 0.3  # it waited the whole timeout before giving up
    assert load(path, timeout=0.3).token_ids == IDS  # lock released: now it loads


def test_waits_for_writer_thread_to_release_lock(tmp_path):
    path = str(tmp_path / "a.safetensors")
    fd = _hold_exclusive(path + ".lock")  # as the connector does before the write
    tensors = _tensors()

    released = threading.Event()

    def writer():
        time.sleep(0.2)  # lets the reader reach the lock first; nothing below depends on it
        safetensors_torch.save_file(tensors, path)
        released.set()
        os.close(fd)  # releases LOCK_EX

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        # The file does not exist until the writer is done: loading early would be "not found".
        hs = load(path, expect_token_ids=IDS, timeout=600.0)
        assert released.is_set(), "load returned before the writer released its lock"
    finally:
        thread.join()
    assert torch.equal(hs.hidden_states, tensors["hidden_states"])


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.safetensors")
    with pytest.raises(HiddenStatesError, match="not found") as info:
        load(path)
    assert path in str(info.value)


def test_missing_file_after_lock_released(tmp_path):
    # A writer that failed releases its lock without leaving a file.
    path = str(tmp_path / "nope.safetensors")
    Path(path + ".lock").touch()
    with pytest.raises(HiddenStatesError, match="not found"):
        load(path, timeout=0.5)


def test_not_a_safetensors_file(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"definitely not safetensors")
    with pytest.raises(HiddenStatesError, match="not a readable safetensors file"):
        load(path)


@pytest.mark.parametrize("key", ["hidden_states", "token_ids"])
def test_missing_key(tmp_path, key):
    tensors = _tensors()
    del tensors[key]
    path = _write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(HiddenStatesError, match=f"missing tensor '{key}'"):
        load(path)


def test_hidden_states_must_be_3d(tmp_path):
    tensors = _tensors()
    tensors["hidden_states"] = tensors["hidden_states"].reshape(4, 24)
    path = _write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(HiddenStatesError, match=r"'hidden_states' must be .*shape \[4, 24\]"):
        load(path)


def test_token_ids_must_be_1d(tmp_path):
    tensors = _tensors()
    tensors["token_ids"] = tensors["token_ids"].reshape(2, 2)
    path = _write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(HiddenStatesError, match=r"'token_ids' must be \[num_tokens\]"):
        load(path)


def test_token_count_mismatch(tmp_path):
    tensors = _tensors()
    tensors["token_ids"] = tensors["token_ids"][:3]
    path = _write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(HiddenStatesError, match="has 4 tokens but 'token_ids' has 3"):
        load(path)


def test_empty_layer_dimension(tmp_path):
    tensors = _tensors()
    tensors["hidden_states"] = torch.zeros(4, 0, 8)
    path = _write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(HiddenStatesError, match="empty dimension"):
        load(path)


def test_token_ids_must_be_integers(tmp_path):
    tensors = _tensors()
    tensors["token_ids"] = tensors["token_ids"].float()
    path = _write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(HiddenStatesError, match="non-integer dtype"):
        load(path)


def test_expected_ids_first_difference(tmp_path):
    path = _write(tmp_path / "a.safetensors", _tensors())
    with pytest.raises(HiddenStatesError, match="at index 2: file has 3, expected 99"):
        load(path, expect_token_ids=[5, 17, 99, 250])


def test_expected_ids_length_difference(tmp_path):
    path = _write(tmp_path / "a.safetensors", _tensors())
    with pytest.raises(HiddenStatesError, match=r"at index 4: file has <end>, expected 7 "):
        load(path, expect_token_ids=[*IDS, 7])
    with pytest.raises(HiddenStatesError, match=r"at index 3: file has 250, expected <end>"):
        load(path, expect_token_ids=IDS[:3])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values(tmp_path, bad):
    tensors = _tensors()
    tensors["hidden_states"][2, 1, 5] = bad
    path = _write(tmp_path / "a.safetensors", tensors)
    with pytest.raises(HiddenStatesError, match="1 non-finite values; first at token 2, layer 1, dim 5"):
        load(path)


def test_bfloat16_hidden_states_load(tmp_path):
    tensors = _tensors()
    tensors["hidden_states"] = tensors["hidden_states"].to(torch.bfloat16)
    path = _write(tmp_path / "a.safetensors", tensors)
    assert load(path).hidden_states.dtype == torch.bfloat16


def test_negative_timeout_rejected(tmp_path):
    path = _write(tmp_path / "a.safetensors", _tensors())
    with pytest.raises(ValueError, match="timeout must be >= 0"):
        load(path, timeout=-1)


def test_module_imports_without_torch():
    code = (
        "import sys, vllm_nvext.hidden_states as m; "
        "assert 'torch' not in sys.modules and 'safetensors' not in sys.modules, "
        "sorted(k for k in sys.modules if k.split('.')[0] in ('torch', 'safetensors'))[:5]; "
        "print(m.load.__name__)"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "load"


def test_missing_file_says_where_the_server_tells_why(tmp_path):
    path = str(tmp_path / "nope.safetensors")
    with pytest.raises(HiddenStatesError, match="logged there as 'Hidden-states capture failed'"):
        load(path)


def test_missing_storage_directory_is_not_found_not_an_os_error(tmp_path):
    # The directory in the path is a file (storage gone, or replaced): a clear "not found".
    (tmp_path / "storage").write_bytes(b"not a directory")
    path = str(tmp_path / "storage" / "a.safetensors")
    with pytest.raises(HiddenStatesError, match="not found") as info:
        load(path, timeout=0.5)
    assert path in str(info.value)

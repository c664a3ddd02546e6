"""Where the e2e tests, the fixture recorder and the 0.33 harness look for the reference venvs."""

from __future__ import annotations

from pathlib import Path

from vllm_nvext.tools.reference_venvs import is_built, refs_dir


def test_refs_dir_is_the_environments_or_else_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_NVEXT_REFS", str(tmp_path))
    assert refs_dir() == tmp_path
    monkeypatch.setenv("VLLM_NVEXT_REFS", "")  # empty means the default, as in the setup scripts
    assert refs_dir() == Path.home() / ".cache" / "vllm-nvext" / "refs"
    monkeypatch.delenv("VLLM_NVEXT_REFS")
    assert refs_dir() == Path.home() / ".cache" / "vllm-nvext" / "refs"


def test_a_venv_is_built_once_its_setup_wrote_the_stamp_and_what_is_needed_exists(tmp_path):
    python = tmp_path / "bin" / "python"
    assert not is_built(tmp_path), "no stamp: the set-up did not finish"
    (tmp_path / ".setup-stamp").touch()
    assert is_built(tmp_path)
    assert not is_built(tmp_path, python), "a needed file is missing"
    python.parent.mkdir()
    python.touch()
    assert is_built(tmp_path, python)

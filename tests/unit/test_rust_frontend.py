"""Never silent under vLLM's Rust frontend: a server configured for vllm-nvext refuses to start.

`VLLM_USE_RUST_FRONTEND=1 vllm serve` serves HTTP from `vllm-rs`, which loads no endpoint plugin
and refuses `--middleware`. vLLM's general plugin `nvext` (`refuse_rust_frontend`) runs in its
Python processes, the `vllm serve` command's own first, and stops one configured with
`VLLM_PLUGINS=nvext`; `vllm-nvext serve` checks the variable itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from tests.helpers import general_plugin_dist
from vllm_nvext._vllm_compat import rust_frontend_on
from vllm_nvext.plugin import refuse_rust_frontend
from vllm_nvext.tools import cli

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("value", ["1", "2", " 1 ", "true", "ON"])
@pytest.mark.parametrize("plugins", ["nvext", "other,nvext"])
def test_the_rust_frontend_with_nvext_configured_refuses_to_start_pointing_at_the_proxy(value, plugins):
    with pytest.raises(SystemExit) as stop:
        refuse_rust_frontend({"VLLM_USE_RUST_FRONTEND": value, "VLLM_PLUGINS": plugins})
    message = str(stop.value.code)
    assert "Rust" in message and "vllm-nvext proxy --upstream" in message, "says why, and what works"
    assert "silently" in message


@pytest.mark.parametrize(
    "env",
    [
        {"VLLM_PLUGINS": "nvext"},  # the Python frontend: the plugin mounts
        {"VLLM_USE_RUST_FRONTEND": "0", "VLLM_PLUGINS": "nvext"},
        {"VLLM_USE_RUST_FRONTEND": "", "VLLM_PLUGINS": "nvext"},
        {"VLLM_USE_RUST_FRONTEND": "1"},  # no VLLM_PLUGINS: vLLM loads no endpoint plugin anyway
        {"VLLM_USE_RUST_FRONTEND": "1", "VLLM_PLUGINS": "other"},
        {"VLLM_USE_RUST_FRONTEND": "1", "VLLM_PLUGINS": "nvext-other"},
        {"VLLM_USE_RUST_FRONTEND": "no", "VLLM_PLUGINS": "nvext"},
    ],
)
def test_any_other_server_starts(env):
    assert refuse_rust_frontend(env) is None


def test_it_reads_the_process_environment(monkeypatch):
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "nvext")
    assert rust_frontend_on() == "1"
    with pytest.raises(SystemExit):
        refuse_rust_frontend()


def test_the_general_plugin_is_registered_under_the_endpoint_plugins_name():
    """vLLM loads a general plugin when VLLM_PLUGINS is unset or names it: `nvext` is the name to share."""
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert entry_points["vllm.general_plugins"] == {"nvext": "vllm_nvext.plugin:refuse_rust_frontend"}
    assert set(entry_points["vllm.endpoint_plugins"]) == {"nvext"}


def test_vllm_nvext_serve_refuses_under_the_rust_frontend(monkeypatch, capsys):
    monkeypatch.setenv("VLLM_USE_RUST_FRONTEND", "1")
    monkeypatch.setattr(cli, "VllmServer", None)  # nothing may start
    assert cli.main(["serve", "--model", "m"]) == cli.EXIT_MISSING
    err = capsys.readouterr().err
    assert err.startswith("vllm-nvext serve: error: VLLM_USE_RUST_FRONTEND=1") and "vllm-nvext proxy" in err


@pytest.mark.parametrize(("rust", "refused"), [("1", True), ("0", False)])
def test_vllms_own_loader_runs_the_general_plugin(tmp_path, rust, refused):
    """vLLM's `load_general_plugins` (what `vllm serve` calls while building its parser) finds the entry
    point as pyproject.toml declares it (written here as an installed distribution's metadata)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("vllm")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(general_plugin_dist(tmp_path))])}
    env.update(VLLM_USE_RUST_FRONTEND=rust, VLLM_PLUGINS="nvext")
    code = "from vllm.plugins import load_general_plugins; load_general_plugins(); print('serving')"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if refused:
        assert result.returncode == 1 and "serving" not in result.stdout
        assert "vllm-nvext proxy --upstream" in result.stderr
    else:
        assert result.returncode == 0 and "serving" in result.stdout, result.stderr[-2000:]

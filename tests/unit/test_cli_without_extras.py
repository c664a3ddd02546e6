"""`pip install vllm-nvext` brings only orjson: each command says what else it needs.

Each command runs in a fresh interpreter whose import system cannot see vLLM, torch,
transformers, tokenizers, safetensors, httpx, aiohttp or starlette, exactly as in a venv without them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from vllm_nvext.tools import cli

HIDDEN = (
    "vllm", "torch", "transformers", "tokenizers", "safetensors", "httpx", "httpcore", "aiohttp", "openai",
    "starlette", "uvicorn",
)  # fmt: skip

# Replaces the path finder with one that does not find the hidden packages: `import vllm` then
# raises ModuleNotFoundError and `importlib.util.find_spec("vllm")` answers None.
RUN_WITHOUT_EXTRAS = textwrap.dedent(
    """
    import importlib.machinery, sys

    HIDDEN = set(sys.argv[1].split(","))

    class WithoutExtras(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in HIDDEN:
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [WithoutExtras if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    from vllm_nvext.tools.cli import main

    status = main(sys.argv[2:])
    assert not any(m.partition(".")[0] in HIDDEN for m in sys.modules), "a hidden package was imported"
    sys.exit(status)
    """
)


def run_without_extras(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", RUN_WITHOUT_EXTRAS, ",".join(HIDDEN), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["serve"], "needs vLLM (vllm not installed): install the vLLM build for your hardware"),
        (["serve", "--model", "some/model"], "needs vLLM (vllm not installed)"),
        (
            ["tiny-model", "DIR"],
            "needs torch and transformers (torch, transformers not installed): pip install 'vllm-nvext[tiny-model]'",
        ),  # fmt: skip
        (
            ["parity", "--url", "http://127.0.0.1:9"],
            "needs httpx, which is not installed: pip install 'vllm-nvext[client]'",
        ),  # fmt: skip
        (
            ["proxy", "--upstream", "http://127.0.0.1:9"],
            "needs aiohttp and uvicorn (aiohttp, uvicorn not installed): pip install 'vllm-nvext[proxy]'",
        ),  # fmt: skip
    ],
    ids=["serve", "serve-model", "tiny-model", "parity", "proxy"],
)
def test_each_command_names_what_it_needs_in_one_line(tmp_path, argv, says):
    argv = [str(tmp_path / a) if a == "DIR" else a for a in argv]
    result = run_without_extras(*argv)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line
    assert result.stderr.startswith(f"vllm-nvext {argv[0]}: error: ")
    assert says in result.stderr
    assert not (tmp_path / "DIR").exists()


def test_the_blocker_hides_only_the_extras():
    """The same interpreter set-up still runs what needs nothing more: `--help`, and parity's usage errors."""
    result = run_without_extras("parity", "--help")
    assert result.returncode == 0 and "--baseline-url" in result.stdout


# In-process twins of the checks above: what each command does when something is missing.


def test_serve_stops_before_starting_anything_when_vllm_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(cli, "missing_modules", lambda *names: [n for n in names if n == "vllm"])
    monkeypatch.setattr(cli, "VllmServer", None)  # would fail loudly if serve went on
    assert cli.main(["serve"]) == cli.EXIT_MISSING
    assert capsys.readouterr().err.startswith("vllm-nvext serve: error: needs vLLM (vllm not installed)")


def test_serve_of_the_tiny_model_names_its_own_needs(monkeypatch, capsys):
    monkeypatch.setattr(cli, "missing_modules", lambda *names: [n for n in names if n == "transformers"])
    assert cli.main(["serve"]) == cli.EXIT_MISSING
    err = capsys.readouterr().err
    assert "needs torch and transformers for the tiny model (transformers not installed)" in err


def test_missing_looks_modules_up_without_importing_them():
    assert cli.missing_modules("json", "vllm_nvext_no_such_module", "no_such.sub") == [
        "vllm_nvext_no_such_module",
        "no_such.sub",
    ]

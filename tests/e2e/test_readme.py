"""The README's examples against the project's first command: every `curl` of README.md, run as printed
(with its port), to `vllm-nvext serve` started as `make serve` starts it (the `serve` kind).

Each answer must carry the ids the README shows where it shows them (`"token_ids":[...]` and the like
in the printed answer); the Claude-Code request to /v1/messages must be answered with its `nvext`
ids, which needs the endpoint plugin mounted beside the middleware (docs/agents.md).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

# `make serve`'s server is one more vLLM: it runs in the proxy group's pytest run, never beside the main
# group's servers (which leave about 1 GB of the machine's 24 free).
pytestmark = [pytest.mark.e2e, pytest.mark.e2e_readme]

README = Path(__file__).resolve().parents[2] / "README.md"
ID_FIELDS = ("token_ids", "prompt_token_ids", "completion_token_ids")


def readme_curls() -> list[tuple[str, str]]:
    """(command, the answer the README prints under it) for each `$ curl` of README.md's console blocks."""
    examples = []
    for block in re.findall(r"```console\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        lines = block.splitlines()
        i = 0
        while i < len(lines):
            if not lines[i].startswith("$ curl"):
                i += 1
                continue
            command = [lines[i][2:]]
            while command[-1].endswith("\\"):
                i += 1
                command.append(lines[i])
            i += 1
            shown = []
            while i < len(lines) and not lines[i].startswith("$ "):
                shown.append(lines[i])
                i += 1
            examples.append(("\n".join(command), "\n".join(shown)))
    return examples


EXAMPLES = readme_curls()


def test_the_readme_has_the_examples_this_file_runs():
    paths = [re.search(r"localhost:8000(\S+)", command).group(1) for command, _ in EXAMPLES]  # type: ignore[union-attr]
    assert paths == ["/v1/completions", "/v1/completions", "/v1/responses", "/v1/messages"]


@pytest.mark.parametrize(("command", "shown"), EXAMPLES, ids=[f"curl{i}" for i in range(len(EXAMPLES))])
def test_every_readme_curl_answers_the_ids_it_shows(serve_server, command, shown):
    port = serve_server.url.rsplit(":", 1)[1]
    run = subprocess.run(
        ["bash", "-c", command.replace("localhost:8000", f"127.0.0.1:{port}")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    answer = run.stdout
    assert run.returncode == 0 and answer, run.stderr
    assert '"error"' not in answer, answer
    for name in ID_FIELDS:
        if re.search(rf'"{name}":\[(\d|\.\.\.)', shown):
            assert re.search(rf'"{name}":\[\d', answer), f"the README shows {name}; the answer has none: {answer}"
    if "/v1/messages" in command:  # Claude Code's route: ids only through the plugin mount
        message = json.loads(answer)
        assert message["type"] == "message" and message["nvext"]["completion_token_ids"]

"""`vllm-nvext parity` without servers: usage errors are exit status 2 with a clear message."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

from tests.helpers import run_parity


def test_unreachable_server_is_exit_2_with_a_clear_message():
    # A port bound but not listening refuses connections, and nothing else can take it meanwhile.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        status, table, progress, _ = run_parity("--url", f"http://127.0.0.1:{port}")
    assert status == 2
    assert f"cannot reach http://127.0.0.1:{port}" in progress
    assert table == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"prompt": "ok"}\n{"promt": "typo"}\n', r"prompts.jsonl:2: unknown key\(s\) \['promt'\]"),
        ('{"prompt": "a", "messages": []}\n', "exactly one of"),
        ('{"prompt_token_ids": [1, -2]}\n', "non-negative integers"),
        ("not json\n", "prompts.jsonl:1: not JSON"),
        ("\n\n", "no prompts"),
    ],
)
def test_bad_prompts_file_is_exit_2_naming_the_line(tmp_path, content, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    status, _, progress, _ = run_parity("--url", "http://127.0.0.1:9", "--prompts", str(prompts))
    assert status == 2
    assert re.search(message, progress), progress


def test_parity_is_wired_into_the_cli():
    result = subprocess.run(
        [sys.executable, "-m", "vllm_nvext.tools.cli", "parity", "--help"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0
    for option in ("--url", "--baseline-url", "--prompts", "--hidden-states", "--json", "--model", "--max-tokens"):
        assert option in result.stdout

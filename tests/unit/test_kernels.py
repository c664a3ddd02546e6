"""The compiled twins (csrc/, one extension: `vllm_nvext._speedups`) as C code: one file per twin, each
naming its Python twin and its oracle, and a build with every warning an error.

`make test-sanitize` runs the kernel tests (this file, test_stream_send.py, test_stream_finish.py,
test_unary_plain.py, test_request_splice.py, test_attack_shortcuts.py, test_attack_stream_round2.py) on an
AddressSanitizer + UndefinedBehaviorSanitizer build of the same sources.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"


def _compiler_or_skip() -> None:
    if platform.python_implementation() != "CPython" or shutil.which("gcc") is None and shutil.which("cc") is None:
        if os.environ.get("VLLM_NVEXT_REQUIRE_EXTENSION"):
            pytest.fail("no C compiler: the compiled twins cannot be built here")
        pytest.skip("no C compiler (or not CPython): the pure-Python path runs")


def test_every_compiled_twin_builds_with_every_warning_an_error(tmp_path: Path) -> None:
    """A warning in any file of the extension (-Wall -Wextra) fails the build the tests make, and a failed
    build fails the command instead of leaving the pure-Python path as an install would."""
    _compiler_or_skip()
    env = {**os.environ, "VLLM_NVEXT_STRICT_BUILD": "1"}
    env.pop("VLLM_NVEXT_NO_EXTENSION", None)
    where = ["--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")]
    done = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--force", *where],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"the strict build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    compiled = {Path(m).name for m in re.findall(r"-c (\S+\.c) ", done.stdout + done.stderr)}
    assert compiled == {p.name for p in CSRC.glob("*.c")}, "every file of csrc/ is part of the one extension"
    for line in (done.stdout + done.stderr).splitlines():
        if re.search(r"-c \S+\.c ", line):
            assert "-Wall" in line and "-Wextra" in line and "-Werror" in line, line
    assert list((tmp_path / "lib" / "vllm_nvext").glob("_speedups*")), "the extension was built"


@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
def test_each_c_file_names_its_python_twin_and_its_oracle(source: str) -> None:
    """Each file's head says which Python function it must agree with and which test proves that it does,
    and the test it names exists."""
    head = (CSRC / source).read_text(encoding="utf-8").split("*/", 1)[0]
    twin = re.search(r"\* Python twin: (.+)", head)
    oracle = re.search(r"\* Oracle: (.+)", head)
    assert twin and oracle, f"csrc/{source} names no Python twin or no oracle"
    for test in re.findall(r"tests/unit/\w+\.py", head):
        assert (ROOT / test).is_file(), f"csrc/{source} names {test}, which does not exist"

"""The compiled twins (csrc/, one extension: `vllm_nvext._speedups`) as C code: one file per twin, each
naming its Python twin and its oracle, and a build with every warning an error; and the seam that picks
them (`vllm_nvext.kernels`): a stub that types every export, a Python twin for each compiled kernel.

`make test-sanitize` runs the kernel tests (this file, test_stream_send.py, test_stream_finish.py,
test_unary_plain.py, test_request_splice.py, test_attack_shortcuts.py, test_attack_stream_round2.py) on an
AddressSanitizer + UndefinedBehaviorSanitizer build of the same sources.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.kernels import kernels_for
from vllm_nvext.kernels import PYTHON as PYTHON_RECORD
from vllm_nvext.kernels import Kernels

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
def test_each_c_file_stays_within_the_layouts_margin(source: str) -> None:
    """A file of csrc/ is held to a module's margin (tests/unit/test_layers.py: 400 lines of the 450 ceiling):
    a twin that outgrows it is cut into steps, the bytes it writes beside their checks (as stream_send.c's)."""
    from tests.unit.test_layers import MODULE_LINES_HELD

    lines = (CSRC / source).read_text(encoding="utf-8").count("\n")
    assert lines <= MODULE_LINES_HELD, f"csrc/{source}: {lines} lines"


def c_functions(text: str) -> dict[str, int]:
    """Each function defined in a C file of csrc/'s style (its name at the start of a line, its type on the line
    before, its body closed by a `}` at the start of a line): its length in lines, type line included."""
    lines = text.split("\n")
    lengths: dict[str, int] = {}
    name, start = None, 0
    for number, line in enumerate(lines):
        found = re.match(r"([A-Za-z_]\w*)\(", line)
        if found and number > 0 and lines[number - 1] and not lines[number - 1].startswith((" ", "#", "/", "}")):
            name, start = found.group(1), number - 1
        elif line.startswith("}") and name is not None:
            lengths[name] = number - start + 1
            name = None
    return lengths


@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
def test_each_c_function_stays_within_the_layouts_margin(source: str) -> None:
    """A function of csrc/ is held to a server function's margin (tests/unit/test_layers.py: 52 lines of the 60
    ceiling): a long one is cut into steps (StreamSend's call, splice_root, finish_span, learn_splice)."""
    from tests.unit.test_layers import FUNCTION_LINES_HELD

    functions = c_functions((CSRC / source).read_text(encoding="utf-8"))
    assert functions, f"csrc/{source}: no function found"
    assert {name: n for name, n in functions.items() if n > FUNCTION_LINES_HELD} == {}


def test_the_c_function_reader_sees_a_long_function() -> None:
    body = "\n".join(f"    x += {k};" for k in range(60))
    text = f"/* a file */\nstatic int\nlong_one(int x)\n{{\n{body}\n    return x;\n}}\n"
    assert c_functions(text) == {"long_one": 65}


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


def test_the_stub_types_every_compiled_kernel_and_nothing_else() -> None:
    """`_speedups.pyi` names exactly what the extension exports, so mypy checks every use of it."""
    kernels_for("c")  # skipped, or failed under VLLM_NVEXT_REQUIRE_EXTENSION, where the extension is not built
    from vllm_nvext import _speedups

    exported = {name for name in dir(_speedups) if not name.startswith("_")}
    stub = ast.parse((ROOT / "vllm_nvext" / "_speedups.pyi").read_text(encoding="utf-8"))
    typed = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name[0] != "_"}
    assert typed == exported


def test_each_python_twin_takes_the_arguments_the_stub_gives_its_compiled_twin() -> None:
    """Same name, same parameters: each function `_speedups.pyi` types is the Python record's field of that name,
    taking the same parameters in the same order (`StreamSend`: its constructor's, `python_stream_send`'s)."""
    import inspect

    from vllm_nvext.kernels import PYTHON

    stub = ast.parse((ROOT / "vllm_nvext" / "_speedups.pyi").read_text(encoding="utf-8"))
    typed = {}
    for node in stub.body:
        if isinstance(node, ast.FunctionDef):
            typed[node.name] = [a.arg for a in node.args.args]
        elif isinstance(node, ast.ClassDef) and node.name == "StreamSend":
            init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
            typed["stream_send"] = [a.arg for a in init.args.args[1:]]
    assert set(typed) == {f.name for f in dataclasses.fields(Kernels)} - {"impl", "scans_plain"}
    for name, parameters in typed.items():
        assert list(inspect.signature(getattr(PYTHON, name)).parameters) == parameters, name


def test_each_kernel_of_the_compiled_record_is_compiled_and_each_has_a_python_twin() -> None:
    """The compiled record holds no Python fallback, and the Python record fills every field the compiled one
    does, with a function of the same name (the twin `_speedups.pyi` names beside each compiled one)."""
    compiled = kernels_for("c")
    python = kernels_for("python")
    for field in dataclasses.fields(Kernels):
        if field.name in ("impl", "stream_send", "scans_plain"):
            continue
        assert callable(getattr(compiled, field.name)), field.name
        assert type(getattr(compiled, field.name)).__name__ == "builtin_function_or_method", field.name
        assert callable(getattr(python, field.name)), field.name
        assert getattr(python, field.name).__name__ == getattr(compiled, field.name).__name__ == field.name
    assert (compiled.impl, python.impl) == ("c", "python")
    assert (compiled.scans_plain, PYTHON_RECORD.scans_plain) == (True, False), "the pure-Python path decodes"

    async def nowhere(message: Any) -> None:
        return None

    assert type(compiled.stream_send(nowhere, nowhere)[0]).__name__ == "StreamSend"

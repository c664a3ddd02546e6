"""The documentation holds together: every `docs/protocol.md §N` citation names a section that
exists, and every relative link in the project's markdown reaches a file (and heading) that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ROOT / "docs" / "protocol.md"
# Where code, tests and docs may cite the protocol document.
SOURCE_DIRS = ("vllm_nvext", "tests", "examples", "scripts", "benchmarks")
SOURCE_SUFFIXES = {".py", ".sh", ".md", ".toml", ".txt"}

# `docs/protocol.md §3`, `§1 and §3`, `§1, §3`, `§1/§3`, `§3.2`, `§1-§5`.
CITATION = re.compile(r"docs/protocol\.md((?:[\s,/-]|and\b|or\b|§\d+(?:\.\d+)*)*)")
SECTION = re.compile(r"§(\d+(?:\.\d+)*)(?:-§?(\d+))?")
# The old bare form, which names no file (spelled in two parts so that this line is not one).
BARE_CITATION = re.compile("PROTOCOL" + " §")
NUMBERED_HEADING = re.compile(r"^#{1,6} (\d+(?:\.\d+)*)\.?\s", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} (.+?)\s*#*\s*$", re.MULTILINE)


def _markdown_files() -> list[Path]:
    files = [
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "benchmarks" / "README.md",
    ]
    return [f for f in files if f.exists()]


def _source_files() -> list[Path]:
    files = [f for d in SOURCE_DIRS for f in sorted((ROOT / d).rglob("*")) if f.suffix in SOURCE_SUFFIXES]
    files = [f for f in files if f.is_file() and "fixtures" not in f.relative_to(ROOT).parts]
    return sorted(set(files + _markdown_files()))


def _protocol_sections() -> set[str]:
    return set(NUMBERED_HEADING.findall(PROTOCOL.read_text()))


def _cited_sections(text: str) -> list[str]:
    cited: list[str] = []
    for citation in CITATION.finditer(text):
        for first, last in SECTION.findall(citation.group(1)):
            if last:
                cited += [str(n) for n in range(int(first), int(last) + 1)]
            else:
                cited.append(first)
    return cited


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    anchors: set[str] = set()
    for heading in HEADING.findall(FENCE.sub("", markdown.read_text())):
        base = slug(heading)
        anchor, n = base, 0
        while anchor in anchors:  # repeated headings get -1, -2, ...
            n += 1
            anchor = f"{base}-{n}"
        anchors.add(anchor)
    return anchors


def test_citation_parsing():
    assert _cited_sections("see docs/protocol.md §1 and §3, then docs/protocol.md §3.2/§9.") == ["1", "3", "3.2", "9"]
    assert _cited_sections("(docs/protocol.md §1-§3)") == ["1", "2", "3"]
    assert _cited_sections("docs/protocol.md says nothing here §7") == []
    assert slug("3.2 Response selectors (`extra_fields`)") == "32-response-selectors-extra_fields"
    assert slug("5. Differences from Dynamo 1.6.1") == "5-differences-from-dynamo-161"


def test_the_protocol_document_numbers_its_sections():
    sections = _protocol_sections()
    assert {"1", "2", "3", "4", "5", "6", "7", "8", "9"} <= sections


def test_every_protocol_citation_resolves_to_a_section():
    sections = _protocol_sections()
    unresolved, bare = [], []
    for path in _source_files():
        text = path.read_text(errors="replace")
        name = path.relative_to(ROOT)
        for n, line in enumerate(text.splitlines(), 1):
            if BARE_CITATION.search(line):
                bare.append(f"{name}:{n}: {line.strip()}")
        unresolved += [f"{name}: §{s}" for s in _cited_sections(text) if s not in sections]
    assert not bare, "cite the protocol as `docs/protocol.md §N`:\n" + "\n".join(bare)
    assert not unresolved, f"no such section in {PROTOCOL.relative_to(ROOT)}:\n" + "\n".join(unresolved)


def test_the_code_cites_the_protocol_document():
    # The citations this test checks exist (a renamed document would otherwise pass vacuously).
    cited = [f for f in _source_files() if f.suffix == ".py" and _cited_sections(f.read_text())]
    assert len(cited) >= 5, cited


def _broken_links(markdown: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", markdown.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:
        path_part, _, anchor = target.partition("#")
        resolved = (markdown.parent / path_part).resolve() if path_part else markdown
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{target}: no heading with that anchor in {resolved.name}")
    return broken


# `tests/unit/test_x.py`, `tests/unit/test_x.py::test_name`, `tests/unit/test_x.py::test_prefix_*` in the markdown.
NAMED_PATH = re.compile(r"`((?:tests|vllm_nvext|scripts|benchmarks|examples|docs)/[\w./-]+)(?:::(\w+)(\*)?)?([^`]?)")


def _missing_names(text: str) -> list[str]:
    missing = []
    for path, test, prefix, after in NAMED_PATH.findall(text):
        if after and after in "*<{":
            continue  # a pattern such as `tests/e2e/test_*.py`
        target = ROOT / path
        if not target.exists():
            missing.append(f"{path}: no such file")
        elif test and not re.search(f"def {test}" + ("" if prefix else r"\b"), target.read_text()):
            missing.append(f"{path}::{test}{prefix}: no such test")
    return missing


def test_the_checks_find_what_is_broken(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Other page\n\n## 2. A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#2-a-section) [ok](#here) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere)\n\n## Here\n"
        "```\n[in code](ignored.md)\n```\n"
    )
    assert _broken_links(page) == [
        "missing.md: no such file",
        "other.md#nowhere: no heading with that anchor in other.md",
    ]
    text = "`tests/unit/test_docs.py::test_the_checks_find_what_is_broken`, `tests/unit/test_docs.py::test_the_*`"
    text += ", `tests/e2e/test_*.py`"
    assert _missing_names(text) == []
    assert _missing_names("`tests/test_nothing.py` `tests/unit/test_docs.py::test_not_here`") == [
        "tests/test_nothing.py: no such file",
        "tests/unit/test_docs.py::test_not_here: no such test",
    ]


@pytest.mark.parametrize("markdown", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_an_existing_file_and_heading(markdown: Path):
    broken = _broken_links(markdown)
    assert not broken, f"{markdown.relative_to(ROOT)}:\n" + "\n".join(broken)


@pytest.mark.parametrize("markdown", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_files_and_tests_named_in_the_docs_exist(markdown: Path):
    missing = _missing_names(markdown.read_text())
    assert not missing, f"{markdown.relative_to(ROOT)}:\n" + "\n".join(missing)


# A path under tests/, vllm_nvext/, scripts/, benchmarks/ or examples/ named in code, comments or
# build files (a moved or renamed file leaves these behind).
SOURCE_PATH = re.compile(
    r"(?<![\w/.])((?:tests|vllm_nvext|scripts|benchmarks|examples)/[\w/]+\.(?:py|sh|md|json))(?![\w*<{])"
)


def test_paths_named_in_the_code_and_build_files_exist():
    files = [f for f in _source_files() if f.suffix != ".md" and f != Path(__file__).resolve()]
    files += [ROOT / "Makefile", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    missing = []
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            gone = [p for p in SOURCE_PATH.findall(line) if not (ROOT / p).exists()]
            missing += [f"{path.relative_to(ROOT)}:{n}: {p}" for p in gone]
    assert len(files) > 50
    assert not missing, "no such file:\n" + "\n".join(missing)


def test_the_readme_stays_a_short_guide_whose_first_screen_has_the_two_commands_and_pip_install():
    """README.md is the first screen a new user reads: under 15,000 bytes (the reference lives in docs/), and
    its first 40 lines say what it is, give the two commands and `pip install` for one's own `vllm serve`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.encode()) < 15_000, f"README.md is {len(text.encode())} bytes: move detail to docs/"
    first_screen = "\n".join(text.splitlines()[:40])
    for needed in ("make serve", "make test", "pip install vllm-nvext", "--middleware vllm_nvext.NvextMiddleware"):
        assert needed in first_screen, needed

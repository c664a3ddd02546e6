"""The allow-list of differences from Dynamo 1.6.1 is docs/dynamo-differences.md's table, and says when it holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vllm_nvext.tools import dynamo_differences as dd

PAGE = Path(__file__).resolve().parents[2] / "docs" / "dynamo-differences.md"


def _page() -> str:
    text = PAGE.read_text()
    assert text.startswith(f"# Differences from Dynamo {dd.DYNAMO_VERSION}\n"), "the page names another version"
    return text


def test_docs_table_lists_exactly_the_allowed_differences():
    section = _page()
    assert dd.readme_table() in section, f"{PAGE.name} table out of date: paste dynamo_differences.readme_table()"
    rows = [line for line in section.splitlines() if re.match(r"^\| (?!difference |---)", line)]
    assert len(rows) == len(dd.DIFFERENCES)


def test_every_entry_says_what_who_and_why_and_ids_are_unique():
    assert len({d.id for d in dd.DIFFERENCES}) == len(dd.DIFFERENCES)
    for d in dd.DIFFERENCES:
        assert d.what and d.contract and d.reason, d.id
        assert "|" not in d.what + d.contract + d.reason, f"{d.id}: would break the docs table"
        d.applies({})  # every condition is one the matcher knows


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            {"nvext": {"extra_fields": ["completion_token_ids"]}},
            {"token-id-trio", "error-envelope", "server-reported-values", "greed-sampling"},
        ),
        (
            {"nvext": {"extra_fields": ["completion_token_ids", "prompt_token_ids"]}, "stream": True},
            {"stream-engine-metrics", "error-envelope", "server-reported-values", "greed-sampling"},
        ),
        (
            {"stop": ["x"], "n": 2, "nvext": {"extra_fields": ["engine_data"]}},
            {
                "stop-string-engine-data",
                "stop-string-unary-order",
                "several-choices-metrics",
                "error-envelope",
                "server-reported-values",
                "greed-sampling",
            },
        ),
        (
            {"stop": "x", "stream": True, "nvext": {"extra_fields": ["completion_token_ids", "engine_data"]}},
            {
                "stop-string-engine-data",
                "stream-engine-metrics",
                "token-id-trio",
                "error-envelope",
                "server-reported-values",
                "greed-sampling",
            },
        ),
        (
            {"prompt": ["a", "b"], "nvext": {"extra_fields": ["engine_data"]}},
            {
                "batch-prompt-selectors",
                "several-choices-metrics",
                "error-envelope",
                "server-reported-values",
                "greed-sampling",
            },
        ),
        (
            {"prompt": [1, 2], "nvext": {"extra_fields": ["engine_data"]}},
            {"error-envelope", "server-reported-values", "greed-sampling"},
        ),
    ],
)
def test_which_differences_hold_for_a_request(body, expected):
    assert {d.id for d in dd.find(body)} == expected


def test_a_missing_dynamo_venv_fails_naming_the_make_target(monkeypatch, tmp_path):
    from tests.e2e.dynamo_reference import DynamoMissing, DynamoReference

    monkeypatch.setenv("VLLM_NVEXT_REFS", str(tmp_path))
    monkeypatch.delenv("VLLM_NVEXT_REFS_BUILT", raising=False)  # as a make target that builds it runs
    with pytest.raises(DynamoMissing, match="make setup-dynamo"):
        DynamoReference(model=str(tmp_path)).start()

"""`vllm-nvext sessions export`: every session of a real store, one JSON document a line, for a trainer."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import jsonschema

from tests.support.capture import make_turn
from vllm_nvext.capture.store import open_sink
from vllm_nvext.tools import cli

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "tests" / "fixtures" / "formats" / "atif-v1.7.schema.json").read_text())


def _fill(url: str) -> None:
    sink = open_sink(url)
    sink.submit(make_turn("early", [1], [2], time=1_000.0))
    sink.submit(make_turn("late", [1, 2], [3], time=5_000.0))
    sink.submit(make_turn("late", [1, 2, 3, 4], [5], time=5_001.0))
    assert sink.flush()
    sink.close()


def test_export_writes_every_session_as_the_read_api_shows_it(store_url, tmp_path, capsys):
    _fill(store_url)
    out = tmp_path / "sessions.jsonl"
    assert cli.main(["sessions", "export", "--store", store_url, "--output", str(out)]) == 0
    docs = {d["session_id"]: d for d in map(json.loads, out.read_text().splitlines())}
    assert set(docs) == {"early", "late"}
    assert [t["extends_previous"] for t in docs["late"]["turns"]] == [None, True]
    assert "2 sessions exported" in capsys.readouterr().err


def test_export_since_keeps_the_later_turns_and_atif_validates(store_url, tmp_path):
    _fill(store_url)
    out = tmp_path / "atif.jsonl"
    args = ["sessions", "export", "--store", store_url, "--format", "atif", "--since", "1970-01-01T00:50:00+00:00"]
    assert cli.main([*args, "--output", str(out)]) == 0
    docs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [d["session_id"] for d in docs] == ["late"]
    for doc in docs:
        jsonschema.validate(doc, SCHEMA)
    assert [s["metrics"]["prompt_token_ids"] for s in docs[0]["steps"]] == [[1, 2], [1, 2, 3, 4]]


def test_the_progress_bar_shows_only_when_asked_off_a_terminal(tmp_path):
    url = f"sqlite:///{tmp_path / 'c.sqlite3'}"
    _fill(url)
    base = [sys.executable, "-m", "vllm_nvext.tools.cli", "sessions", "export", "--store", url]
    quiet = subprocess.run(base, capture_output=True, text=True, cwd=ROOT, check=True, timeout=120)
    assert "sessions [" not in quiet.stderr and len(quiet.stdout.splitlines()) == 2
    loud = subprocess.run([*base, "--progress"], capture_output=True, text=True, cwd=ROOT, check=True, timeout=120)
    assert "sessions [" in loud.stderr and "2/2" in loud.stderr


def test_a_bad_store_url_is_an_error_without_the_url(capsys):
    assert cli.main(["sessions", "export", "--store", "redis://:hunter2@127.0.0.1:notaport/0"]) == 2
    err = capsys.readouterr().err
    assert "error: capture:" in err and "hunter2" not in err


def test_a_mistyped_store_path_is_an_error_and_creates_no_store(tmp_path, capsys):
    _fill(f"sqlite:///{tmp_path / 'capture.sqlite3'}")
    typo = tmp_path / "captrue.sqlite3"
    assert cli.main(["sessions", "export", "--store", f"sqlite:///{typo}"]) == 2
    err = capsys.readouterr().err
    assert "there is no SQLite store at that path" in err and "sessions exported" not in err
    assert str(typo) not in err and not typo.exists(), "nothing created"


def test_a_backup_of_the_store_is_exported_as_it_is_and_never_written(tmp_path, capsys):
    """A backup (SQLite's `VACUUM INTO`: a file in rollback-journal mode), made read-only in a read-only folder, exports
    whole, and its bytes and its folder are as they were (the store opened for writing turned it into WAL mode)."""
    live = tmp_path / "capture.sqlite3"
    _fill(f"sqlite:///{live}")
    backups = tmp_path / "backups"
    backups.mkdir()
    backup = backups / "capture.sqlite3"
    with contextlib.closing(sqlite3.connect(live)) as conn:
        conn.execute("VACUUM INTO ?", (str(backup),))
    before = backup.read_bytes()
    backup.chmod(0o444)
    backups.chmod(0o555)
    try:
        out = tmp_path / "sessions.jsonl"
        assert cli.main(["sessions", "export", "--store", f"sqlite:///{backup}", "--output", str(out)]) == 0
        assert sorted(json.loads(line)["session_id"] for line in out.read_text().splitlines()) == ["early", "late"]
        assert backup.read_bytes() == before and sorted(p.name for p in backups.iterdir()) == ["capture.sqlite3"]
    finally:
        backups.chmod(0o755)
    assert "2 sessions exported" in capsys.readouterr().err

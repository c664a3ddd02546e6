"""`vllm-nvext sessions export`: the capture store's sessions for a trainer, one JSON document a line.

Reads the store directly (the same URL the server records to; docs/capture.md), never through the
server. `--format jsonl`: `{"session_id", "turns": [...]}` a line, the read API's shape; `--format
atif`: one ATIF trajectory a line; `--format nemo-gym`: one NeMo Gym record (`TokenEntry`) a turn, the turns
that make none counted on stderr. A progress bar goes to stderr on a terminal (or with --progress).
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import IO, Any

from ..capture import nemo_gym
from ..capture.atif import trajectory
from ..capture.base import Backend
from ..capture.store import open_backend
from ..config import ConfigError
from .capture_flags import warn_password_in_argv

EXIT_ERROR = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sessions_command", required=True)
    export = sub.add_parser("export", help="write every session of the store, one JSON document a line")
    export.add_argument(
        "--store", required=True, metavar="URL", help="the capture store (sqlite:////... or redis://...)"
    )
    export.add_argument(
        "--format",
        choices=("jsonl", "atif", "nemo-gym"),
        default="jsonl",
        help="jsonl: the read API's shape; atif: ATIF v1.7 trajectories; nemo-gym: NeMo Gym TokenEntry records",
    )
    export.add_argument(
        "--since",
        type=_since,
        default=None,
        help="only sessions with a turn at or after this time: unix seconds or ISO 8601 (2026-01-31T12:00:00+00:00)",
    )
    export.add_argument("--output", "-o", default="-", help="file to write (default: stdout)")
    export.add_argument("--progress", action="store_true", help="show the progress bar also when stderr is no terminal")


def _since(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError("expected unix seconds or an ISO 8601 time") from None
    return when.timestamp()


class Progress:
    """`sessions N/TOTAL` redrawn in place on stderr."""

    def __init__(self, total: int, stream: IO[str], on: bool) -> None:
        self.total, self.stream, self.on, self.done = total, stream, on, 0

    def step(self) -> None:
        self.done += 1
        if self.on and (self.done == self.total or self.done % 50 == 0):
            width = 30
            filled = width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\rsessions [{bar}] {self.done}/{self.total}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()


def export(
    backend: Backend,
    out: IO[str],
    fmt: str,
    since: float | None,
    progress: Progress | None = None,
    skipped: nemo_gym.Skipped | None = None,
) -> int:
    """Write the sessions; how many were written (`skipped`: adds the turns that made no NeMo Gym record)."""
    written = 0
    for session_id in list(backend.sessions(since)):
        turns: list[dict[str, Any]] = []
        start: int | None = 0
        while start is not None:
            page = backend.read(session_id, start, 64 * 1024 * 1024)
            if page is None:
                break
            turns.extend(json.loads(t) for t in page.turns)
            start = page.next_index
        if since is not None:
            turns = [t for t in turns if t["time"] >= since]
        if turns and fmt == "nemo-gym":
            made, left = nemo_gym.records(session_id, turns, first_page=turns[0]["index"] == 0)
            out.writelines(map(nemo_gym.line, made))
            written += bool(made)
            if skipped is not None:
                skipped.merge(left)
        elif turns:
            doc = trajectory(session_id, turns) if fmt == "atif" else {"session_id": session_id, "turns": turns}
            out.write(json.dumps(doc, separators=(",", ":")) + "\n")
            written += 1
        if progress is not None:
            progress.step()
    return written


def run(args: argparse.Namespace) -> int:
    warn_password_in_argv("sessions", args.store)
    try:
        backend = open_backend(args.store, read_only=True)  # never created nor written: a backup reads as it is
    except ConfigError as exc:
        print(f"vllm-nvext sessions: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        total = sum(1 for _ in backend.sessions(args.since))
        progress = Progress(total, sys.stderr, args.progress or sys.stderr.isatty())
        skipped = nemo_gym.Skipped()
        if args.output == "-":
            written = export(backend, sys.stdout, args.format, args.since, progress, skipped)
        else:
            with open(args.output, "w", encoding="utf-8") as out:
                written = export(backend, out, args.format, args.since, progress, skipped)
    except Exception as exc:
        print(f"vllm-nvext sessions: error: the store could not be read ({type(exc).__name__})", file=sys.stderr)
        return EXIT_ERROR
    finally:
        backend.close()
    print(f"vllm-nvext sessions: {written} sessions exported", file=sys.stderr)
    if skipped.total:
        print(
            f"vllm-nvext sessions: {skipped.total} turns left out, no NeMo Gym record: {skipped.describe()}"
            " (docs/capture.md, Trainer formats)",
            file=sys.stderr,
        )
    return 0

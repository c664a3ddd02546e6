"""Write tests/fixtures/formats/: the two trainer formats as their authors' own models define them.

    python -m scripts.trainer_formats atif WHEEL
        ATIF's JSON schema (`Trajectory.model_json_schema()`) from a Harbor wheel, to
        `atif-<version>.schema.json`, named by the models' default `schema_version` (Harbor 0.22.0: ATIF-v1.7).
    python -m scripts.trainer_formats token-entry RECORDS_PY --source NVIDIA-NeMo/Gym@COMMIT
        NeMo Gym's `TokenEntry` from its `nemo_gym/token_id_capture/records.py`, named by its
        `TOKEN_ENTRY_RECORD_SCHEMA_VERSION` N: `nemo-gym-token-entry-vN.schema.json` (its JSON schema),
        `nemo-gym-token-digests-vN.json` (what `compute_digest` and `encode_token_ids` give for fixed ids)
        and `nemo-gym-token-entries-vN.jsonl` (three records that `stamp_lineage` stamps, each line as
        NeMo Gym's `TokenCaptureStore.append` writes it).

The authors' code runs in a child process, never in this one, and none of it is written to the
repository: only what it outputs. tests/fixtures/formats/README.md says where each input comes from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import jsonschema

from scripts.atif_schema import trajectory_schema

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "formats"

# Fixed ids for the digest vectors: empty (a special case in NeMo Gym's `compute_digest`), the edges of
# the 8-byte big-endian encoding, and a long sequence; then two that it refuses.
DIGEST_CASES: list[list[int]] = [[], [0], [1, 2, 3], [151643], [2**32], [2**64 - 1], list(range(300))]
REFUSED_CASES: list[list[int]] = [[-1], [2**64]]

# Three calls of one rollout: a root; a child whose prompt extends the root's prompt + generation
# (RESOLVED to it); a call whose prompt does not (UNRESOLVED). Ids, logprobs and times are made up.
CALLS: list[dict[str, Any]] = [
    {
        "model_call_id": "chatcmpl-a",
        "prompt_token_ids": [1, 2, 3],
        "generation_token_ids": [4, 5],
        "generation_log_probs": [-0.5, -0.25],
        "created_at": 1767225600.0,
        "parent": None,
        "resolution": "root",
        "reason": "",
    },
    {
        "model_call_id": "chatcmpl-b",
        "prompt_token_ids": [1, 2, 3, 4, 5, 6],
        "generation_token_ids": [7],
        "generation_log_probs": [-0.125],
        "created_at": 1767225601.0,
        "parent": "chatcmpl-a",
        "resolution": "resolved",
        "reason": "",
    },
    {
        "model_call_id": "chatcmpl-c",
        "prompt_token_ids": [1, 2, 9],
        "generation_token_ids": [10, 11],
        "generation_log_probs": [-1.0, -2.0],
        "created_at": 1767225602.0,
        "parent": None,
        "resolution": "unresolved",
        "reason": "no_match",
    },
]

# Runs in the child, with the given records.py importable as `records`; prints one JSON document.
_TOKEN_ENTRY_CHILD = r"""
import json, sys
import orjson, pydantic
import records as r

cases, refused, calls = json.loads(sys.stdin.read())
out = {
    "pydantic": pydantic.VERSION,
    "schema_version": r.TOKEN_ENTRY_RECORD_SCHEMA_VERSION,
    "min_schema_version": getattr(r, "TOKEN_ENTRY_MIN_SCHEMA_VERSION", None),
    "digest_version": r.DIGEST_VERSION,
    "digest_domain": r._DIGEST_DOMAIN.decode(),
    "parent_resolution": [s.value for s in r.ParentResolutionStatus],
    "schema": r.TokenEntry.model_json_schema(),
    "vectors": [
        {"token_ids": ids, "encoding_hex": r.encode_token_ids(ids).hex() if len(ids) <= 8 else None,
         "digest": r.compute_digest(ids)}
        for ids in cases
    ],
    "refused": [],
    "lines": [],
}
for ids in refused:
    try:
        r.compute_digest(ids)
    except Exception as error:
        out["refused"].append({"token_ids": ids, "error": type(error).__name__})
    else:
        raise SystemExit(f"compute_digest accepted {ids}")
for call in calls:
    entry = r.TokenEntry(
        rollout_id="run-1",
        model_call_id=call["model_call_id"],
        model="tiny",
        prompt_token_ids=call["prompt_token_ids"],
        generation_token_ids=call["generation_token_ids"],
        generation_log_probs=call["generation_log_probs"],
        created_at=call["created_at"],
    )
    r.stamp_lineage(entry, call["parent"], parent_resolution=r.ParentResolutionStatus(call["resolution"]))
    entry.parent_resolution_reason = call["reason"]
    line = orjson.dumps(entry.model_dump(mode="json"), option=orjson.OPT_SORT_KEYS)
    r.TokenEntry.model_validate(orjson.loads(line))  # what their reader does with the line
    out["lines"].append(line.decode())
print(json.dumps(out))
"""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(name: str, document: Any) -> None:
    path = OUT / name
    path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path.relative_to(OUT.parents[2])}")


def write_atif(wheel: Path) -> None:
    schema = trajectory_schema(wheel)
    version = schema["$defs"]["Trajectory"]["properties"]["schema_version"]["default"]  # "ATIF-v1.7"
    jsonschema.Draft202012Validator.check_schema(schema)
    schema["$comment"] = (
        f"Generated by `python -m scripts.trainer_formats atif {wheel.name}` (sha256 {_sha256(wheel)}): "
        "Trajectory.model_json_schema() of harbor.models.trajectories. Not edited by hand."
    )
    OUT.mkdir(parents=True, exist_ok=True)
    _write(f"atif-{version.removeprefix('ATIF-')}.schema.json", schema)


def write_token_entry(records: Path, source: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(records, Path(tmp) / "records.py")
        env = {**os.environ, "PYTHONPATH": tmp}  # their module, in a child process only
        done = subprocess.run(
            [sys.executable, "-c", _TOKEN_ENTRY_CHILD],
            input=json.dumps([DIGEST_CASES, REFUSED_CASES, CALLS]),
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
    out = json.loads(done.stdout)
    version = out["schema_version"]
    provenance = (
        f"Generated by `python -m scripts.trainer_formats token-entry records.py --source {source}` from "
        f"nemo_gym/token_id_capture/records.py (sha256 {_sha256(records)}), pydantic {out['pydantic']}. "
        "Not edited by hand."
    )
    schema = out["schema"]
    jsonschema.Draft202012Validator.check_schema(schema)
    for line in out["lines"]:
        jsonschema.validate(json.loads(line), schema)
    schema["$comment"] = f"{provenance} TokenEntry.model_json_schema()."
    OUT.mkdir(parents=True, exist_ok=True)
    _write(f"nemo-gym-token-entry-v{version}.schema.json", schema)
    digests = {
        "$comment": f"{provenance} compute_digest(token_ids) and encode_token_ids(token_ids).hex() (up to 8 ids).",
        "schema_version": version,
        "min_schema_version": out["min_schema_version"],
        "digest_version": out["digest_version"],
        "digest_domain": out["digest_domain"],
        "parent_resolution": out["parent_resolution"],
        "vectors": out["vectors"],
        "refused": out["refused"],
    }
    _write(f"nemo-gym-token-digests-v{version}.json", digests)
    entries = OUT / f"nemo-gym-token-entries-v{version}.jsonl"
    entries.write_text("".join(line + "\n" for line in out["lines"]))
    print(f"wrote {entries.relative_to(OUT.parents[2])}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    atif = commands.add_parser("atif", help="ATIF's JSON schema from a Harbor wheel")
    atif.add_argument("wheel", type=Path, help="harbor-VERSION-py3-none-any.whl (0.22.0 for ATIF-v1.7)")
    token = commands.add_parser("token-entry", help="NeMo Gym's TokenEntry from its records.py")
    token.add_argument("records", type=Path, help="a copy of nemo_gym/token_id_capture/records.py")
    token.add_argument("--source", required=True, help="where it came from: REPOSITORY@COMMIT")
    args = parser.parse_args()
    if args.command == "atif":
        write_atif(args.wheel)
    else:
        write_token_entry(args.records, args.source)


if __name__ == "__main__":
    main()

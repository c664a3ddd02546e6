"""Write tests/fixtures/atif/trajectory.schema.json: the JSON schema of Harbor's ATIF `Trajectory` model.

Harbor (laude-institute/harbor) defines ATIF in pydantic models (`harbor.models.trajectories`) and
ships no schema file; this script loads those models from a Harbor wheel and writes
`Trajectory.model_json_schema()`. The wheel needs Python 3.12, the models do not:

    pip download --no-deps --only-binary=:all: --python-version 3.12 harbor==0.26.0 -d /tmp/harbor
    python -m scripts.atif_schema /tmp/harbor/harbor-0.26.0-py3-none-any.whl

`trajectory_schema` is also what `scripts.trainer_formats` writes ATIF v1.7's schema with.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "atif" / "trajectory.schema.json"
MODELS = "harbor/models/trajectories/"


def trajectory_schema(wheel: Path) -> dict[str, Any]:
    """`Trajectory.model_json_schema()` of the models in `wheel`, loaded in a child process."""
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith(MODELS) and name.endswith(".py"):
                archive.extract(name, tmp)
        for package in ("harbor", "harbor/models"):  # the models alone, not Harbor's heavy package root
            (Path(tmp) / package / "__init__.py").write_text("")
        dump = "import json, harbor.models.trajectories as t; print(json.dumps(t.Trajectory.model_json_schema()))"
        env = {**os.environ, "PYTHONPATH": tmp}  # the wheel's models, in a child process only
        done = subprocess.run([sys.executable, "-c", dump], env=env, capture_output=True, text=True, check=True)
    schema: dict[str, Any] = json.loads(done.stdout)
    return schema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="a Harbor wheel (harbor-VERSION-py3-none-any.whl)")
    args = parser.parse_args()
    schema = trajectory_schema(args.wheel)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT.relative_to(OUT.parents[3])} from {args.wheel.name}")


if __name__ == "__main__":
    main()

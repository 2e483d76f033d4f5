"""Every ``examples/*.py`` runs as it is, on the CPU, and exits 0 (new examples are picked up)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))


def test_there_are_examples() -> None:
    assert "quickstart.py" in [p.name for p in EXAMPLES]


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs_on_cpu(script: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSDK_")}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,  # examples must not depend on the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, f"{script.name} failed:\n{proc.stdout}\n{proc.stderr}"

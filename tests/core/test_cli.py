"""``python -m attnsdk info | demo``: what the README's demo command runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attnsdk as A
from attnsdk.__main__ import main


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSDK_")}
    return subprocess.run(
        [sys.executable, "-m", "attnsdk", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**clean, **env},
        check=False,
    )


def test_info() -> None:
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("attnsdk  python ")
    assert f"torch {torch.__version__}" in lines[0]
    assert lines[1].startswith("device   ")
    assert lines[2].startswith("backends on ")
    status: dict[str, str] = {}
    reasons: dict[str, list[str]] = {}
    name = ""
    engines = lines.index("engine adapters (tested releases; make test-engines):")
    assert lines[engines + 1].split()[:4] == ["sglang", "0.5.12.post1", "..", "0.5.23,"]
    assert lines[engines + 2].split()[:4] == ["vllm", "0.33.0", "..", "0.34.0,"]
    for line in lines[3:engines]:
        if line.startswith("      - "):  # a reason of the backend above
            reasons[name].append(line.strip()[2:])
        else:
            name, status[name] = line.split()
            reasons[name] = []
    assert set(status) == set(A.backend_names())
    assert status["reference"] == "available"
    for name, state in status.items():
        assert state in ("available", "unavailable"), name
        assert bool(reasons[name]) == (state == "unavailable"), name  # unavailable says why


def test_demo() -> None:
    proc = run_cli("demo", "--seed", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for key in ("backend ", "batch ", "layer ", "forward ", "check "):
        assert any(line.startswith(key) for line in out.splitlines()), key
    assert "KV cache identical" in out
    assert out.rstrip().endswith("demo OK")


def test_unknown_backend_is_a_message_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "refrence"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m attnsdk: error: unknown attention backend 'refrence'")
    assert "Did you mean 'reference'?" in err
    assert "Traceback" not in err


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "info" in capsys.readouterr().err

"""Runs one suite of ``attnsdk bench`` as a script: ``--out`` defaults to benchmarks/results."""

from __future__ import annotations

import sys

from attnsdk._cli.main import main


def run(suite: str) -> None:
    args = sys.argv[1:]
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", "benchmarks/results"]
    raise SystemExit(main(["bench", "--suite", suite, *args], prog=f"bench_{suite}"))

"""``attnsdk bench``: the benchmark suite over the installed backends, from an installed package.

On a CUDA machine: decode, prefill and mixed cases (Llama-3-8B attention, bf16, page 16) on every
backend that can run here, each next to its raw kernel (``_bench_raw``), eager and under graph
replay, against floors measured in the same run. Without CUDA it says so and runs a tiny CPU
benchmark of the backends that run on a CPU instead, with the same table and checks.

Exit status: 0 every row ran and matched the reference backend; 1 a backend failed, gave a wrong
answer, or nothing could run; 2 a usage error (an unknown ``--backend``).
"""

from __future__ import annotations

import difflib
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from attnsdk._bench.common import (
    DTYPE,
    LAYER,
    PAGE,
    SUITES,
    Suite,
    cases_for,
    format_table,
    measure_ceilings,
)
from attnsdk._bench.common import dumps as json_text
from attnsdk.contract.device import cuda_available, device_name
from attnsdk.contract.errors import UnsupportedConfigError
from attnsdk.contract.kv import KVCacheLayout
from attnsdk.selection.config import AttentionConfig
from attnsdk.selection.create import create_backend, explain
from attnsdk.selection.registry import backend_names

if TYPE_CHECKING:
    import argparse

    from attnsdk.contract.backend import Backend

__all__ = ["NO_CUDA", "parse_names", "run_bench", "select_backends"]

NO_CUDA = (
    "attnsdk bench: GPU benchmarks need CUDA, and torch sees no CUDA GPU here; running the CPU "
    "benchmark instead (backends that run on a CPU, tiny shapes, a few iterations)"
)


def parse_names(values: list[str] | None, choices: list[str], flag: str) -> list[str]:
    """``--flag a,b --flag c`` -> ``["a", "b", "c"]`` (each once, in order), matched to
    ``choices`` ignoring case; an unknown name is an error that lists the known ones.

    >>> parse_names(["FA3,reference", "fa3"], ["fa3", "reference"], "--backend")
    ['fa3', 'reference']
    """
    found: list[str] = []
    by_folded = {c.casefold(): c for c in choices}
    for value in values or []:
        for raw in value.split(","):
            name = raw.strip()
            if not name:
                continue
            match = by_folded.get(name.casefold())
            if match is None:
                close = difflib.get_close_matches(name.casefold(), list(by_folded), n=1)
                hint = f" Did you mean {by_folded[close[0]]!r}?" if close else ""
                raise UnsupportedConfigError(
                    f"{flag} {name!r}: unknown; known: {', '.join(choices)}.{hint}"
                )
            if match not in found:
                found.append(match)
    return found


def select_backends(names: list[str], device: str) -> tuple[list[str], dict[str, list[str]]]:
    """(backends to run, {backend skipped: why}) for the benchmark layer on ``device``.

    No names: every backend ``"auto"`` may pick that can run here, except on a GPU the
    ``reference`` backend (the oracle every row is checked against; name it to time it).
    """
    layout = KVCacheLayout(LAYER.num_kv_heads, LAYER.head_dim, PAGE, dtype=DTYPE)
    if names:
        reasons = {n: explain(n, LAYER, layout, device)[n] for n in names}
    else:
        reasons = explain(AttentionConfig(backend="auto"), LAYER, layout, device)
        if device == "cuda":
            reasons.pop("reference", None)
    run = [n for n, rs in reasons.items() if not rs]
    return run, {n: [str(r) for r in rs] for n, rs in reasons.items() if rs}


def run_bench(args: argparse.Namespace) -> int:
    from attnsdk import __version__
    from attnsdk._bench.suite import run_suite

    device = "cuda" if cuda_available() else "cpu"
    names = parse_names(args.backend, backend_names(), "--backend")
    suites: list[Suite] = [
        s for s in SUITES if s in parse_names(args.suite, list(SUITES), "--suite")
    ] or list(SUITES)
    if device == "cpu":
        print(NO_CUDA, file=sys.stderr)
    run, skipped = select_backends(names, device)
    for name, why in skipped.items():
        _note(f"skipped {name}: " + "; ".join(why))
    if not run:
        _note(f"no backend to benchmark on {device}")
        return 1
    settings = _settings(device, args.quick)
    started = time.perf_counter()
    try:
        ceilings = measure_ceilings(device, args.quick)
    except RuntimeError as exc:  # no triton on a CUDA machine: say what to install
        _note(f"attnsdk bench: {exc}")
        return 1
    _note(
        f"{device_name()}: copy {ceilings.copy_gbs:.0f} GB/s, "
        f"{ceilings.matmul_dtype} matmul {ceilings.matmul_tflops:.2f} TFLOP/s (measured now)"
    )
    backends: dict[str, Backend] = {}
    layout = KVCacheLayout(LAYER.num_kv_heads, LAYER.head_dim, PAGE, dtype=DTYPE)
    for name in run:
        try:
            backends[name] = create_backend(name, device=device, layers=[LAYER], layout=layout)
        except Exception as exc:  # reported with the skipped ones
            skipped[name] = [f"failed to start: {type(exc).__name__}: {exc}"]
            _note(f"skipped {name}: failed to start: {exc}")
    result: dict[str, Any] = {
        "attnsdk": __version__,
        "device": device_name(),
        "device_type": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "quick": bool(args.quick),
        "layer": {"num_heads": LAYER.num_heads, "num_kv_heads": LAYER.num_kv_heads,
                  "head_dim": LAYER.head_dim, "page_size": PAGE, "dtype": str(DTYPE)[6:]},
        "copy_ceiling_gbs": ceilings.copy_gbs,
        "matmul_ceiling_tflops": ceilings.matmul_tflops,
        "matmul_dtype": ceilings.matmul_dtype,
        "backends": list(backends),
        "backends_skipped": skipped,
        "suites": {},
    }  # fmt: skip
    for suite in suites:
        cases = cases_for(suite, device, args.quick)
        result["suites"][suite] = run_suite(
            cases, backends, LAYER, device, ceilings, settings, log=_progress
        )
    result["seconds"] = time.perf_counter() - started
    rows = [r for s in result["suites"].values() for r in s["rows"]]
    if args.out is not None:
        _write(Path(args.out), result)
    if args.json:
        sys.stdout.write(json_text(result))
    else:
        print(format_table(rows))
        for suite, data in result["suites"].items():
            for what in data["skipped"]:
                print(f"skipped {suite} {what}")
        print(_footer(result))
    failed = 0
    for r in rows:
        where = f"{r['suite']} {r['case']} {r['backend']}"
        if r.get("error") or r.get("correct") is False:
            failed += 1
            _note(f"FAILED {where}: {r.get('error') or 'wrong output'}")
        if r.get("raw_correct") is False:  # a wrong baseline makes its ratios meaningless
            failed += 1
            _note(f"FAILED {where}: the raw kernel's output is wrong ({r.get('raw_kernel')})")
        for key in ("raw_error", "raw_graph_error"):
            if r.get(key):
                _note(f"warning {where}: {key.replace('_', ' ')}: {r[key]}")
        if str(r.get("graph") or "").startswith("capture failed"):
            _note(f"warning {where}: graph {r['graph']}")
    return 1 if failed or not rows else 0


def _settings(device: str, quick: bool) -> Any:
    from attnsdk._bench.suite import Settings

    if device == "cuda":
        return Settings(budget_s=0.05, rep_ms=10.0) if quick else Settings()
    if quick:
        return Settings(budget_s=0.01, repeats=3, plan_calls=20)
    return Settings(budget_s=0.05, repeats=3, plan_calls=50)


def _footer(result: dict[str, Any]) -> str:
    return (
        f"per layer, forward only (each side's plan per step in its own column); "
        f"floors from copy {result['copy_ceiling_gbs']:.0f} GB/s and "
        f"{result['matmul_dtype']} matmul {result['matmul_ceiling_tflops']:.2f} TFLOP/s, "
        f"measured in this run on {result['device']}; {result['seconds']:.1f} s"
    )


def _write(out: Path, result: dict[str, Any]) -> None:
    """One ``<suite>.json`` per suite, with the top-level keys the single-suite scripts always
    wrote (device, torch, the ceiling, skipped, rows), and ``bench.json`` (all of it) when
    several suites ran."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if len(result["suites"]) > 1:  # a one-suite run (the scripts) would overwrite a full one
        (out / "bench.json").write_text(json_text(result))
        written.append("bench.json")
    common = {k: v for k, v in result.items() if k != "suites"}
    for suite, data in result["suites"].items():
        (out / f"{suite}.json").write_text(json_text({**common, "suite": suite, **data}))
        written.append(f"{suite}.json")
    _note(f"wrote {', '.join(written)} in {out}")


def _progress(row: dict[str, Any]) -> None:
    done = row.get("error") or (
        f"SDK {row.get('sdk_fwd_eager_us') or 0:.1f} us"
        + (f", raw {row['raw_eager_us']:.1f} us" if row.get("raw_eager_us") else "")
    )
    _note(f"  {row['suite']:<7} {row['case']:<32} {row['backend']:<11} {done}")


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

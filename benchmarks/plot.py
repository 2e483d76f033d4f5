"""Render the PNG plots from the benchmark JSON files (needs matplotlib; runs on any machine).

    python -m benchmarks.plot DIR   # reads DIR/{decode,prefill,mixed,plan}.json, writes DIR/*.png

decode.png / prefill.png / mixed.png: per case, one bar per backend for SDK/raw time (graph
replay where both sides were captured, else eager; backends without a raw kernel have no bar)
and one bar per backend and raw kernel for the share of the hardware floor reached. Files
written before the cross-backend suite (rows without "backend") are plotted as fa3.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _label(row: dict[str, Any]) -> str:
    if "case" in row:
        return str(row["case"])
    return f"{row['bs']}x{row['ctx'] // 1024}k"  # decode.json of the single-backend bench


def _ratio(row: dict[str, Any]) -> float | None:
    for key in ("graph_ratio", "fwd_eager_ratio", "eager_ratio"):
        if row.get(key):
            return float(row[key])
    return None


def _floor(row: dict[str, Any], side: str) -> float | None:
    """Share of the floor reached by the SDK (``side="sdk"``) or the raw kernel."""
    if side == "sdk":
        value = row.get("frac_of_floor") or row.get("kv_frac_of_copy") or row.get("frac_of_matmul")
        return float(value) if value else None
    best = row.get("raw_graph_us") or row.get("raw_eager_us")
    return float(row["floor_us"]) / float(best) if best and row.get("floor_us") else None


def plot_suite(folder: Path, suite: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = folder / f"{suite}.json"
    if not path.exists():
        return
    data = json.loads(path.read_text())
    rows = data["rows"]
    if not rows:
        return
    cases = list(dict.fromkeys(_label(r) for r in rows))
    backends = list(dict.fromkeys(r.get("backend", "fa3") for r in rows))
    by = {(_label(r), r.get("backend", "fa3")): r for r in rows}
    series = [(b, "sdk") for b in backends]
    series += [
        (b, "raw")
        for b in backends
        if any(_floor(r, "raw") for r in rows if r.get("backend", "fa3") == b)
    ]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(9, len(cases) * 0.9), 7), sharex=True)
    x = range(len(cases))
    width = 0.8 / max(1, len(backends))
    for i, b in enumerate(backends):
        ys = [_ratio(by[c, b]) if (c, b) in by else None for c in cases]
        ax1.bar(
            [j + (i - (len(backends) - 1) / 2) * width for j in x],
            [y or 0 for y in ys],
            width,
            label=b,
        )
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_ylabel("SDK / raw time (graph if captured)")
    ax1.set_title(f"{suite}: per layer, Llama-3-8B attention, bf16, page 16 (lower is better)")
    ax1.legend(fontsize=7)
    width = 0.8 / max(1, len(series))
    for i, (b, side) in enumerate(series):
        ys = [_floor(by[c, b], side) if (c, b) in by else None for c in cases]
        label = f"{b} (attnsdk)" if side == "sdk" else f"raw {b}"
        pos = [j + (i - (len(series) - 1) / 2) * width for j in x]
        ax2.bar(pos, [y or 0 for y in ys], width, label=label, hatch="" if side == "sdk" else "//")
    ax2.axhline(0.9, color="k", lw=0.8, ls="--")
    ax2.set_ylabel("floor time / measured time")
    ax2.set_xticks(list(x), cases, rotation=30, ha="right", fontsize=8)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / f"{suite}.png", dpi=80)
    plt.close(fig)


def plot_plan(folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = folder / "plan.json"
    if not path.exists():
        return
    rows = json.loads(path.read_text())["rows"]
    fig, ax = plt.subplots(figsize=(7, 4))
    backends = list(dict.fromkeys(r.get("backend", "fa3") for r in rows))
    for b in backends:
        mine = [r for r in rows if r.get("backend", "fa3") == b]
        bs = [r["bs"] for r in mine]
        ax.plot(bs, [r["plan_us"] for r in mine], "o-", label=f"{b} plan()")
        ax.plot(
            bs, [r["adopt_plus_plan_us"] for r in mine], "o--", label=f"{b} from_tensors + plan()"
        )
    first = [r for r in rows if r.get("backend", "fa3") == backends[0]]
    ax.plot(
        [r["bs"] for r in first],
        [r["sglang_build_us"] for r in first],
        "k^-",
        label="SGLang-style build",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("host µs per step")
    ax.set_title("Per-step metadata host time")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "plan.png", dpi=80)
    plt.close(fig)


def main(folder: Path) -> None:
    for suite in ("decode", "prefill", "mixed"):
        plot_suite(folder, suite)
    plot_plan(folder)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))

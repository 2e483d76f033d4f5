"""Render the PNG plots from the benchmark JSON files (needs matplotlib).

python benchmarks/plot.py DIR      # reads DIR/{decode,prefill,plan}.json, writes DIR/*.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if (folder / "decode.json").exists():
        data = json.loads((folder / "decode.json").read_text())
        rows = data["rows"]
        labels = [f"{r['bs']}x{r['ctx'] // 1024}k" for r in rows]
        x = range(len(rows))
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        w = 0.4
        ax1.bar([i - w / 2 for i in x], [r["eager_ratio"] for r in rows], w, label="eager")
        ax1.bar([i + w / 2 for i in x], [r["graph_ratio"] for r in rows], w, label="graph replay")
        ax1.axhline(1.0, color="k", lw=0.8)
        ax1.set_ylabel("attnsdk / raw time")
        ax1.set_title(
            "Decode per layer incl. KV write (Llama-3-8B, bf16, page 16), lower is better"
        )
        ax1.legend()
        ax2.bar(list(x), [r["kv_frac_of_copy"] for r in rows], color="tab:green")
        ax2.axhline(0.9, color="k", lw=0.8, ls="--")
        ax2.set_ylabel("KV read BW / copy BW")
        ax2.set_xticks(list(x), labels, rotation=45)
        ax2.set_xlabel("batch x context")
        fig.tight_layout()
        fig.savefig(folder / "decode.png", dpi=80)
    if (folder / "prefill.json").exists():
        data = json.loads((folder / "prefill.json").read_text())
        rows = data["rows"]
        x = range(len(rows))
        fig, ax = plt.subplots(figsize=(9, 4))
        w = 0.4
        ax.bar([i - w / 2 for i in x], [r["sdk_tflops"] for r in rows], w, label="attnsdk fa3")
        ax.bar([i + w / 2 for i in x], [r["raw_tflops"] for r in rows], w, label="raw FA3")
        ax.set_xticks(list(x), [r["case"] for r in rows], rotation=20)
        ax.set_ylabel("TFLOP/s (causal FLOPs)")
        ax.set_title(
            f"Prefill / extend (matmul ceiling {data['matmul_ceiling_tflops']:.0f} TFLOP/s)"
        )
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "prefill.png", dpi=80)
    if (folder / "plan.json").exists():
        rows = json.loads((folder / "plan.json").read_text())["rows"]
        bs = [r["bs"] for r in rows]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(bs, [r["plan_us"] for r in rows], "o-", label="attnsdk plan()")
        ax.plot(bs, [r["adopt_plus_plan_us"] for r in rows], "o-", label="from_tensors + plan()")
        ax.plot(bs, [r["sglang_build_us"] for r in rows], "o-", label="SGLang-style build")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel("host µs per step")
        ax.set_title("Per-step metadata host time")
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "plan.png", dpi=80)


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results"))

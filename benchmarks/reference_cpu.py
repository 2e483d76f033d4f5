"""How fast is the reference backend on a CPU? (issue #2: a 64-sequence mixed batch with 2k-token
contexts should take well under a second on 2 CPU cores.)

python benchmarks/reference_cpu.py [--threads 2] [--out benchmarks/results] [--plot]

Times one ``forward`` (KV write + attention) of one layer on batches of 64 sequences whose KV
length is 2048: decode-only, and mixed (every fourth sequence an extend of 64 new tokens, the
rest decode, in interleaved order). Prints a table and writes ``reference_cpu.json`` (and
``reference_cpu.png`` with ``--plot``, which needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from attnsdk import KVCacheLayout, LayerSpec
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, make_batch

BATCH, SEQ_LEN, EXTEND, PAGE = 64, 2048, 64, 16
# (name, Hq, Hkv, D): Llama-3-8B unsharded, and Llama-3-70B on one of 8 tensor-parallel ranks.
SHAPES = [("llama3-8b", 32, 8, 128), ("llama3-70b-tp8", 8, 1, 128)]
DTYPES = [torch.bfloat16, torch.float32]


def spec(kind: str) -> BatchSpec:
    query_lens = [EXTEND if kind == "mixed" and b % 4 == 3 else 1 for b in range(BATCH)]
    return BatchSpec(tuple(query_lens), (SEQ_LEN,) * BATCH, kind)


def time_forward(
    kind: str, hq: int, hkv: int, d: int, dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    """Wall seconds (min and median) and process CPU seconds (median) of one forward, each run
    on an untouched copy of the cache. On a busy machine the minimum and the CPU time are the
    steadier numbers."""
    layer = LayerSpec(hq, hkv, d)
    layout = KVCacheLayout(hkv, d, PAGE, dtype=dtype)
    batch = make_batch(spec(kind), layer, layout, pages="shuffled", spare_pages=0)
    backend = ReferenceBackend()
    plan = backend.plan(batch.metadata)
    wall, cpu = [], []
    for _ in range(repeats + 1):  # the first run warms up the allocator and thread pool
        cache = batch.fresh_cache()
        t0, c0 = time.perf_counter(), time.process_time()
        backend.forward(batch.q, batch.k, batch.v, cache, plan, layer)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return {
        "seconds_min": min(wall[1:]),
        "seconds_median": statistics.median(wall[1:]),
        "cpu_seconds_median": statistics.median(cpu[1:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--plot", action="store_true", help="also write reference_cpu.png")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rows: list[dict[str, Any]] = []
    print(f"reference backend, CPU, {args.threads} threads, {BATCH} sequences x {SEQ_LEN} KV")
    print(
        f"{'shape':16} {'dtype':9} {'batch':7} {'tokens':>6} {'KV MiB':>7} "
        f"{'min ms':>8} {'median ms':>9} {'CPU ms':>8}"
    )
    for name, hq, hkv, d in SHAPES:
        for dtype in DTYPES:
            for kind in ("decode", "mixed"):
                times = time_forward(kind, hq, hkv, d, dtype, args.repeats)
                kv_bytes = 2 * BATCH * SEQ_LEN * hkv * d * dtype.itemsize
                row = {
                    "shape": name,
                    "num_heads": hq,
                    "num_kv_heads": hkv,
                    "head_dim": d,
                    "dtype": str(dtype).removeprefix("torch."),
                    "batch": kind,
                    "num_seqs": BATCH,
                    "seq_len": SEQ_LEN,
                    "num_tokens": spec(kind).num_tokens,
                    "kv_mib": kv_bytes / 2**20,
                    **times,
                }
                rows.append(row)
                print(
                    f"{name:16} {row['dtype']:9} {kind:7} {row['num_tokens']:>6} "
                    f"{row['kv_mib']:>7.0f} {times['seconds_min'] * 1e3:>8.1f} "
                    f"{times['seconds_median'] * 1e3:>9.1f} {times['cpu_seconds_median'] * 1e3:>8.1f}"
                )

    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "reference_cpu",
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "threads": args.threads,
            "torch": torch.__version__,
        },
        "page_size": PAGE,
        "extend_tokens": EXTEND,
        "rows": rows,
    }
    path = args.out / "reference_cpu.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    if args.plot:
        plot(rows, args.out / "reference_cpu.png", args.threads)


def plot(rows: list[dict[str, Any]], path: Path, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\n{r['dtype']} {r['batch']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(range(len(rows)), [float(r["seconds_min"]) * 1e3 for r in rows])
    ax.axhline(1000, color="k", lw=0.8, ls="--", label="1 s")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("ms per forward, one layer (min of runs)")
    ax.set_title(f"reference backend on CPU ({threads} threads), {BATCH} seqs x {SEQ_LEN} KV")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Tree verify against chain verify: what a draft tree costs on each backend that serves one.

One verify step per case (Llama-3-8B attention 32/8/128, bf16, page 16): ``bs`` sequences of
``ctx`` cached tokens, each verifying 8 drafts, once as a draft tree (EAGLE topk 2: every draft
has two children until 8) and once as a plain causal chain (no mask). Per backend and case: eager forward time
per layer for the tree and the chain, their ratio (fa3 runs a tree as two launches merged by
their log-sum-exps; flex applies the mask in ``mask_mod``), the plan's host time per step, and
the tree output's max error against the reference backend, measured first.

    python -m benchmarks.bench_tree [--out DIR] [--backend fa3,flex] [--quick]

Writes DIR/tree.json and DIR/tree.png. Without CUDA it runs tiny cases on the CPU backends.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import attnsdk as A
from attnsdk._bench.common import eager_us, host_us, write_results
from attnsdk.testing import BatchSpec, make_batch

DRAFTS = [-1, 0, 0, 1, 1, 2, 2, 3]
"""Parents of the 8 drafts: a binary tree (EAGLE topk 2), breadth first."""


def cases(device: str, quick: bool) -> list[tuple[int, int]]:
    """(bs, ctx) of each case."""
    if device != "cuda":
        return [(2, 64)] if quick else [(2, 64), (4, 256)]
    return [(8, 4096), (64, 4096)] if quick else [(8, 4096), (64, 4096), (64, 16384)]


def run_case(
    name: str, backend: A.Backend, bs: int, ctx: int, device: str, quick: bool
) -> dict[str, Any]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = A.LayerSpec(num_heads=32, num_kv_heads=8, head_dim=128)
    layout = A.KVCacheLayout(8, 128, 16, dtype=dtype)
    n = len(DRAFTS)
    spec = BatchSpec((n,) * bs, (ctx + n,) * bs, "verify")
    batch = make_batch(spec, layer, layout, device=device, seed=bs)
    tree = A.tree_mask_from_parents([DRAFTS] * bs)
    table = batch.metadata.page_table
    # The chain is a plain causal verify step: what verifying costs without a mask.
    steps = {
        kind: A.AttentionMetadata.from_seqlens(
            spec.query_lens, spec.seq_lens, table, 16, device=device, tree_mask=mask
        )
        for kind, mask in (("tree", tree), ("chain", None))
    }
    reference = A.create_backend("reference")
    want = reference.forward(
        batch.q, batch.k, batch.v, batch.fresh_cache(), reference.plan(steps["tree"]), layer
    )
    cache = batch.fresh_cache()
    got = backend.forward(batch.q, batch.k, batch.v, cache, backend.plan(steps["tree"]), layer)
    row: dict[str, Any] = {
        "backend": name,
        "bs": bs,
        "ctx": ctx,
        "drafts": n,
        "max_abs_err": float((got.float() - want.float()).abs().max()),
    }
    budget = 0.02 if quick else 0.1
    for kind, meta in steps.items():
        plan = backend.plan(meta)
        row[f"{kind}_us"] = eager_us(
            lambda p=plan: backend.forward(batch.q, None, None, cache, p, layer),
            device,
            budget_s=budget,
        )
        row[f"{kind}_plan_us"] = host_us(
            lambda m=meta: backend.plan(m), device, calls=20 if quick else 200
        )
    row["tree_over_chain"] = row["tree_us"] / row["chain_us"]
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['backend']}\n{r['bs']}x{r['ctx'] // 1024 or r['ctx']}" for r in rows]
    ax.bar(labels, [r["tree_over_chain"] for r in rows], color="#4c72b0")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("tree / chain time (eager)")
    ax.set_title("Tree verify (8 drafts, topk 2) against a chain")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tree"))
    parser.add_argument("--backend", default=None, help="comma-separated (default: fa3,flex)")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    default = "fa3,flex" if device == "cuda" else "reference,flex"
    names = (args.backend or default).split(",")
    start = time.perf_counter()
    rows = []
    for name in names:
        backend = A.create_backend(name, device=device)
        for bs, ctx in cases(device, args.quick):
            rows.append(run_case(name, backend, bs, ctx, device, args.quick))
            print(json.dumps(rows[-1]), flush=True)
    header = f"{'backend':<10} {'bs x ctx':>10} {'tree us':>9} {'chain us':>9} {'tree/chain':>10}"
    print(header + f" {'plan us tree/chain':>19} {'max err':>8}")
    for r in rows:
        shape = f"{r['bs']}x{r['ctx']}"
        plans = f"{r['tree_plan_us']:.0f} / {r['chain_plan_us']:.0f}"
        print(
            f"{r['backend']:<10} {shape:>10} {r['tree_us']:9.1f} {r['chain_us']:9.1f} "
            f"{r['tree_over_chain']:10.2f} {plans:>19} {r['max_abs_err']:8.1e}"
        )
    write_results(
        args.out, "tree", rows, plot, device=device,
        seconds=time.perf_counter() - start, drafts=DRAFTS,
    )  # fmt: skip


if __name__ == "__main__":
    main()

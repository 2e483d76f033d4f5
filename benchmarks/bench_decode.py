"""Decode attention per layer, KV write included: attnsdk fa3 vs the raw FA3 call.

Llama-3-8B shapes (Hq 32, Hkv 8, D 128), bf16, page 16. Each configuration rotates over several
layers' caches (like a model's layer loop) so that small caches do not sit in L2. "raw" is what
an engine writes by hand: ``index_copy_`` of the new K and V into the flattened cache plus the
public ``flash_attn_interface.flash_attn_with_kvcache`` wrapper. Both run eager and inside one
CUDA graph per configuration. Bandwidth counts K and V bytes read once, against a device copy
measured in the same run.

    python benchmarks/bench_decode.py --out DIR
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    DTYPE,
    HKV,
    HQ,
    PAGE,
    D,
    copy_ceiling_gbs,
    gpu_us,
    graph_us,
    parse_out,
    table,
    write,
)

import attnsdk as A

BATCHES = (1, 8, 64, 256)
CONTEXTS = (1024, 4096, 32768)
ROTATE_BYTES = 256 << 20  # at least this much KV per sweep, so L2 (50 MB) cannot hold it
MAX_KV_BYTES = 40 << 30  # skip a configuration whose caches would not fit comfortably


def run_config(backend: A.Backend, bs: int, ctx: int) -> dict[str, float | int | str] | None:
    import flash_attn_interface as fai

    kv_bytes = bs * ctx * HKV * D * 2 * DTYPE.itemsize
    layers = max(1, min(32, math.ceil(ROTATE_BYTES / kv_bytes)))
    if kv_bytes * layers > MAX_KV_BYTES:
        return None
    pages = bs * ctx // PAGE
    layer = A.LayerSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    layout = A.KVCacheLayout(HKV, D, PAGE, dtype=DTYPE)
    caches = []
    for _ in range(layers):
        c = layout.allocate(pages + 1, "cuda")
        c.k.normal_()
        c.v.normal_()
        caches.append(c)
    # Each sequence owns ctx / PAGE pages in a shuffled order; this step adds its last token.
    table_ = (torch.randperm(pages, device="cuda", dtype=torch.int32) + 1).view(bs, ctx // PAGE)
    meta = A.AttentionMetadata.from_seqlens([1] * bs, [ctx] * bs, table_, PAGE, device="cuda")
    q = torch.randn(bs, HQ, D, device="cuda", dtype=DTYPE)
    k = torch.randn(bs, HKV, D, device="cuda", dtype=DTYPE)
    v = torch.randn(bs, HKV, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    slots = meta.slot_mapping

    def sdk() -> None:
        plan = backend.plan(meta)
        for c in caches:
            backend.forward(q, k, v, c, plan, layer, out=out)

    def raw() -> None:
        for c in caches:
            c.k.view(-1, HKV, D).index_copy_(0, slots, k)
            c.v.view(-1, HKV, D).index_copy_(0, slots, v)
            fai.flash_attn_with_kvcache(
                q, c.k, c.v, cache_seqlens=meta.seq_lens, page_table=meta.page_table,
                cu_seqlens_q=meta.query_start_loc, max_seqlen_q=1, causal=True,
            )  # fmt: skip

    def raw_attn_only() -> None:
        for c in caches:
            fai.flash_attn_with_kvcache(
                q, c.k, c.v, cache_seqlens=meta.seq_lens, page_table=meta.page_table,
                cu_seqlens_q=meta.query_start_loc, max_seqlen_q=1, causal=True,
            )  # fmt: skip

    iters = max(3, min(50, int(2e5 / (layers * max(10.0, kv_bytes / 4e6)))))
    row: dict[str, float | int | str] = {"bs": bs, "ctx": ctx, "layers": layers}
    for name, fn in (("sdk", sdk), ("raw", raw), ("raw_attn_only", raw_attn_only)):
        row[f"{name}_eager_us"] = gpu_us(fn, iters) / layers
        row[f"{name}_graph_us"] = graph_us(fn, iters) / layers
    row["eager_ratio"] = row["sdk_eager_us"] / row["raw_eager_us"]  # type: ignore[operator]
    row["graph_ratio"] = row["sdk_graph_us"] / row["raw_graph_us"]  # type: ignore[operator]
    row["kv_gbs"] = kv_bytes / row["sdk_graph_us"] / 1e3  # type: ignore[operator]
    caches.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    out = parse_out(__doc__ or "")
    backend = A.create_backend("fa3")
    ceiling = copy_ceiling_gbs()
    rows, skipped = [], []
    for bs in BATCHES:
        for ctx in CONTEXTS:
            row = run_config(backend, bs, ctx)
            if row is None:
                skipped.append(f"bs={bs} ctx={ctx}")
                continue
            row["kv_frac_of_copy"] = row["kv_gbs"] / ceiling  # type: ignore[operator]
            rows.append(row)
            print(table([row], list(row)), flush=True)
    cols = ["bs", "ctx", "sdk_eager_us", "raw_eager_us", "raw_attn_only_eager_us", "eager_ratio"]
    cols += ["sdk_graph_us", "raw_graph_us", "graph_ratio", "kv_gbs", "kv_frac_of_copy"]
    print(f"\ncopy ceiling {ceiling:.0f} GB/s; skipped: {skipped or 'none'}")
    print(table(rows, cols))
    write(out, "decode", {"copy_ceiling_gbs": ceiling, "skipped": skipped, "rows": rows})


if __name__ == "__main__":
    main()

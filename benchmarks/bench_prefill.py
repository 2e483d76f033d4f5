"""Prefill and extend (chunked prefill) throughput: attnsdk fa3 vs the raw FA3 call, TFLOP/s.

Llama-3-8B shapes, bf16, page 16, causal. FLOPs count only visible (causal) score entries:
4 · Hq · D · Σ_queries (keys visible). Both sides write the new K/V ("raw" with ``index_copy_``)
and attend from the paged cache in one varlen call. The bf16 matmul ceiling is measured in the
same run.

    python benchmarks/bench_prefill.py --out DIR
"""

from __future__ import annotations

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
    gpu_us,
    matmul_ceiling_tflops,
    parse_out,
    table,
    write,
)

import attnsdk as A

# (name, query lens, cached context per sequence)
CASES = (
    ("prefill 1x1k", [1024], 0),
    ("prefill 1x4k", [4096], 0),
    ("prefill 1x16k", [16384], 0),
    ("prefill 4x4k", [4096] * 4, 0),
    ("extend 4x1k on 8k", [1024] * 4, 8192),
    ("extend 8x512 on 2k", [512] * 8, 2048),
)


def flops(q_lens: list[int], ctx: int) -> float:
    visible = sum(n * ctx + n * (n + 1) // 2 for n in q_lens)
    return 4.0 * HQ * D * visible


def run_case(backend: A.Backend, q_lens: list[int], ctx: int) -> dict[str, float]:
    import flash_attn_interface as fai

    seq = [n + ctx for n in q_lens]
    width = max(-(-s // PAGE) for s in seq)
    layout = A.KVCacheLayout(HKV, D, PAGE, dtype=DTYPE)
    cache = layout.allocate(len(seq) * width + 1, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    table_ = (torch.randperm(len(seq) * width, dtype=torch.int32) + 1).view(len(seq), width)
    meta = A.AttentionMetadata.from_seqlens(q_lens, seq, table_, PAGE, device="cuda")
    t = meta.num_tokens
    q = torch.randn(t, HQ, D, device="cuda", dtype=DTYPE)
    k = torch.randn(t, HKV, D, device="cuda", dtype=DTYPE)
    v = torch.randn(t, HKV, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    layer = A.LayerSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D)

    def sdk() -> None:
        backend.forward(q, k, v, cache, backend.plan(meta), layer, out=out)

    def raw() -> None:
        cache.k.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, k)
        cache.v.view(-1, HKV, D).index_copy_(0, meta.slot_mapping, v)
        fai.flash_attn_with_kvcache(
            q, cache.k, cache.v, cache_seqlens=meta.seq_lens, page_table=meta.page_table,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=meta.max_query_len, causal=True,
        )  # fmt: skip

    f = flops(q_lens, ctx)
    iters = max(5, min(100, int(5e12 / f)))
    row = {}
    for name, fn in (("sdk", sdk), ("raw", raw)):
        us = gpu_us(fn, iters)
        row[f"{name}_us"] = us
        row[f"{name}_tflops"] = f / us / 1e6
    row["ratio"] = row["sdk_tflops"] / row["raw_tflops"]
    return row


def main() -> None:
    out = parse_out(__doc__ or "")
    backend = A.create_backend("fa3")
    ceiling = matmul_ceiling_tflops()
    rows = []
    for name, q_lens, ctx in CASES:
        row = {"case": name, **run_case(backend, q_lens, ctx)}
        row["frac_of_matmul"] = row["sdk_tflops"] / ceiling
        rows.append(row)
        print(table([row], list(row)), flush=True)
    print(f"\nbf16 matmul ceiling {ceiling:.0f} TFLOP/s")
    print(table(rows, list(rows[0])))
    write(out, "prefill", {"matmul_ceiling_tflops": ceiling, "rows": rows})


if __name__ == "__main__":
    main()

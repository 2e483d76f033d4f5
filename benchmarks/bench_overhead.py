"""Where the eager per-layer time goes at a tiny decode (bs 1, context 1k, Llama-3-8B shapes).

At this size the kernel runs in ~10 µs and everything else is host time, so each line is the
wall time per call of a loop of calls (the GPU never becomes the bottleneck). The graph line is
the kernel alone, replayed from a CUDA graph.

    python benchmarks/bench_overhead.py --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import DTYPE, HKV, HQ, PAGE, D, graph_us, host_us, parse_out, table, write

import attnsdk as A
from attnsdk._backend import check_forward_args
from attnsdk._validate import check_metadata
from attnsdk.backends._triton_store import store_kv
from attnsdk.backends.fa3 import FA3Options


def main() -> None:
    import flash_attn_interface as fai

    out_dir = parse_out(__doc__ or "")
    layer = A.LayerSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D)
    layout = A.KVCacheLayout(HKV, D, PAGE, dtype=DTYPE)
    cache = layout.allocate(1024 // PAGE + 1, "cuda")
    cache.k.normal_()
    cache.v.normal_()
    table_ = torch.arange(1, 1024 // PAGE + 1, dtype=torch.int32).view(1, -1)
    meta = A.AttentionMetadata.from_seqlens([1], [1024], table_, PAGE, device="cuda")
    q = torch.randn(1, HQ, D, device="cuda", dtype=DTYPE)
    k = torch.randn(1, HKV, D, device="cuda", dtype=DTYPE)
    v = torch.randn(1, HKV, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    bad_slot = torch.full((1,), -1, dtype=torch.int64, device="cuda")  # the store's guard flag
    pre = A.create_backend(A.AttentionConfig(backend="fa3", options=FA3Options()))
    nopre = A.create_backend(
        A.AttentionConfig(backend="fa3", options=FA3Options(precompute_scheduler=False))
    )
    plan = pre.plan(meta)
    op = torch.ops.flash_attn_3.fwd.default
    args = (
        q, cache.k, cache.v, None, None, None, out, meta.query_start_loc, None, None, None,
        meta.seq_lens, 1, None, meta.page_table, None, None, None, None, None, None, None, None,
        D**-0.5, True, -1, -1, 0, 0.0, True, None, 0, None, 0, None,
    )  # fmt: skip

    def wrapper() -> None:
        fai.flash_attn_with_kvcache(
            q, cache.k, cache.v, cache_seqlens=meta.seq_lens, page_table=meta.page_table,
            cu_seqlens_q=meta.query_start_loc, max_seqlen_q=1, causal=True,
        )  # fmt: skip

    def layers(backend: A.Backend, with_kv: bool) -> None:
        p = backend.plan(meta)
        for _ in range(32):
            if with_kv:
                backend.forward(q, k, v, cache, p, layer, out=out)
            else:
                backend.forward(q, None, None, cache, p, layer, out=out)

    n = 2000
    rows = [
        {"what": "flash_attn_with_kvcache (Python wrapper)", "us": host_us(wrapper, n)},
        {"what": "torch.ops.flash_attn_3.fwd (registered op)", "us": host_us(lambda: op(*args), n)},
        {
            "what": "check_forward_args",
            "us": host_us(
                lambda: check_forward_args(
                    q, k, v, cache, plan, layer, sinks=None, k_scale=None, v_scale=None, out=out
                ),
                n,
            ),
        },
        {
            "what": "Triton KV store (cached launch)",
            "us": host_us(
                lambda: store_kv(
                    k, v, cache.k, cache.v, meta.slot_mapping, 1, None, None,
                    quantize=False, fp8_max=0.0, bad_slot=bad_slot,
                ),
                n,
            ),
        },
        {"what": "plan()", "us": host_us(lambda: pre.plan(meta), n)},
        {"what": "check_metadata (plan's host checks)", "us": host_us(lambda: check_metadata(meta), n)},
        {"what": "sdk forward, KV write, precompute on", "us": host_us(lambda: layers(pre, True), 100) / 32},
        {"what": "sdk forward, KV write, precompute off", "us": host_us(lambda: layers(nopre, True), 100) / 32},
        {"what": "sdk forward, no KV write, precompute on", "us": host_us(lambda: layers(pre, False), 100) / 32},
        {"what": "sdk forward, no KV write, precompute off", "us": host_us(lambda: layers(nopre, False), 100) / 32},
        {"what": "kernel under graph replay (wrapper)", "us": graph_us(wrapper, 200)},
        {"what": "sdk layer under graph replay, precompute on", "us": graph_us(lambda: layers(pre, True), 50) / 32},
        {"what": "sdk layer under graph replay, precompute off", "us": graph_us(lambda: layers(nopre, True), 50) / 32},
    ]  # fmt: skip
    base = rows[0]["us"]
    for r in rows:
        r["vs_wrapper"] = r["us"] / base
    print(table(rows, ["what", "us", "vs_wrapper"]))
    write(out_dir, "overhead", {"rows": rows})


if __name__ == "__main__":
    main()

"""MLA decode: the SDK against the raw kernel it wraps, as a fraction of the copy ceiling.

DeepSeek V3's absorbed attention (kv_lora_rank 512 + rope 64, one latent per token, bf16, page
64, scale 192 ** -0.5) with 16 query heads (8-way tensor parallel) and 128 (one GPU). Per
case: ``bs`` sequences of ``ctx`` cached tokens decode one token each; the SDK's ``forward``
(cache already written) and the raw kernel call on the same tensors, both eager and both
replayed from a CUDA graph, their ratio, and the bytes of the latent cache read per µs against
the device's copy rate measured in the same run. The raw call is built here from the page
table, not through the backend:

- flashinfer: ``BatchMLAPagedAttentionWrapper`` planned once, then ``run`` alone;
- fa3: ``flash_attn_with_kvcache(q=q_rope, k_cache=rope, v_cache=latent, qv=q_nope)``, which
  needs an FA3 build with the hdim 64 x 512 kernels (the row then says why not).

    python -m benchmarks.bench_mla [--out DIR] [--backend flashinfer,fa3] [--quick] [--fp8]

``--fp8``: an e4m3 latent cache read with its scale. The SDK applies the scale on the device
(q times it before the kernel, the output after); the raw call passes it to FlashInfer as host
floats (``ckv_scale`` / ``kpe_scale``). Writes DIR/mla.json and DIR/mla.png (``mla_fp8`` with
``--fp8``). Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import attnsdk as A
from attnsdk._bench.common import eager_us, graph_us, measure_ceilings, write_results
from attnsdk.testing import BatchSpec, make_batch

RANK, ROPE, PAGE = 512, 64, 64
SCALE = 192**-0.5


def cases(quick: bool) -> list[tuple[int, int, int]]:
    """(heads, bs, ctx) of each case."""
    shapes = [(64, 4096)] if quick else [(8, 4096), (64, 4096), (128, 8192)]
    return [(h, bs, ctx) for h in (16, 128) for bs, ctx in shapes]


def raw_call(name: str, batch: Any, q: torch.Tensor, out: torch.Tensor) -> Any:
    """The kernel alone, over the batch's cache and page table, built without the backend
    (an fp8 latent's scale as the host floats FlashInfer takes)."""
    meta, cache = batch.metadata, batch.cache
    kv = cache.k.squeeze(2)  # (N, P, 576)
    if name == "flashinfer":
        import flashinfer

        lens = meta.seq_lens_cpu.to(torch.int32)
        pages = (lens + PAGE - 1) // PAGE
        kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        table = meta.page_table.cpu()
        indices = torch.cat([table[b, : int(n)] for b, n in enumerate(pages)]).to(q.device)
        qo = torch.arange(len(lens) + 1, dtype=torch.int32)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=q.device)
        w = flashinfer.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        w.plan(
            metadata=flashinfer.mla.MLAPlanMetadata.csr(qo, kv_indptr, indices, lens),
            num_heads=q.shape[1], head_dim_ckv=RANK, head_dim_kpe=ROPE, page_size=PAGE,
            causal=True, sm_scale=SCALE, q_data_type=q.dtype, kv_data_type=kv.dtype,
        )  # fmt: skip
        if batch.k_scale is None:
            return lambda: w.run(query=q, kv_cache=kv, out=out)
        scale = float(batch.k_scale)  # read once here: a raw caller's host float
        return lambda: w.run(query=q, kv_cache=kv, out=out, ckv_scale=scale, kpe_scale=scale)
    from flash_attn_interface import flash_attn_with_kvcache

    k4 = cache.k  # (N, P, 1, 576)
    return lambda: flash_attn_with_kvcache(
        q[..., RANK:], k4[..., RANK:], k4[..., :RANK], qv=q[..., :RANK],
        cache_seqlens=meta.seq_lens, page_table=meta.page_table, softmax_scale=SCALE,
        causal=True,
    )  # fmt: skip


def run_case(
    name: str, heads: int, bs: int, ctx: int, copy_gbs: float, fp8: bool = False
) -> dict[str, Any]:
    layer = A.LayerSpec.for_mla(heads, scale=SCALE)
    layout = A.KVCacheLayout.for_mla(PAGE, kv_dtype=torch.float8_e4m3fn if fp8 else None)
    kv = "fp8-e4m3" if fp8 else "bf16"
    row: dict[str, Any] = {"backend": name, "heads": heads, "bs": bs, "ctx": ctx, "kv": kv}
    backend = A.create_backend(name, device="cuda")
    reasons = backend.unsupported_reasons(layer, layout, "cuda")
    if reasons:
        row["refused"] = "; ".join(map(str, reasons))
        return row
    batch = make_batch(BatchSpec((1,) * bs, (ctx,) * bs), layer, layout, device="cuda", seed=bs)
    backend.prepare([layer], layout, "cuda")
    plan = backend.plan(batch.metadata)
    cache, q = batch.cache, batch.q
    out = torch.empty(bs, heads, RANK, dtype=q.dtype, device="cuda")
    raw_out = torch.empty_like(out)

    def sdk() -> object:
        return backend.forward(q, None, None, cache, plan, layer, out=out, k_scale=batch.k_scale)

    raw = raw_call(name, batch, q, raw_out)
    sdk()
    result = raw()
    if name == "fa3":
        raw_out = result
    reference = A.create_backend("reference")
    want = reference.forward(
        q, None, None, cache, reference.plan(batch.metadata), layer, k_scale=batch.k_scale
    )
    kv_bytes = bs * ctx * (RANK + ROPE) * cache.k.element_size()
    row.update(
        max_abs_err=float((out.float() - want.float()).abs().max()),
        sdk_vs_raw_max_diff=float((out.float() - raw_out.float()).abs().max()),
        kv_bytes=kv_bytes,
        sdk_eager_us=eager_us(sdk, "cuda"),
        raw_eager_us=eager_us(raw, "cuda"),
        sdk_graph_us=graph_us(sdk),
        raw_graph_us=graph_us(raw),
    )
    for mode in ("eager", "graph"):
        row[f"sdk_over_raw_{mode}"] = row[f"raw_{mode}_us"] / row[f"sdk_{mode}_us"]
        for who in ("sdk", "raw"):
            gbs = kv_bytes / row[f"{who}_{mode}_us"] / 1e3
            row[f"{who}_{mode}_frac_of_copy"] = gbs / copy_gbs
    return row


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "refused" not in r]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    labels = [f"{r['backend']}\n{r['heads']}h {r['bs']}x{r['ctx'] // 1024}k" for r in done]
    x = range(len(done))
    ax.bar([i - 0.2 for i in x], [r["sdk_graph_frac_of_copy"] for r in done], 0.4, label="SDK")
    ax.bar([i + 0.2 for i in x], [r["raw_graph_frac_of_copy"] for r in done], 0.4, label="raw")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("fraction of copy bandwidth (graph)")
    kv = done[0]["kv"] if done else "bf16"
    ax.set_title(f"MLA decode (512 + 64 latent, {kv}, page 64)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/mla"))
    parser.add_argument("--backend", default="flashinfer,fa3")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="an e4m3 latent cache")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_mla needs CUDA: MLA kernels are GPU kernels")
    start = time.perf_counter()
    ceilings = measure_ceilings("cuda", args.quick)
    rows = []
    for name in args.backend.split(","):
        for heads, bs, ctx in cases(args.quick):
            rows.append(run_case(name, heads, bs, ctx, ceilings.copy_gbs, args.fp8))
            print(json.dumps(rows[-1]), flush=True)
    print(f"copy ceiling {ceilings.copy_gbs:.0f} GB/s")
    print(
        f"{'backend':<10} {'heads':>5} {'bs x ctx':>9} {'sdk/raw us (graph)':>19} "
        f"{'raw/sdk':>7} {'sdk %copy':>9} {'raw %copy':>9} {'eager raw/sdk':>13} {'err':>7}"
    )
    for r in rows:
        shape = f"{r['bs']}x{r['ctx'] // 1024}k"
        if "refused" in r:
            print(f"{r['backend']:<10} {r['heads']:>5} {shape:>9}  refused: {r['refused']}")
            continue
        times = f"{r['sdk_graph_us']:.1f} / {r['raw_graph_us']:.1f}"
        print(
            f"{r['backend']:<10} {r['heads']:>5} {shape:>9} {times:>19} "
            f"{r['sdk_over_raw_graph']:7.3f} {100 * r['sdk_graph_frac_of_copy']:8.1f}% "
            f"{100 * r['raw_graph_frac_of_copy']:8.1f}% {r['sdk_over_raw_eager']:13.3f} "
            f"{r['max_abs_err']:7.1e}"
        )
    write_results(
        args.out, "mla_fp8" if args.fp8 else "mla", rows, plot,
        copy_gbs=ceilings.copy_gbs, seconds=time.perf_counter() - start, fp8=args.fp8,
    )  # fmt: skip


if __name__ == "__main__":
    main()

"""Ragged attention (MLA's expanded prefill): the SDK against the raw kernel, as a fraction of
the matmul rate.

DeepSeek V3's prefill attention after up-projection: q / k 192 dims (128 nope + 64 rope), v 128,
bf16, scale 192 ** -0.5, 16 heads (8-way tensor parallel) and 128 (one GPU). Two kinds of call,
as SGLang and vLLM make them:

- ``new``: each sequence's new tokens attend causally over themselves;
- ``prefix``: the same queries over a prefix chunk of as many keys, unmasked, with ``lse=``
  (the part merged with ``new`` by ``merge_states``).

Per case the SDK's ``forward_ragged`` and the raw kernel on the same tensors, eager (prefill is
not graph-captured), their ratio, and useful FLOP/s (2 · Σ visible q·k pairs · H · (192 + 128))
against the bf16 matmul rate measured in the same run. The raw call is FA3's
``flash_attn_varlen_func`` or FlashInfer's ``BatchPrefillWithRaggedKVCacheWrapper`` (planned
once, ``run`` alone); an FA3 build without the 192 x 128 kernels (FLASH_ATTENTION_DISABLE_
HDIMDIFF192) gets V already zero-padded to 192, which the SDK pads inside its call: the
``raw/sdk`` ratio then charges the pad and the output slice to the SDK, and ``w/ pad`` compares
with a raw caller doing the same (pad, call, slice into ``out``). ``host us`` is each call's
host time (30 calls queued, then drained): where it nears the kernel time the call is
host-bound and its ratio follows the host, not the kernel.

    python -m benchmarks.bench_ragged [--out DIR] [--backend fa3,flashinfer] [--quick]
    python -m benchmarks.bench_ragged --replot DIR/ragged.json   # the PNG again, no GPU

Writes DIR/ragged.json and DIR/ragged.png. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

import attnsdk as A
from attnsdk._bench.common import eager_us, host_us, measure_ceilings, write_results

D, DV = 192, 128
SCALE = 192**-0.5


def cases(quick: bool) -> list[tuple[int, int, int, str]]:
    """(heads, sequences, tokens per sequence, kind) of each case."""
    shapes = [(1, 8192)] if quick else [(1, 8192), (4, 2048), (16, 512)]
    return [(h, b, n, k) for k in ("new", "prefix") for h in (16, 128) for b, n in shapes]


def raw_calls(
    name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    meta: A.AttentionMetadata, n: int, causal: bool,
) -> tuple[Any, Any]:  # fmt: skip
    """(the kernel alone, or None when it equals the first: the kernel as a caller of this
    build must run it, padding and slicing included), both built without the backend."""
    if name == "flashinfer":
        import flashinfer

        ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
        w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", backend="fa2")
        indptr = meta.query_start_loc_cpu
        w.plan(
            indptr, indptr, q.shape[1], k.shape[1], D, head_dim_vo=DV, causal=causal,
            sm_scale=SCALE, q_data_type=q.dtype, kv_data_type=k.dtype,
        )  # fmt: skip
        return lambda: w.run(q, k, v, out=out, return_lse=not causal), None
    from flash_attn_interface import flash_attn_varlen_func

    cu = meta.query_start_loc

    def call(wide: torch.Tensor) -> Any:
        result = flash_attn_varlen_func(
            q, k, wide, cu, cu, n, n, softmax_scale=SCALE, causal=causal,
            return_attn_probs=not causal,
        )  # fmt: skip
        return result[0] if isinstance(result, tuple) else result

    if not _build_flags().get("FLASH_ATTENTION_DISABLE_HDIMDIFF192", False):
        return lambda: out.copy_(call(v)), None
    v_wide = torch.nn.functional.pad(v, (0, D - DV))

    def with_pad() -> object:
        """Pad V, call, slice into ``out``: what the SDK does inside its call."""
        wide = torch.cat((v, v.new_zeros(*v.shape[:-1], D - DV)), dim=-1)
        return out.copy_(call(wide)[..., :DV])

    return lambda: call(v_wide), with_pad


def run_case(name: str, heads: int, b: int, n: int, kind: str, tflops: float) -> dict[str, Any]:
    causal = kind == "new"
    layer = A.LayerSpec(
        num_heads=heads, num_kv_heads=heads, head_dim=D, v_head_dim=DV, causal=causal, scale=SCALE
    )
    row: dict[str, Any] = {"backend": name, "heads": heads, "seqs": b, "tokens": n, "kind": kind}
    backend = A.create_backend(name, device="cuda")
    reasons = backend.unsupported_reasons(layer, None, "cuda", uses=(A.Feature.RAGGED,))
    if reasons:
        row["refused"] = "; ".join(map(str, reasons))
        return row
    meta = A.AttentionMetadata.for_ragged(
        [n] * b, [n] * b, device="cuda", cross_attention=not causal
    )
    gen = torch.Generator(device="cuda").manual_seed(b * n + heads)
    q, k = (
        torch.randn(b * n, heads, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    v = torch.randn(b * n, heads, DV, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(b * n, heads, DV, device="cuda", dtype=torch.bfloat16)
    raw_out = torch.empty_like(out)
    lse = None if causal else torch.empty(b * n, heads, device="cuda")
    plan = backend.plan(meta)

    def sdk() -> object:
        return backend.forward_ragged(q, k, v, plan, layer, out=out, lse=lse)  # type: ignore[attr-defined]

    raw, raw_with_pad = raw_calls(name, q, k, v, raw_out, meta, n, causal)
    sdk()
    (raw_with_pad or raw)()
    reference = A.create_backend("reference", device="cuda")
    sample = slice(0, min(n, 256))  # the reference on the first sequence's first rows
    ref_meta = A.AttentionMetadata.for_ragged(
        [sample.stop], [sample.stop if causal else n], device="cuda", cross_attention=not causal
    )
    want = reference.forward_ragged(  # type: ignore[attr-defined]
        q[sample], k[:n], v[:n], reference.plan(ref_meta), layer
    )
    row.update(
        max_abs_err=float((out[sample].float() - want.float()).abs().max()),
        sdk_vs_raw_max_diff=float((out.float() - raw_out.float()).abs().max()),
        sdk_us=eager_us(sdk, "cuda"),
        raw_us=eager_us(raw, "cuda"),
    )
    row["sdk_over_raw"] = row["raw_us"] / row["sdk_us"]
    if raw_with_pad is not None:
        row["raw_with_pad_us"] = eager_us(raw_with_pad, "cuda")
        row["sdk_over_raw_with_pad"] = row["raw_with_pad_us"] / row["sdk_us"]
    # Host time per call (30 calls queued, then drained): near the kernel time, a call is
    # host-bound and its ratio follows the host's speed, not the kernel's.
    row["sdk_host_us"] = host_us(sdk, "cuda", calls=30)
    row["raw_host_us"] = host_us(raw_with_pad or raw, "cuda", calls=30)
    pairs = b * (n * (n + 1) // 2 if causal else n * n)
    row["flops"] = flops = 2 * pairs * heads * (D + DV)
    for who in ("sdk", "raw"):
        row[f"{who}_tflops"] = flops / row[f"{who}_us"] / 1e6
        row[f"{who}_frac_of_matmul"] = row[f"{who}_tflops"] / tflops
    return row


def _build_flags() -> dict[str, bool]:
    """The installed FA3 build's compile-time switches ({} when it does not say)."""
    try:
        import flash_attn_config
    except ImportError:
        return {}
    return dict(flash_attn_config.CONFIG.get("build_flags", {}))


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in rows if "refused" not in r]
    backends = sorted({r["backend"] for r in done})
    fig, axes = plt.subplots(
        len(backends), 1, figsize=(9, 3 * len(backends)), squeeze=False, sharey=True
    )
    for ax, name in zip(axes[:, 0], backends, strict=True):
        mine = [r for r in done if r["backend"] == name]
        x = range(len(mine))
        ax.bar([i - 0.2 for i in x], [r["sdk_frac_of_matmul"] for r in mine], 0.4, label="SDK")
        ax.bar([i + 0.2 for i in x], [r["raw_frac_of_matmul"] for r in mine], 0.4, label="raw")
        labels = [f"{r['kind']}\n{r['heads']}h\n{r['seqs']}x{r['tokens']}" for r in mine]
        ax.set_xticks(list(x), labels, fontsize=7)
        ax.set_ylabel("fraction of bf16 matmul")
        ax.set_title(f"{name}: ragged prefill, DeepSeek dims (q/k 192, v 128, bf16)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def replot(json_path: Path) -> None:
    """Redraw the PNG beside a ragged.json (no GPU needed)."""
    rows = json.loads(json_path.read_text())["rows"]
    plot(rows, json_path.with_suffix(".png"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/ragged"))
    parser.add_argument("--backend", default="fa3,flashinfer")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="redraw a ragged.json's PNG")
    args = parser.parse_args(argv)
    if args.replot is not None:
        replot(args.replot)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_ragged needs CUDA")
    start = time.perf_counter()
    ceilings = measure_ceilings("cuda", args.quick)
    rows = []
    for name in args.backend.split(","):
        for heads, b, n, kind in cases(args.quick):
            rows.append(run_case(name, heads, b, n, kind, ceilings.matmul_tflops))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)  # progress
    print(f"bf16 matmul {ceilings.matmul_tflops:.0f} TFLOP/s")
    print(
        f"{'backend':<8} {'kind':<6} {'heads':>5} {'seqs x n':>9} {'sdk/raw us':>17} "
        f"{'raw/sdk':>7} {'w/ pad':>6} {'sdk TF/s':>8} {'% mm':>5} {'raw % mm':>8} "
        f"{'host us sdk/raw':>15} {'err':>7}"
    )
    for r in rows:
        shape = f"{r['seqs']}x{r['tokens']}"
        if "refused" in r:
            print(
                f"{r['backend']:<8} {r['kind']:<6} {r['heads']:>5} {shape:>9}  refused: {r['refused']}"
            )
            continue
        times = f"{r['sdk_us']:.0f} / {r['raw_us']:.0f}"
        padded = r.get("sdk_over_raw_with_pad")  # only where the SDK pads V (fa3)
        padded_col = "-" if padded is None else f"{padded:.3f}"
        host = f"{r['sdk_host_us']:.0f} / {r['raw_host_us']:.0f}"
        print(
            f"{r['backend']:<8} {r['kind']:<6} {r['heads']:>5} {shape:>9} {times:>17} "
            f"{r['sdk_over_raw']:7.3f} {padded_col:>6} "
            f"{r['sdk_tflops']:8.0f} {100 * r['sdk_frac_of_matmul']:4.0f}% "
            f"{100 * r['raw_frac_of_matmul']:7.0f}% {host:>15} {r['max_abs_err']:7.1e}"
        )
    write_results(
        args.out, "ragged", rows, plot,
        matmul_tflops=ceilings.matmul_tflops, seconds=time.perf_counter() - start,
    )  # fmt: skip


if __name__ == "__main__":
    main()

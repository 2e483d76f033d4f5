"""Per-step host time: each backend's ``plan()`` vs an SGLang-style FA3 metadata build, same run.

The SGLang-style build is what SGLang's FlashAttention backend does per decode step: int32
sequence lengths, ``cu_seqlens_k`` by cumsum + pad, the host max, a ``req_to_token`` gather,
the page stride (every P-th slot // P) and ``cu_seqlens_q``. Each backend is measured twice:
``plan()`` alone (what the SDK adds once the engine has metadata), and
``AttentionMetadata.from_tensors`` + ``plan()`` (adopting the engine's tensors, then planning).
Backends are prepared for the Llama-3-8B layer first (FlashInfer plans one wrapper per prepared
layer shape). Writes DIR/plan.json: one row per (backend, batch size).

    python -m benchmarks.bench_plan [--out DIR] [--backend fa3,flashinfer]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import attnsdk as A
from attnsdk._bench.common import DTYPE, LAYER, PAGE, Column, format_table, host_us
from attnsdk._cli.bench import parse_names, select_backends

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_CTX = 4096
COLUMNS = [
    Column("backend", "backend"),
    Column("bs", "bs"),
    Column("plan_us", "plan() us", "us"),
    Column("adopt_plus_plan_us", "from_tensors + plan() us", "us"),
    Column("sglang_build_us", "SGLang-style build us", "us"),
    Column("plan_over_sglang", "plan / SGLang", "ratio"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--backend", action="append", metavar="NAME[,NAME]")
    args = parser.parse_args()
    names = parse_names(args.backend, A.backend_names(), "--backend")
    run, skipped = select_backends(names, "cuda")
    layout = A.KVCacheLayout(LAYER.num_kv_heads, LAYER.head_dim, PAGE, dtype=DTYPE)
    backends = {n: A.create_backend(n, device="cuda", layers=[LAYER], layout=layout) for n in run}
    req_to_token = torch.arange(512 * MAX_CTX, device="cuda", dtype=torch.int32).view(512, MAX_CTX)
    rows = [row for bs in BATCHES for row in measure(backends, req_to_token, bs)]
    print(format_table(rows, COLUMNS))
    args.out.mkdir(parents=True, exist_ok=True)
    data = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backends_skipped": skipped,
        "rows": rows,
    }
    (args.out / "plan.json").write_text(json.dumps(data, indent=2) + "\n")


def measure(
    backends: dict[str, A.Backend], req_to_token: torch.Tensor, bs: int
) -> list[dict[str, Any]]:
    rows_pool = req_to_token.shape[0]
    seq_cpu = torch.randint(1, MAX_CTX, (bs,), dtype=torch.int64)
    seq = seq_cpu.to("cuda")
    rpi = torch.randperm(rows_pool, device="cuda")[:bs]
    out_cache_loc = torch.randint(0, 1 << 20, (bs,), device="cuda")

    def sglang() -> None:
        cache_seqlens = seq.to(torch.int32)
        F.pad(torch.cumsum(seq, dim=0, dtype=torch.int32), (1, 0))
        max_len = int(seq_cpu.max().item())
        table_ = req_to_token[rpi, :max_len]
        table_ = table_[:, ::PAGE] // PAGE
        torch.arange(0, bs + 1, dtype=torch.int32, device="cuda")
        del cache_seqlens, table_

    # The engine-side tensors an adapter hands to from_tensors.
    qsl = torch.arange(bs + 1, dtype=torch.int32, device="cuda")
    qsl_cpu = torch.arange(bs + 1, dtype=torch.int32)
    seq32, seq32_cpu = seq.to(torch.int32), seq_cpu.to(torch.int32)
    table_ = (req_to_token[rpi, : int(seq_cpu.max())][:, ::PAGE] // PAGE).contiguous()

    def adopt() -> A.AttentionMetadata:
        return A.AttentionMetadata.from_tensors(
            query_start_loc=qsl, seq_lens=seq32, page_table=table_,
            slot_mapping=out_cache_loc, query_start_loc_cpu=qsl_cpu, seq_lens_cpu=seq32_cpu,
            max_query_len=1, max_seq_len=MAX_CTX,
        )  # fmt: skip

    meta = adopt()
    sglang_us = host_us(sglang, "cuda", calls=500, repeats=5)
    rows = []
    for name, backend in backends.items():
        row: dict[str, Any] = {
            "backend": name,
            "bs": bs,
            "plan_us": host_us(lambda b=backend: b.plan(meta), "cuda", calls=500, repeats=5),
            "adopt_plus_plan_us": host_us(
                lambda b=backend: b.plan(adopt()), "cuda", calls=500, repeats=5
            ),
            "sglang_build_us": sglang_us,
        }
        row["plan_over_sglang"] = row["plan_us"] / sglang_us
        row["adopt_plan_over_sglang"] = row["adopt_plus_plan_us"] / sglang_us
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()

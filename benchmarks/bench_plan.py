"""Per-step host time: attnsdk ``plan()`` vs an SGLang-style FA3 metadata build, same run.

The SGLang-style build is what SGLang's FlashAttention backend does per decode step: int32
sequence lengths, ``cu_seqlens_k`` by cumsum + pad, the host max, a ``req_to_token`` gather,
the page stride (every P-th slot // P) and ``cu_seqlens_q``. attnsdk's side is measured twice:
``plan()`` alone (what the SDK adds once the engine has metadata), and
``AttentionMetadata.from_tensors`` + ``plan()`` (adopting the engine's tensors, then planning).

    python benchmarks/bench_plan.py --out DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PAGE, host_us, parse_out, table, write

import attnsdk as A

BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MAX_CTX = 4096


def main() -> None:
    out = parse_out(__doc__ or "")
    backend = A.create_backend("fa3")
    req_to_token = torch.arange(512 * MAX_CTX, device="cuda", dtype=torch.int32).view(512, MAX_CTX)
    rows = [measure(backend, req_to_token, bs) for bs in BATCHES]
    print(table(rows, list(rows[0])))
    write(out, "plan", {"rows": rows})


def measure(backend: A.Backend, req_to_token: torch.Tensor, bs: int) -> dict[str, float]:
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
    row = {
        "bs": bs,
        "plan_us": host_us(lambda: backend.plan(meta), 2000),
        "adopt_plus_plan_us": host_us(lambda: backend.plan(adopt()), 2000),
        "sglang_build_us": host_us(sglang, 500),
    }
    row["plan_over_sglang"] = row["plan_us"] / row["sglang_build_us"]
    row["adopt_plan_over_sglang"] = row["adopt_plus_plan_us"] / row["sglang_build_us"]
    return row


if __name__ == "__main__":
    main()

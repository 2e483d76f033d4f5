"""Prefill and extend (chunked prefill) throughput: every backend that can run here next to its
raw kernel (raw FA3 ``flash_attn_with_kvcache``; raw FlashInfer paged prefill wrapper, fa2).

Llama-3-8B shapes, bf16, page 16, causal; 1k / 4k / 8k / 16k-token prompts, 4 x 4k, and two
extends. FLOPs count only visible (causal) score entries; the bf16 matmul rate is measured in
the same run. Writes DIR/prefill.json (docs/benchmarks.md lists its fields).

    python -m benchmarks.bench_prefill [--out DIR] [--backend fa3,flashinfer] [--quick] [--json]
"""

from __future__ import annotations

from benchmarks._suite import run

if __name__ == "__main__":
    run("prefill")

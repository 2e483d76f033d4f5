"""Mixed steps (decode rows and one prefill chunk in one batch): every backend that can run here
next to its raw kernel (raw FA3 varlen call; raw FlashInfer paged prefill wrapper, fa2).

Llama-3-8B shapes, bf16, page 16: 63 decodes over 4k + one 2k chunk after 2k cached tokens, and
7 decodes over 4k + one 8k prompt. The floor is the larger of the KV-read and the FLOP floor.
Writes DIR/mixed.json (docs/benchmarks.md lists its fields).

    python -m benchmarks.bench_mixed [--out DIR] [--backend fa3,flashinfer] [--quick] [--json]
"""

from __future__ import annotations

from benchmarks._suite import run

if __name__ == "__main__":
    run("mixed")

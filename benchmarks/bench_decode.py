"""Decode attention per layer, KV write included: every backend that can run here next to its
raw kernel (raw FA3 ``flash_attn_with_kvcache``; raw FlashInfer tensor-core decode wrapper).

Llama-3-8B shapes (Hq 32, Hkv 8, D 128), bf16, page 16; batch {1, 8, 64, 256} x KV
{1k, 4k, 16k, 32k}. Each case rotates over several layers' caches so that small caches do not
sit in L2; eager and CUDA-graph replay; KV bandwidth against a device copy measured in the same
run. Writes DIR/decode.json (docs/benchmarks.md lists its fields).

    python -m benchmarks.bench_decode [--out DIR] [--backend fa3,flashinfer] [--quick] [--json]
"""

from __future__ import annotations

from benchmarks._suite import run

if __name__ == "__main__":
    run("decode")

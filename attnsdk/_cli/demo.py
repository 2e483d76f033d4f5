"""``attnsdk demo``: a mixed batch on the configured backend, checked against the reference."""

from __future__ import annotations

import logging
import time

import torch

from attnsdk.contract.device import cuda_available
from attnsdk.contract.kv import KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.selection.config import AttentionConfig
from attnsdk.selection.create import create_backend

__all__ = ["demo"]


def demo(backend_name: str | None, seed: int) -> int:
    from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = "cuda" if cuda_available() else "cpu"
    backend = create_backend(backend_name or AttentionConfig.from_env(), device=device)
    reference = create_backend("reference")
    layer = LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64)
    layout = KVCacheLayout(num_kv_heads=2, head_dim=64, page_size=16, dtype=torch.bfloat16)
    spec = BatchSpec.mixed(batch_size=8, max_len=300, seed=seed)
    batch = make_batch(spec, layer, layout, seed=seed, device=device)
    start = time.perf_counter()
    out, cache = batch.run(backend)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    ref, ref_cache = batch.run(reference)
    print(f"backend   {backend.name} on {device}")
    print(
        f"batch     {spec.num_seqs} sequences, {spec.num_tokens} new tokens "
        f"(query_lens {list(spec.query_lens)}, seq_lens {list(spec.seq_lens)})"
    )
    print(
        f"layer     Hq={layer.num_heads} Hkv={layer.num_kv_heads} D={layer.head_dim}, "
        f"page_size {layout.page_size}, {layout.dtype}"
    )
    print(f"forward   {elapsed * 1e3:.1f} ms (first call, KV write included)")
    assert_close_to_reference(out, ref)
    same_cache = torch.equal(cache.k, ref_cache.k) and torch.equal(cache.v, ref_cache.v)
    err = (out.float() - ref.float()).abs().max().item()
    print(
        f"check     max |out - reference| = {err:.2e}; KV cache {'identical' if same_cache else 'DIFFERS'}"
    )
    print("demo OK" if same_cache else "demo FAILED")
    return 0 if same_cache else 1

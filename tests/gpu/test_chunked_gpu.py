"""Chunked local attention at Llama 4's scale (chunks of 8192) on the GPU backends.

The conformance suite covers chunks of 16-64 on every backend; this file runs Llama 4 Scout's
attention shape (one tensor-parallel rank of 8: 5 query heads, 1 KV head, head dim 128, bf16)
over contexts of several chunks against the reference backend, eagerly and in decode CUDA
graphs, and checks on the device that building the virtual batch never syncs.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnsdk as A
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.features.chunked import virtual_metadata
from attnsdk.testing import BatchSpec, assert_close_to_reference, forbid_device_sync, make_batch

pytestmark = pytest.mark.gpu

C = 8192
LAYER = A.LayerSpec(num_heads=5, num_kv_heads=1, head_dim=128, attention_chunk_size=C)
BACKENDS = [
    pytest.param("fa3", marks=[pytest.mark.sm90, pytest.mark.fa3]),
    pytest.param("flashinfer", marks=pytest.mark.flashinfer),
]
# Decode rows on the first and last position of a chunk and deep in one, an extend across the
# boundary at 2C, a prefill across C, a row without queries.
SPEC = BatchSpec(
    query_lens=(1, 1, 1, 300, C + 808, 0),
    seq_lens=(C + 1, 2 * C, 20000, 2 * C + 150, C + 808, 100),
    name="llama4",
)


def layout(page_size: int) -> A.KVCacheLayout:
    return A.KVCacheLayout(1, 128, page_size, dtype=torch.bfloat16)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", BACKENDS)
def test_llama4_scale_matches_reference(name: str, page_size: int) -> None:
    backend = A.create_backend(name, layers=[LAYER], layout=layout(page_size))
    batch = make_batch(SPEC, LAYER, layout(page_size), device="cuda", seed=page_size)
    out, cache = batch.run(backend)
    want, ref_cache = batch.run(ReferenceBackend())
    assert_close_to_reference(out, want)
    assert torch.equal(cache.k, ref_cache.k)
    # The decode row at the first position of chunk 1 sees only itself: its own value.
    torch.testing.assert_close(out[0].float(), batch.v[0].float().expand(5, 128))


@pytest.mark.parametrize("name", BACKENDS)
def test_llama4_scale_decode_graphs(name: str) -> None:
    """Decode graphs with a chunked layer: replays (padding rows included) equal eager runs."""
    lay = layout(16)
    backend = A.create_backend(name, layers=[LAYER], layout=lay)
    max_pages = math.ceil(24000 / 16)
    gen = torch.Generator().manual_seed(0)
    graph_cache = lay.allocate(8 * max_pages + 1, "cuda")
    for x in (graph_cache.k, graph_cache.v):
        x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
    eager_cache = A.KVCache(lay, graph_cache.k.clone(), graph_cache.v.clone())

    def step(plan: A.Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return backend.forward(q, k, v, graph_cache, plan, LAYER)

    runner = A.GraphRunner(backend, step, batch_sizes=[1, 4, 8], max_pages=max_pages, page_size=16)

    def rand(t: int, h: int) -> torch.Tensor:
        return torch.randn(t, h, 128, generator=gen).to("cuda", torch.bfloat16)

    runner.capture(rand(8, 5), rand(8, 1), rand(8, 1))
    for seq in ([C + 1], [2 * C, C, 1], [C + 1, 2 * C + 1, 17, 24000, 2 * C]):
        b = len(seq)
        pages = torch.randperm(8 * max_pages, generator=gen)[: b * max_pages] + 1
        table = pages.view(b, max_pages).to(torch.int32)
        meta = A.AttentionMetadata.from_seqlens([1] * b, seq, table, 16, device="cuda")
        q, k, v = rand(b, 5), rand(b, 1), rand(b, 1)
        got = runner(meta, q, k, v).clone()
        want = backend.forward(q, k, v, eager_cache, backend.plan(meta), LAYER)[:b]
        assert_close_to_reference(got, want)
        assert torch.equal(graph_cache.k, eager_cache.k)


@pytest.mark.parametrize("spec", [SPEC, BatchSpec.decode(batch_size=64, max_context=20000)])
def test_the_virtual_batch_never_syncs(spec: BatchSpec) -> None:
    batch = make_batch(spec, LAYER, layout(16), device="cuda")
    with forbid_device_sync():
        virtual = virtual_metadata(batch.metadata, C, 16)
    virtual.validate(batch.cache)

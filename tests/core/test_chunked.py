"""The virtual batch of chunked local attention (``attnsdk.features.chunked``), proved on the CPU.

fa3 and flashinfer run their kernels over ``virtual_metadata(meta, C, P)`` with the chunk rule
left out. That is right exactly when the reference backend, run the same way, equals the
reference backend with the chunk rule over the original metadata (and the reference equals the
float64 oracle: tests/backends/test_reference.py). These tests check that equality on many
random batches, plus the virtual batch's own structure.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnsdk as A
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.features.chunked import check_capture, chunk_reasons, prepared_chunks, virtual_metadata
from attnsdk.testing import Batch, BatchSpec, make_batch
from attnsdk.testing.strategies import batch_specs, page_orders

reference = ReferenceBackend()


def lengths(meta: A.AttentionMetadata) -> tuple[list[int], list[int]]:
    return meta.query_lens_cpu.tolist(), meta.seq_lens_cpu.tolist()


def used_pages(meta: A.AttentionMetadata, page_size: int) -> list[list[int]]:
    pt = meta.page_table.tolist()
    return [row[: -(-s // page_size)] for row, s in zip(pt, meta.seq_lens_cpu.tolist())]


def test_the_docstring_example() -> None:
    """C = 4, pages of 2: a sequence extending positions 3..9 becomes three sequences."""
    meta = A.AttentionMetadata.from_seqlens([7], [10], [[11, 12, 13, 14, 15]], page_size=2)
    virtual = virtual_metadata(meta, 4, 2)
    assert lengths(virtual) == ([1, 4, 2], [4, 4, 2])
    assert used_pages(virtual, 2) == [[11, 12], [13, 14], [15]]
    assert virtual.slot_mapping is meta.slot_mapping
    assert (virtual.num_tokens, virtual.max_query_len, virtual.max_seq_len) == (7, 4, 4)


def test_vllms_documented_example() -> None:
    """The example in vLLM's ``make_local_attention_virtual_batches`` comment: the same split."""
    table = torch.arange(30, dtype=torch.int32).view(3, 10)
    meta = A.AttentionMetadata.from_seqlens([4, 10, 5], [6, 17, 9], table, page_size=2)
    virtual = virtual_metadata(meta, 4, 2)
    assert lengths(virtual) == ([2, 2, 1, 4, 4, 1, 4, 1], [4, 2, 4, 4, 4, 1, 4, 1])
    assert virtual.query_start_loc.tolist() == [0, 2, 4, 5, 9, 13, 14, 18, 19]
    pages = [[0, 1], [2], [12, 13], [14, 15], [16, 17], [18], [22, 23], [24]]
    assert used_pages(virtual, 2) == pages


def test_rows_without_queries_keep_their_last_chunk() -> None:
    meta = A.AttentionMetadata.from_seqlens([0, 3, 0], [0, 5, 9], [[1, 2, 3]] * 3, page_size=4)
    virtual = virtual_metadata(meta, 4, 4)
    assert lengths(virtual) == ([0, 2, 1, 0], [0, 4, 1, 1])
    assert used_pages(virtual, 4) == [[], [1], [2], [3]]


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_decode_batch_is_one_virtual_sequence_per_sequence(page_size: int) -> None:
    """Decode batches take the device-only path; it agrees with the general one."""
    c = 8
    spec = BatchSpec((1, 0, 1, 1, 0, 1), (1, 0, 8, 9, 20, 33), "decode")
    layer = A.LayerSpec(2, 1, 16, attention_chunk_size=c)
    batch = make_batch(spec, layer, A.KVCacheLayout(1, 16, page_size), seed=1)
    meta = batch.metadata
    decode = virtual_metadata(meta, c, page_size)
    assert decode.query_start_loc is meta.query_start_loc  # rows unchanged
    assert lengths(decode) == ([1, 0, 1, 1, 0, 1], [1, 0, 8, 1, 4, 1])
    assert decode.seq_lens.tolist() == decode.seq_lens_cpu.tolist()
    assert decode.page_table.shape[1] == min(c // page_size, meta.page_table.shape[1])
    # The general path, forced by an upper bound on the query length, builds the same batch.
    general = virtual_metadata(dataclasses.replace(meta, max_query_len=2), c, page_size)
    assert lengths(general) == lengths(decode)
    assert used_pages(general, page_size) == used_pages(decode, page_size)


def test_no_device_value_is_read() -> None:
    """Built from "meta" tensors, which hold no values: any read on the host would raise."""
    for q, s in (([1, 1, 0], [40, 3, 7]), ([5, 1, 30], [40, 3, 70])):
        meta = A.AttentionMetadata.from_seqlens(q, s, [[1] * 5] * 3, page_size=16, device="meta")
        virtual = virtual_metadata(meta, 32, 16)
        assert virtual.page_table.device.type == "meta"
        assert virtual.seq_lens_cpu.device.type == "cpu"


def test_refusals() -> None:
    meta = A.AttentionMetadata.from_seqlens([3], [3], [[1]], page_size=16)
    with pytest.raises(A.InvalidInputError, match="chunk_size"):
        virtual_metadata(meta, 24, 16)
    layer = A.LayerSpec(4, 2, 64, attention_chunk_size=24)
    (reason,) = chunk_reasons(layer, A.KVCacheLayout(2, 64, 16))
    assert reason.field == "attention_chunk_size"
    assert "page_size=16" in reason.message
    assert "found 24" in reason.message
    assert chunk_reasons(layer, A.KVCacheLayout(2, 64, 8)) == []
    assert chunk_reasons(dataclasses.replace(layer, attention_chunk_size=None), None) == []
    check_capture(dataclasses.replace(meta, max_query_len=1))
    with pytest.raises(A.UnsupportedConfigError, match="attention_chunk_size"):
        check_capture(meta)


def test_prepared_chunks() -> None:
    plain = A.LayerSpec(4, 2, 64)
    chunked = dataclasses.replace(plain, attention_chunk_size=64)
    p16, p64 = A.KVCacheLayout(2, 64, 16), A.KVCacheLayout(2, 64, 64)
    pairs = [(plain, p16), (chunked, p16), (chunked, p64), (chunked, p16)]
    meta = A.AttentionMetadata.from_seqlens([1], [40], [[1, 2, 3]], page_size=16)
    assert prepared_chunks(pairs, meta) == [(64, 16)]
    unrecorded = dataclasses.replace(meta, page_size=None)
    assert prepared_chunks(pairs, unrecorded) == [(64, 16), (64, 64)]
    too_narrow = dataclasses.replace(unrecorded, max_seq_len=100)
    assert prepared_chunks(pairs, too_narrow) == [(64, 64)]


# -- the proof: reference over the virtual batch == reference with the chunk rule -----------


def run_virtual(batch: Batch, page_size: int) -> tuple[torch.Tensor, A.KVCache]:
    """The reference over the virtual batch, the chunk rule left out (what fa3 and flashinfer
    do with their kernels)."""
    layer = batch.layer
    assert layer.attention_chunk_size is not None
    virtual = virtual_metadata(batch.metadata, layer.attention_chunk_size, page_size)
    virtual.validate(batch.cache)
    plain = dataclasses.replace(layer, attention_chunk_size=None)
    return dataclasses.replace(batch, metadata=virtual, layer=plain).run(reference)


def check(batch: Batch) -> None:
    out, cache = run_virtual(batch, batch.cache.layout.page_size)
    want, want_cache = batch.run(reference)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.k, want_cache.k)
    assert torch.equal(cache.v, want_cache.v)


def chunked_layout(page_size: int, **layer: object) -> tuple[A.LayerSpec, A.KVCacheLayout]:
    return (
        A.LayerSpec(4, 2, 16, **layer),  # type: ignore[arg-type]
        A.KVCacheLayout(2, 16, page_size, dtype=torch.float32),
    )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("page_size", "chunk"), [(1, 1), (1, 5), (2, 4), (4, 12), (16, 16)])
def test_chunk_edges(page_size: int, chunk: int, causal: bool) -> None:
    """Decode rows on the first and last position of a chunk, extends and prefills across
    one or several boundaries, rows without queries, graph padding rows."""
    c = chunk
    spec = BatchSpec(
        (1, 1, 1, c + 2, 2, 3 * c + 1, 0, 0, c),
        (c + 1, 2 * c, 3 * c + 1, 2 * c + 1, c + 1, 3 * c + 1, c, 0, 2 * c),
        "chunk-edges",
    ).with_padding(2, 1)
    layer, layout = chunked_layout(page_size, attention_chunk_size=c, causal=causal)
    for seed, pages in enumerate(("shuffled", "interleaved", "contiguous")):
        check(make_batch(spec, layer, layout, pages=pages, seed=seed))


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=batch_specs(max_batch=6, max_context=90, max_query_len=40),
    padding=st.sampled_from([(0, 1), (0, 1), (1, 1), (2, 1), (2, 3)]),
    page_size=st.sampled_from([1, 2, 4, 8, 16]),
    pages_per_chunk=st.integers(1, 6),
    causal=st.booleans(),
    window=st.none() | st.integers(1, 20),
    extras=st.sampled_from([{}, {"has_sinks": True}, {"softcap": 3.0}]),
    pages=page_orders,
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    spec: BatchSpec,
    padding: tuple[int, int],
    page_size: int,
    pages_per_chunk: int,
    causal: bool,
    window: int | None,
    extras: dict[str, object],
    pages: str,
    seed: int,
) -> None:
    rows, query_len = padding
    if rows:
        spec = spec.with_padding(rows, query_len)
    layer, layout = chunked_layout(
        page_size,
        attention_chunk_size=page_size * pages_per_chunk,
        causal=causal,
        sliding_window=window,
        **extras,
    )
    check(make_batch(spec, layer, layout, pages=pages, seed=seed))  # type: ignore[arg-type]


def test_seeded_long_batches() -> None:
    """Longer sequences than the hypothesis draws (many chunks each), fixed seeds."""
    r = random.Random(0)
    for seed in range(20):
        q = [r.choice([0, 1, 1, r.randint(2, 150)]) for _ in range(r.randint(1, 5))]
        s = [x + r.randint(0 if x else 1, 300) for x in q]
        p = r.choice([1, 16])
        layer, layout = chunked_layout(p, attention_chunk_size=p * r.randint(1, 4) * 8)
        check(make_batch(BatchSpec(tuple(q), tuple(s)), layer, layout, seed=seed))

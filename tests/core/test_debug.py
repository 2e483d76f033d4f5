"""Debug mode (``ATTNSDK_DEBUG=1``, attnsdk/selection/debug.py) accepts what every backend serves exactly,
and serves it like the reference backend: sinks of -inf, and a self-attention step that writes
nothing over page 0 (vLLM's encoder-only attention). What it refuses is in the bad-input matrix
(tests/core/test_bad_input_matrix.py: sinks NaN / +inf, a writing step on the reserved page)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import attnsdk as A
from attnsdk import AttentionMetadata, InvalidMetadataError, KVCacheLayout, LayerSpec
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.selection.debug import wrap_debug
from attnsdk.testing import BatchSpec, make_batch

REF = ReferenceBackend()
DEBUG = wrap_debug(ReferenceBackend())
NEG_INF = -math.inf


@pytest.mark.parametrize("backend", ["reference", "flex"])
@pytest.mark.parametrize("heads", [[1], [0, 1, 2, 3]], ids=["one-head", "every-head"])
def test_minus_inf_sinks_are_served_exactly(backend: str, heads: list[int]) -> None:
    """A sink of -inf adds exp(-inf) = 0 to its row's denominator: the debug wrapper serves it
    (it used to refuse it as "not finite") bit for bit like the backend it wraps, and a head
    whose sink is -inf equals that head without a sink."""
    layer = LayerSpec(4, 2, 16, has_sinks=True)
    layout = KVCacheLayout(2, 16, 16, dtype=torch.float32)  # flex's smallest page
    batch = make_batch(BatchSpec((1, 5, 3), (7, 5, 20)), layer, layout, seed=1)
    sinks = batch.sinks.clone()
    sinks[heads] = NEG_INF
    batch = dataclasses.replace(batch, sinks=sinks)
    inner = A.create_backend(backend)
    want, want_cache = batch.run(inner)
    got, got_cache = batch.run(wrap_debug(A.create_backend(backend)))
    assert torch.equal(got, want)
    assert torch.equal(got_cache.k, want_cache.k)
    assert torch.equal(got_cache.v, want_cache.v)
    plain = dataclasses.replace(batch, layer=LayerSpec(4, 2, 16), sinks=None)
    without, _ = plain.run(REF)
    torch.testing.assert_close(got[:, heads], without[:, heads], rtol=1e-6, atol=1e-6)


def test_minus_inf_sinks_are_served_exactly_ragged() -> None:
    layer = LayerSpec(4, 2, 16, has_sinks=True)
    meta = AttentionMetadata.for_ragged([2, 3], [2, 5])
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, 16, generator=gen) for n, h in ((5, 4), (7, 2), (7, 2)))
    sinks = torch.tensor([0.5, NEG_INF, -1.0, NEG_INF])
    want = REF.forward_ragged(q, k, v, REF.plan(meta), layer, sinks=sinks)
    got = DEBUG.forward_ragged(q, k, v, DEBUG.plan(meta), layer, sinks=sinks)
    assert torch.equal(got, want)


def encoder_only_step(query_lens: list[int]) -> tuple[AttentionMetadata, A.KVCache, torch.Tensor]:
    """Encoder-only attention served on a paged backend (as the vLLM drop-in did before it ran
    encoder layers through ``forward_ragged``): the step's own k / v as a page-size-1 cache,
    token t on page t (so the first sequence starts on page 0), sequence b's page table row
    ``query_start_loc[b] + arange``, nothing written."""
    gen = torch.Generator().manual_seed(3)
    n = sum(query_lens)
    k, v = torch.randn(n, 2, 16, generator=gen), torch.randn(n, 2, 16, generator=gen)
    cache = KVCacheLayout(2, 16, 1, dtype=torch.float32).wrap(k.unsqueeze(1), v.unsqueeze(1))
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    width = max(query_lens)
    pages = (qsl[:-1, None] + torch.arange(width, dtype=torch.int32)).clamp(max=n - 1)
    lens = torch.tensor(query_lens, dtype=torch.int32)
    meta = AttentionMetadata.from_tensors(
        query_start_loc=qsl,
        seq_lens=lens,
        page_table=pages,
        slot_mapping=torch.full((n,), -1, dtype=torch.int64),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=lens,
    )
    return meta, cache, torch.randn(n, 4, 16, generator=gen)


def test_a_self_attention_step_that_writes_nothing_may_read_page_0() -> None:
    """Debug mode does not refuse what vLLM's encoder-only path (and its test harness, whose
    block ids start at 0) does; ``validate()`` called directly stays strict."""
    meta, cache, q = encoder_only_step([3, 5, 2])
    layer = LayerSpec(4, 2, 16, causal=False)
    want = REF.forward(q, None, None, cache, REF.plan(meta), layer)
    got = DEBUG.forward(q, None, None, cache, DEBUG.plan(meta), layer)
    assert torch.equal(got, want)
    with pytest.raises(InvalidMetadataError, match=r"^page_table\[0, 0\]: expected a page other"):
        meta.validate(cache)


def test_debug_mode_still_checks_page_0_in_a_cross_attention_step() -> None:
    """A cross-attention step writes nothing too, but its keys are an encoder's, in pages an
    engine allocated: page 0 there is the padding page or vLLM's null block."""
    layout = KVCacheLayout(2, 16, 4, dtype=torch.float32)
    cache = layout.allocate(6)
    meta = AttentionMetadata.from_seqlens([2], [6], [[0, 3]], page_size=4, cross_attention=True)
    layer = LayerSpec(4, 2, 16, causal=False)
    q = torch.randn(2, 4, 16)
    REF.forward(q, None, None, cache, REF.plan(meta), layer)  # served: the check is debug's
    with pytest.raises(InvalidMetadataError, match=r"^page_table\[0, 0\]: "):
        DEBUG.forward(q, None, None, cache, DEBUG.plan(meta), layer)

"""Cross-attention (``AttentionMetadata.cross_attention``, ``attnsdk.features.cross``): the checks, who
refuses what, and the backends that serve it against the float64 oracle and a dense softmax."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from backend_variants import NoCrossBackend, RaggedCrossOnlyBackend
from oracle import run_oracle

import attnsdk as A
from attnsdk.backends.flex import FlexBackend, FlexOptions
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import BatchSpec, assert_close_to_reference, make_batch

CROSS = A.LayerSpec(num_heads=4, num_kv_heads=2, head_dim=32, causal=False)
LAYOUT = A.KVCacheLayout(2, 32, 16, dtype=torch.float32)
reference = ReferenceBackend()
BACKENDS = {"reference": reference, "flex": FlexBackend(FlexOptions(compile=False))}


def _meta(query_lens: list[int], seq_lens: list[int]) -> A.AttentionMetadata:
    return A.AttentionMetadata.from_seqlens(
        query_lens, seq_lens, [[1, 2], [3, 0]], 16, cross_attention=True
    )


# -- the metadata ------------------------------------------------------------------------------


def test_more_queries_than_keys_and_no_writes() -> None:
    meta = _meta([7, 2], [3, 0])  # a 7-token decoder prompt over 3 encoder keys; no encoder
    assert meta.slot_mapping.tolist() == [-1] * 9
    meta.validate(LAYOUT)
    reference.plan(meta)
    with pytest.raises(A.InvalidMetadataError, match=r"seq_lens\[0\]"):
        A.AttentionMetadata.from_seqlens([7], [3], [[1]], 16)  # without the flag: refused


def test_bad_cross_metadata_names_the_field() -> None:
    with pytest.raises(A.InvalidMetadataError, match=r"seq_lens\[1\]"):
        _meta([1, 1], [3, -1])
    with pytest.raises(A.InvalidMetadataError, match="cross_attention"):
        A.AttentionMetadata.from_seqlens([1], [3], [[1]], 16, cross_attention=1)  # type: ignore[arg-type]
    meta = _meta([2, 1], [20, 3])
    written = dataclasses.replace(meta, slot_mapping=torch.tensor([16, 17, -1]))
    with pytest.raises(A.InvalidMetadataError, match=r"slot_mapping.*writes nothing"):
        written.validate(LAYOUT)
    tree = dataclasses.replace(meta, tree_mask=torch.ones(3, 2, dtype=torch.bool))
    with pytest.raises(A.InvalidMetadataError, match="tree_mask"):
        reference.plan(tree)


def test_a_backend_without_cross_attention_refuses_the_step_at_plan() -> None:
    with pytest.raises(A.UnsupportedConfigError, match="cannot serve this step") as err:
        NoCrossBackend().plan(_meta([2, 1], [20, 3]))
    assert [r.field for r in err.value.reasons] == ["cross_attention"]


@pytest.mark.parametrize("width", [0, 1])
def test_a_ragged_only_backend_refuses_a_paged_cross_step_at_forward(width: int) -> None:
    """A backend with ``Feature.RAGGED`` but no paged cross-attention plans the step (a plan
    serves both forwards) and refuses it in ``forward``, whatever the page table's width."""
    backend = RaggedCrossOnlyBackend()
    meta = A.AttentionMetadata.from_seqlens([2], [width], [[1] * width], 16, cross_attention=True)
    plan = backend.plan(meta)
    q = torch.zeros(2, 4, 32)
    with pytest.raises(A.UnsupportedConfigError, match="cross-attention step") as err:
        backend.forward(q, None, None, LAYOUT.allocate(num_pages=2), plan, CROSS)
    assert [r.field for r in err.value.reasons] == ["cross_attention"]
    ragged = A.AttentionMetadata.for_ragged([2], [3], cross_attention=True)
    k, v = torch.ones(3, 2, 32), torch.ones(3, 2, 32)
    out = backend.forward_ragged(q, k, v, backend.plan(ragged), CROSS)
    assert torch.equal(out, torch.ones_like(out))


@pytest.mark.parametrize(
    ("layer", "fields"),
    [
        ({"causal": True}, ["causal"]),
        ({"sliding_window": 8}, ["sliding_window"]),
        ({"attention_chunk_size": 32}, ["attention_chunk_size"]),
    ],
)
def test_layers_that_need_shared_positions_are_refused_before_writing(
    layer: dict[str, object], fields: list[str]
) -> None:
    batch = make_batch(
        BatchSpec.cross_attention(seed=1), dataclasses.replace(CROSS, **layer), LAYOUT
    )
    cache = batch.fresh_cache()
    with pytest.raises(A.UnsupportedConfigError) as err:
        batch.run(reference, cache)
    assert [r.field for r in err.value.reasons] == fields
    assert torch.equal(cache.k, batch.cache.k)


def test_new_keys_in_a_cross_step_are_refused() -> None:
    batch = make_batch(BatchSpec.cross_attention(seed=2), CROSS, LAYOUT)
    with pytest.raises(A.InvalidInputError, match="k/v"):
        reference.forward(
            batch.q, batch.k, batch.v, batch.fresh_cache(), reference.plan(batch.metadata), CROSS
        )


def test_a_cross_step_is_not_replayed_from_a_graph() -> None:
    state = reference.graph_state(4, 16, 4, page_size=16, device="cpu")
    captured = reference.plan_for_capture(state, 2, 3)
    with pytest.raises(A.UnsupportedConfigError, match="graph") as err:
        reference.plan_for_replay(captured, _meta([2, 1], [20, 3]))
    assert [r.field for r in err.value.reasons] == ["cross_attention"]


# -- served ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_random_cross_steps_match_the_oracle(name: str) -> None:
    backend = BACKENDS[name]
    for seed in range(20):
        layer = dataclasses.replace(
            CROSS, has_sinks=seed % 3 == 1, softcap=4.0 if seed % 4 == 2 else None
        )
        spec = BatchSpec.cross_attention(batch_size=3 + seed % 4, seed=seed)
        batch = make_batch(spec, layer, LAYOUT, seed=seed)
        expected = run_oracle(batch)
        out, lse, cache = batch.run_with_lse(backend)
        assert_close_to_reference(out, expected.out.float(), atol=1e-4, rtol=1e-4)
        empty = torch.isneginf(expected.lse)
        assert torch.equal(torch.isneginf(lse), empty)
        assert_close_to_reference(lse[~empty], expected.lse[~empty].float(), atol=1e-4, rtol=1e-4)
        assert torch.equal(cache.k, batch.cache.k)  # nothing written
        assert torch.equal(cache.v, batch.cache.v)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_encoder_then_decoder_steps_equal_a_dense_softmax(name: str) -> None:
    """What an engine does: write the encoder's K/V once, then every decoder step (a prompt of
    more tokens than the encoder has, then decodes) attends over all of them."""
    backend = BACKENDS[name]
    gen = torch.Generator().manual_seed(0)
    enc_k, enc_v = torch.randn(5, 2, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    cache = LAYOUT.allocate(num_pages=3)
    cache.store(enc_k, enc_v, torch.arange(16, 21))  # page 1, offsets 0..4
    for n in (9, 1, 1):  # the decoder's prompt, then two decode steps
        q = torch.randn(n, 4, 32, generator=gen)
        meta = A.AttentionMetadata.from_seqlens([n], [5], [[1]], 16, cross_attention=True)
        out = backend.forward(q, None, None, cache, backend.plan(meta), CROSS)
        k = enc_k.repeat_interleave(2, dim=1)  # query head h reads KV head h // 2
        v = enc_v.repeat_interleave(2, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(32)
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        assert_close_to_reference(out, want, atol=1e-5, rtol=1e-5)

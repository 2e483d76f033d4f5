"""The reference backend against the independent float64 oracle (tests/oracle.py).

Every case checks the output and the log-sum-exp of each real query row, and the whole cache
afterwards: the new K/V at ``slot_mapping`` and every other byte unchanged.
"""

from __future__ import annotations

import dataclasses
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle import assert_same_bits, run_oracle, to_nhd

from attnsdk import AttentionMetadata, InvalidMetadataError, KVCacheLayout, LayerSpec
from attnsdk.backends.reference import ReferenceBackend, ReferenceOptions
from attnsdk.testing import Batch, BatchSpec, assert_close_to_reference, make_batch
from attnsdk.testing.strategies import batch_specs, page_orders

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAGE_SIZES = (1, 2, 16, 64)
ORDERS = ("shuffled", "contiguous", "interleaved")

# The oracle reads exactly what the backend reads, so only the backend's fp32 accumulation and
# the final rounding to the output dtype separate them.
_TOL = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}

reference = ReferenceBackend()


def check(batch: Batch, backend: ReferenceBackend = reference) -> torch.Tensor:
    """Run ``backend`` (outputs poisoned with NaN) with and without ``lse=``; compare output,
    log-sum-exp and cache with the oracle, and the two outputs bit for bit."""
    out, cache = batch.run(backend)
    out_lse, lse, cache_lse = batch.run_with_lse(backend)
    expected = run_oracle(batch)
    tol = _TOL[batch.q.dtype]
    assert_close_to_reference(out, expected.out.float(), atol=tol, rtol=tol)
    assert torch.equal(out_lse, out), "asking for the log-sum-exp changed the output"
    assert_lse_close(lse, expected.lse)
    order = cache.layout.kv_order.value
    for c in (cache, cache_lse):
        assert_same_bits(to_nhd(c.k, order), expected.k, "K cache")
        assert_same_bits(to_nhd(c.v, order), expected.v, "V cache")
    return out


def assert_lse_close(lse: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 log-sum-exp against the float64 oracle: equal -inf where the oracle has -inf."""
    assert lse.dtype == torch.float32
    assert lse.shape == expected.shape, (lse.shape, expected.shape)
    got = lse.cpu()
    assert torch.equal(got.isneginf(), expected.isneginf()), "rows with -inf differ"
    finite = ~expected.isneginf()
    assert_close_to_reference(got[finite], expected[finite].float(), atol=2e-5, rtol=2e-5)


def layer_and_layout(
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    v_head_dim: int | None = None,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    kv_dtype: torch.dtype | None = None,
    order: str = "NHD",
    **layer_kwargs: object,
) -> tuple[LayerSpec, KVCacheLayout]:
    layer = LayerSpec(num_heads, num_kv_heads, head_dim, v_head_dim=v_head_dim, **layer_kwargs)  # type: ignore[arg-type]
    layout = KVCacheLayout(
        num_kv_heads,
        head_dim,
        page_size,
        dtype=dtype,
        v_head_dim=v_head_dim,
        order=order,
        kv_dtype=kv_dtype,
    )
    return layer, layout


# --- every preset x page order x page size ------------------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("pages", ORDERS)
@pytest.mark.parametrize("preset", sorted(BatchSpec.presets()))
def test_presets(preset: str, pages: str, page_size: int) -> None:
    spec = BatchSpec.presets(seed=page_size)[preset]
    layer, layout = layer_and_layout(page_size=page_size)
    check(make_batch(spec, layer, layout, pages=pages, seed=page_size))  # type: ignore[arg-type]


# --- each feature on its own, over several mixed batches -----------------------------------

FEATURES: dict[str, dict[str, object]] = {
    "mha": {"num_heads": 4, "num_kv_heads": 4},
    "gqa": {"num_heads": 8, "num_kv_heads": 2},
    "mqa": {"num_heads": 6, "num_kv_heads": 1},
    "window": {"sliding_window": 5},
    "window-1": {"sliding_window": 1},
    "window-noncausal": {"sliding_window": 4, "causal": False},
    "noncausal": {"causal": False},
    "chunked": {"attention_chunk_size": 8},
    "chunked-1": {"attention_chunk_size": 1},
    "chunked-window": {"attention_chunk_size": 8, "sliding_window": 5},
    "chunked-noncausal": {"attention_chunk_size": 6, "causal": False},
    "chunked-sinks": {"attention_chunk_size": 4, "has_sinks": True, "softcap": 2.0},
    "softcap": {"softcap": 1.5},
    "softcap-zero-is-off": {"softcap": 0.0},
    "sinks": {"has_sinks": True},
    "sinks-window": {"has_sinks": True, "sliding_window": 3},
    "scale": {"scale": 0.7},
    "v-head-dim": {"v_head_dim": 24},
    "v-head-dim-small": {"head_dim": 32, "v_head_dim": 8},
    "hnd": {"order": "HND"},
    "hnd-vdim": {"order": "HND", "v_head_dim": 12},
    "fp16": {"dtype": torch.float16},
    "bf16": {"dtype": torch.bfloat16},
    "e4m3": {"kv_dtype": E4M3},
    "e4m3-bf16": {"kv_dtype": E4M3, "dtype": torch.bfloat16},
    "e5m2-fp16": {"kv_dtype": E5M2, "dtype": torch.float16},
    "e4m3-hnd": {"kv_dtype": E4M3, "order": "HND"},
    "everything": {
        "num_heads": 8,
        "num_kv_heads": 2,
        "v_head_dim": 8,
        "sliding_window": 7,
        "softcap": 2.0,
        "has_sinks": True,
        "scale": 0.3,
        "order": "HND",
        "kv_dtype": E4M3,
        "dtype": torch.bfloat16,
    },
}


FEATURE_CASES = [
    pytest.param(name, per_head, id=f"{name}-per-head" if per_head else name)
    for name, kwargs in sorted(FEATURES.items())
    for per_head in ([False, True] if "kv_dtype" in kwargs else [False])
]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(("feature", "per_head_scales"), FEATURE_CASES)
def test_features(feature: str, per_head_scales: bool, page_size: int) -> None:
    layer, layout = layer_and_layout(page_size=page_size, **FEATURES[feature])  # type: ignore[arg-type]
    for seed in range(3):
        spec = BatchSpec.mixed(batch_size=5, max_len=40, seed=seed)
        batch = make_batch(spec, layer, layout, seed=seed, per_head_scales=per_head_scales)
        check(batch)


def test_per_head_scales_are_per_head() -> None:
    """Per-head scales must differ from their mean, or a backend ignoring the head would pass."""
    layer, layout = layer_and_layout(num_heads=4, num_kv_heads=4, kv_dtype=E4M3)
    batch = make_batch(BatchSpec.mixed(seed=3), layer, layout, seed=3, per_head_scales=True)
    assert batch.k_scale is not None
    assert batch.k_scale.shape == (4,)
    assert float(batch.k_scale.max() - batch.k_scale.min()) > 0.05
    out = check(batch)
    flat = dataclasses.replace(batch, k_scale=batch.k_scale.mean().reshape(()))
    other, _ = flat.run(reference)
    assert not torch.allclose(out, other, atol=1e-3)


# --- page edges, row kinds, zero-length and padding rows -------------------------------------


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_lengths_at_page_edges(page_size: int) -> None:
    p = page_size
    edges = sorted({max(1, x) for x in (p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1)})
    q, s = [], []
    for length in edges:
        q += [1, length, min(length, p + 1)]  # decode, prefill, extend crossing a page edge
        s += [length, length, length]
    spec = BatchSpec(tuple(q), tuple(s), "page-edges")
    for pages in ORDERS:
        layer, layout = layer_and_layout(page_size=p, sliding_window=p + 1)
        check(make_batch(spec, layer, layout, pages=pages, seed=p))  # type: ignore[arg-type]


@pytest.mark.parametrize("chunk", [1, 3, 16, 17])
@pytest.mark.parametrize("page_size", [1, 16])
def test_lengths_at_chunk_edges(page_size: int, chunk: int) -> None:
    """Decode rows on the first and last position of a chunk, extends and prefills that
    straddle one or several chunk boundaries, and an empty row."""
    c = chunk
    q = (1, 1, 1, c + 2, 2, 3 * c + 1, 0)
    s = (c + 1, 2 * c, 3 * c + 1, 2 * c + 1, c + 1, 3 * c + 1, c)
    spec = BatchSpec(q, s, "chunk-edges")
    for causal in (True, False):
        layer, layout = layer_and_layout(page_size=page_size, attention_chunk_size=c, causal=causal)
        check(make_batch(spec, layer, layout, pages="shuffled", seed=c))


@pytest.mark.parametrize("page_size", [1, 16])
def test_zero_length_rows(page_size: int) -> None:
    """query_len 0 with seq_len 0 or with a context, first, between and last: no effect."""
    spec = BatchSpec((0, 3, 0, 1, 0, 5, 0), (0, 10, 9, 20, 0, 5, 33), "zeros")
    layer, layout = layer_and_layout(page_size=page_size, has_sinks=True)
    out = check(make_batch(spec, layer, layout, seed=1))
    assert out.shape[0] == 9


def test_only_zero_length_rows() -> None:
    spec = BatchSpec((0, 0), (0, 4), "idle")
    layer, layout = layer_and_layout(page_size=2)
    out = check(make_batch(spec, layer, layout))
    assert out.shape[0] == 0


@pytest.mark.parametrize("query_len", [1, 2])
@pytest.mark.parametrize("page_size", [1, 16])
def test_graph_padding_rows(page_size: int, query_len: int) -> None:
    """Padding rows read the reserved page, write nothing, and leave real rows exact."""
    for seed in range(3):
        spec = BatchSpec.mixed(batch_size=4, max_len=30, seed=seed).with_padding(3, query_len)
        layer, layout = layer_and_layout(page_size=page_size, has_sinks=True, softcap=3.0)
        batch = make_batch(spec, layer, layout, seed=seed)
        padded_tokens = sum(q for q, pad in zip(spec.query_lens, spec.padded) if pad)
        assert padded_tokens == 3 * query_len
        assert (batch.metadata.slot_mapping[-padded_tokens:] == -1).all()
        out = check(batch)
        assert torch.isfinite(out).all()


def test_negative_slots_write_nothing() -> None:
    """Tokens the engine already wrote (slot -1) leave the cache as it is and are read from it."""
    layer, layout = layer_and_layout(page_size=4)
    batch = make_batch(BatchSpec.mixed(batch_size=6, seed=2), layer, layout, seed=2)
    slots = batch.metadata.slot_mapping.clone()
    slots[::3] = -1
    meta = dataclasses.replace(batch.metadata, slot_mapping=slots)
    check(dataclasses.replace(batch, metadata=meta))


@pytest.mark.parametrize("kv_dtype", [None, E4M3])
def test_no_new_kv_writes_nothing(kv_dtype: torch.dtype | None) -> None:
    """forward(q, None, None, ...) attends over the cache as it is."""
    layer, layout = layer_and_layout(page_size=16, kv_dtype=kv_dtype)
    batch = make_batch(BatchSpec.mixed(seed=5), layer, layout, seed=5)
    cache = batch.fresh_cache()
    out = reference.forward(
        batch.q,
        None,
        None,
        cache,
        reference.plan(batch.metadata),
        layer,
        k_scale=batch.k_scale,
        v_scale=batch.v_scale,
    )
    expected = run_oracle(batch, write=False)
    assert_close_to_reference(out, expected.out.float(), atol=2e-5, rtol=2e-5)
    assert_same_bits(cache.k, batch.cache.k, "K cache")
    assert_same_bits(cache.v, batch.cache.v, "V cache")
    assert_same_bits(cache.k, expected.k, "K cache")
    assert_same_bits(cache.v, expected.v, "V cache")


def test_new_kv_is_what_the_step_reads() -> None:
    """The step's own K/V are written before attention: a prefill reads only new tokens."""
    layer, layout = layer_and_layout(page_size=4)
    batch = make_batch(BatchSpec((6,), (6,)), layer, layout, seed=9)
    written, _ = batch.run(reference)
    unwritten = reference.forward(
        batch.q, None, None, batch.fresh_cache(), reference.plan(batch.metadata), layer
    )
    assert not torch.allclose(written, unwritten)


def test_out_is_filled_and_returned() -> None:
    layer, layout = layer_and_layout(page_size=16)
    batch = make_batch(BatchSpec.mixed(seed=1), layer, layout, seed=1)
    out = torch.full((batch.q.shape[0], 4, 16), float("nan"))
    result = reference.forward(
        batch.q,
        batch.k,
        batch.v,
        batch.fresh_cache(),
        reference.plan(batch.metadata),
        layer,
        out=out,
    )
    assert result is out
    allocated = reference.forward(
        batch.q, batch.k, batch.v, batch.fresh_cache(), reference.plan(batch.metadata), layer
    )
    assert torch.equal(out, allocated)


@pytest.mark.parametrize("max_scores", [1, 50, 700])
def test_query_chunking_changes_nothing(max_scores: int) -> None:
    """Long prefills are split in query chunks; the split must be invisible."""
    layer, layout = layer_and_layout(page_size=16, sliding_window=9, has_sinks=True)
    batch = make_batch(BatchSpec.presets()["prefill"], layer, layout, seed=4)
    out = check(batch, ReferenceBackend(ReferenceOptions(max_scores=max_scores)))
    whole, _ = batch.run(reference)
    torch.testing.assert_close(out, whole, atol=1e-6, rtol=1e-6)


# --- rows that see no key ---------------------------------------------------------------------


def _raw_metadata(
    query_lens: list[int], seq_lens: list[int], table: list[list[int]]
) -> AttentionMetadata:
    """Metadata as an engine might hand it over, bypassing from_seqlens' checks."""
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata.from_tensors(
        query_start_loc=qsl,
        seq_lens=seq,
        page_table=torch.tensor(table, dtype=torch.int32),
        slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64),
        query_start_loc_cpu=qsl.clone(),
        seq_lens_cpu=seq.clone(),
    )


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "field"),
    [([2, 3, 2], [5, 1, 3], "seq_lens[1]"), ([2, 1, 2], [5, 0, 3], "seq_lens[1]")],
    ids=["queries-before-position-0", "tokens-without-keys"],
)
def test_queries_without_keys_are_refused(
    query_lens: list[int], seq_lens: list[int], field: str
) -> None:
    """A row with more query tokens than keys would put queries before position 0 (or see no
    key at all): ``plan`` refuses it on the host, before any layer runs."""
    meta = _raw_metadata(query_lens, seq_lens, [[1, 2], [3, 0], [4, 0]])
    with pytest.raises(InvalidMetadataError, match=rf"^{re.escape(field)}: expected >= "):
        reference.plan(meta)


# --- hypothesis: random batches and random layers ----------------------------------------------


@st.composite
def configs(draw: st.DrawFn) -> tuple[LayerSpec, KVCacheLayout, bool]:
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([8, 16, 32]))
    v_head_dim = draw(st.sampled_from([None, None, 8, 24]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float16, torch.bfloat16]))
    kv_dtype = draw(st.sampled_from([None, None, None, E4M3, E5M2]))
    layer, layout = layer_and_layout(
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        page_size=draw(st.sampled_from(PAGE_SIZES)),
        dtype=dtype,
        kv_dtype=kv_dtype,
        order=draw(st.sampled_from(["NHD", "HND"])),
        causal=draw(st.booleans()),
        sliding_window=draw(st.none() | st.integers(1, 48)),
        attention_chunk_size=draw(st.none() | st.none() | st.integers(1, 40)),
        softcap=draw(st.none() | st.sampled_from([0.5, 4.0, 30.0])),
        has_sinks=draw(st.booleans()),
        scale=draw(st.none() | st.floats(0.02, 1.5)),
    )
    return layer, layout, draw(st.booleans())


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    spec=batch_specs(max_batch=6, max_context=80, max_query_len=24),
    padding=st.sampled_from([(0, 1), (0, 1), (1, 1), (2, 1), (2, 2)]),
    config=configs(),
    pages=page_orders,
    max_scores=st.sampled_from([1 << 25, 1 << 25, 200]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    spec: BatchSpec,
    padding: tuple[int, int],
    config: tuple[LayerSpec, KVCacheLayout, bool],
    pages: str,
    max_scores: int,
    seed: int,
) -> None:
    layer, layout, per_head_scales = config
    rows, query_len = padding
    if rows:
        spec = spec.with_padding(rows, query_len)
    batch = make_batch(spec, layer, layout, pages=pages, seed=seed, per_head_scales=per_head_scales)  # type: ignore[arg-type]
    check(batch, ReferenceBackend(ReferenceOptions(max_scores=max_scores)))


def test_seeded_mixed_batches_any_order() -> None:
    """Decode, extend, prefill and empty rows shuffled into many orders, on a GQA layer."""
    rng = random.Random(0)
    layer, layout = layer_and_layout(num_heads=8, num_kv_heads=2, page_size=2, sliding_window=11)
    kinds = [(1, 30), (7, 25), (9, 9), (0, 12), (0, 0), (4, 4), (1, 1), (12, 40)]
    for seed in range(40):
        rng.shuffle(kinds)
        spec = BatchSpec(tuple(q for q, _ in kinds), tuple(s for _, s in kinds))
        check(make_batch(spec, layer, layout, pages=rng.choice(ORDERS), seed=seed))  # type: ignore[arg-type]

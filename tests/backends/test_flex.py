"""The flex backend on CPU against the reference backend: every declared feature, the refusals,
and compile caching (one compiled bucket, reused without recompiling)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import torch
from oracle import Semantics, visible

import attnsdk as A
from attnsdk.backends.flex import FlexBackend, FlexOptions
from attnsdk.backends.flex.mask import build_mask
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import Batch, BatchSpec, assert_close_to_reference, make_batch

reference = ReferenceBackend()
eager = FlexBackend(FlexOptions(compile=False))


def layer_and_layout(
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    v_head_dim: int | None = None,
    page_size: int = 16,
    dtype: torch.dtype = torch.float32,
    **layer_kwargs: object,
) -> tuple[A.LayerSpec, A.KVCacheLayout]:
    layer = A.LayerSpec(num_heads, num_kv_heads, head_dim, v_head_dim=v_head_dim, **layer_kwargs)  # type: ignore[arg-type]
    layout = A.KVCacheLayout(num_kv_heads, head_dim, page_size, dtype=dtype, v_head_dim=v_head_dim)
    return layer, layout


def check(batch: Batch, backend: FlexBackend = eager) -> None:
    out, cache = batch.run(backend)
    expected, ref_cache = batch.run(reference)
    assert_close_to_reference(out, expected)
    assert torch.equal(cache.k, ref_cache.k)
    assert torch.equal(cache.v, ref_cache.v)


FEATURES: dict[str, dict[str, object]] = {
    "mha": {"num_heads": 4, "num_kv_heads": 4},
    "gqa": {"num_heads": 8, "num_kv_heads": 2},
    "gqa-3": {"num_heads": 6, "num_kv_heads": 2},
    "mqa": {"num_heads": 4, "num_kv_heads": 1},
    "window": {"sliding_window": 5},
    "window-1": {"sliding_window": 1},
    "window-long": {"sliding_window": 40},
    "window-noncausal": {"sliding_window": 4, "causal": False},
    "noncausal": {"causal": False},
    "chunked": {"attention_chunk_size": 32},
    "chunked-odd": {"attention_chunk_size": 7},
    "chunked-window": {"attention_chunk_size": 16, "sliding_window": 5},
    "chunked-noncausal": {"attention_chunk_size": 24, "causal": False},
    "softcap": {"softcap": 1.5},
    "sinks": {"has_sinks": True},
    "sinks-window": {"has_sinks": True, "sliding_window": 3},
    "scale": {"scale": 0.7},
    "v-head-dim": {"v_head_dim": 32},
    "head-dim-32": {"head_dim": 32, "v_head_dim": 16},
    "page-32": {"page_size": 32},
    "fp16": {"dtype": torch.float16},
    "bf16": {"dtype": torch.bfloat16},
    "everything": {
        "num_heads": 8,
        "num_kv_heads": 2,
        "v_head_dim": 32,
        "sliding_window": 7,
        "softcap": 2.0,
        "has_sinks": True,
        "scale": 0.3,
        "dtype": torch.bfloat16,
    },
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_features(feature: str) -> None:
    layer, layout = layer_and_layout(**FEATURES[feature])  # type: ignore[arg-type]
    for seed in range(3):
        spec = BatchSpec.mixed(batch_size=5, max_len=70, seed=seed)
        check(make_batch(spec, layer, layout, seed=seed))


@pytest.mark.parametrize("preset", sorted(BatchSpec.presets()))
@pytest.mark.parametrize("pages", ["shuffled", "interleaved"])
def test_presets(preset: str, pages: str) -> None:
    layer, layout = layer_and_layout(num_heads=8, num_kv_heads=2, sliding_window=50)
    spec = BatchSpec.presets(seed=1)[preset]
    check(make_batch(spec, layer, layout, pages=pages, seed=1))  # type: ignore[arg-type]


def test_random_batches() -> None:
    """Random lengths, padding and empty rows, several query blocks (rows > 128)."""
    r = random.Random(0)
    for seed in range(12):
        n = r.randint(1, 6)
        qlens = [r.choice([0, 1, 1, 3, r.randint(1, 200)]) for _ in range(n)]
        slens = [q + r.randint(0 if q else 1, 150) for q in qlens]
        spec = BatchSpec(tuple(qlens), tuple(slens))
        if r.random() < 0.3:
            spec = spec.with_padding(rows=r.randint(1, 2))
        kw = r.choice(list(FEATURES.values()))
        layer, layout = layer_and_layout(**kw)  # type: ignore[arg-type]
        check(make_batch(spec, layer, layout, seed=seed))


@pytest.mark.parametrize(
    "layer_kw",
    [
        {},
        {"sliding_window": 20},
        {"causal": False},
        {"attention_chunk_size": 48},
        {"attention_chunk_size": 5, "sliding_window": 3},
        {"attention_chunk_size": 64, "causal": False},
    ],
    ids=["causal", "window", "noncausal", "chunk", "chunk-window", "chunk-noncausal"],
)
def test_block_mask_lists_every_page_a_block_may_see(layer_kw: dict[str, Any]) -> None:
    """Eager flex ignores block sparsity (its mask_mod alone decides), so the pages the block
    mask lists for each (row, query block) are checked here against the oracle's rule: every
    page holding a key some row of the block sees must be listed."""
    layer, layout = layer_and_layout(**layer_kw)
    state = eager.layer_state(layer, layout)
    sem = Semantics.of(layer)
    spec = BatchSpec((1, 300, 0, 130, 2), (301, 300, 9, 200, 97))
    batch = make_batch(spec, layer, layout, seed=7)
    meta = batch.metadata
    n = batch.cache.num_pages
    mask = build_mask(meta, state, n, meta.num_tokens, None)
    p = layout.page_size
    for b, (q, length) in enumerate(zip(spec.query_lens, spec.seq_lens)):
        pos = torch.arange(length - q, length)
        for block in range(0, q, 128):
            seen = visible(pos[block : block + 128], torch.arange(length), sem).any(0)
            needed = set(meta.page_table[b, (torch.nonzero(seen).flatten() // p)].tolist())
            count = int(mask.kv_num_blocks[b, 0, block // 128])
            listed = set(mask.kv_indices[b, 0, block // 128, :count].tolist())
            assert needed <= listed, (b, block, sorted(needed - listed))
            if "attention_chunk_size" in layer_kw and layer.causal:
                assert len(listed) == len(needed), "chunks leave pages out of the block mask"


def test_output_rows_of_a_strided_out_and_q() -> None:
    layer, layout = layer_and_layout()
    batch = make_batch(BatchSpec.mixed(batch_size=4, seed=2), layer, layout, seed=2)
    expected, _ = batch.run(reference)
    big = torch.full((batch.q.shape[0], 8, 16), float("nan"))
    out = big[:, ::2]  # a strided destination
    plan = eager.plan(batch.metadata)
    q = torch.cat([batch.q, batch.q], dim=-1)[..., :16]  # a strided q
    res = eager.forward(q, batch.k, batch.v, batch.fresh_cache(), plan, layer, out=out)
    assert res is out
    assert_close_to_reference(out, expected)


# --- what it refuses, with reasons ------------------------------------------------------

REFUSED = {
    "page-1": ({"page_size": 1}, "page_size"),
    "page-8": ({"page_size": 8}, "page_size"),
    "page-48": ({"page_size": 48}, "page_size"),
    "head-dim-24": ({"head_dim": 24}, "head_dim"),
    "head-dim-512": ({"head_dim": 512}, "head_dim"),
    "fp8": ({"kv_dtype": torch.float8_e4m3fn}, "kv_dtype"),
    "hnd": ({"order": "HND"}, "order"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals(case: str) -> None:
    kwargs, field = REFUSED[case]
    layer = A.LayerSpec(4, 2, int(kwargs.get("head_dim", 16)))  # type: ignore[call-overload]
    layout = A.KVCacheLayout(
        2,
        int(kwargs.get("head_dim", 16)),  # type: ignore[call-overload]
        int(kwargs.get("page_size", 16)),  # type: ignore[call-overload]
        dtype=torch.bfloat16,
        order=kwargs.get("order", "NHD"),  # type: ignore[arg-type]
        kv_dtype=kwargs.get("kv_dtype"),  # type: ignore[arg-type]
    )
    reasons = eager.unsupported_reasons(layer, layout, "cpu")
    assert field in {r.field for r in reasons}, reasons
    with pytest.raises(A.UnsupportedConfigError):
        eager.prepare([layer], layout, "cpu")


def test_an_interleaved_cache_is_refused_before_anything_is_written() -> None:
    layer, layout = layer_and_layout()
    # vLLM's [N, 2, P, H, D]: K and V pages interleave, so K's pages are not P rows apart.
    both = torch.randn(8, 2, layout.page_size, 2, 16, dtype=layout.dtype)
    cache = layout.wrap(both[:, 0], both[:, 1])
    batch = make_batch(BatchSpec.mixed(seed=1), layer, layout, seed=1)
    before = both.clone()
    plan = eager.plan(batch.metadata)
    with pytest.raises(A.InvalidInputError, match=r"cache\.k"):
        eager.forward(batch.q, batch.k, batch.v, cache, plan, layer)
    assert torch.equal(both, before)


def test_compiled_cpu_refuses_sinks_with_a_reason() -> None:
    layer, layout = layer_and_layout(has_sinks=True)
    compiled = FlexBackend(FlexOptions(compile=True))
    reasons = compiled.unsupported_reasons(layer, layout, "cpu")
    assert [r.field for r in reasons] == ["has_sinks"]
    assert "compile=False" in reasons[0].message
    assert eager.unsupported_reasons(layer, layout, "cpu") == []
    # explain and the registry see the configured options without creating the backend.
    compiled_config = A.AttentionConfig(backend="flex", compile=True)
    assert [r.field for r in A.explain(compiled_config, layer, layout, "cpu")["flex"]] == [
        "has_sinks"
    ]
    assert A.explain("flex", layer, layout, "cpu") == {"flex": []}


def test_compiled_cpu_refuses_lse_before_anything_is_written() -> None:
    """Compiled flex returns no log-sum-exp on a CPU: lse= is refused per call, naming it and
    the way out, before the store (the layer itself is served)."""
    layer, layout = layer_and_layout()
    compiled = FlexBackend(FlexOptions(compile=True))
    cpu = torch.device("cpu")
    reasons = compiled.unsupported_reasons(layer, layout, cpu, uses=(A.Feature.LSE,))
    assert [r.field for r in reasons] == ["lse"]
    assert "compile=False" in reasons[0].message
    assert eager.unsupported_reasons(layer, layout, cpu, uses=(A.Feature.LSE,)) == []
    batch = make_batch(BatchSpec.mixed(seed=2), layer, layout, seed=2)
    k, v = batch.cache.k.clone(), batch.cache.v.clone()
    with pytest.raises(A.UnsupportedConfigError, match="compile=False"):
        batch.run_with_lse(compiled, batch.cache)
    assert torch.equal(batch.cache.k, k)
    assert torch.equal(batch.cache.v, v)
    assert compiled.compile_stats == []


def test_one_step_function_serves_calls_with_and_without_lse() -> None:
    """flex is asked for its log-sum-exp on every call where it can return one: a call with
    and one without lse= share one function and one shape bucket, so the output is bit for
    bit the same and the lse matches the reference."""
    backend = FlexBackend(FlexOptions(compile=False))
    layer, layout = layer_and_layout(num_heads=8, num_kv_heads=2)
    batch = make_batch(BatchSpec.mixed(seed=3), layer, layout, seed=3)
    plain, _ = batch.run(backend)
    out, lse, _ = batch.run_with_lse(backend)
    _, ref_lse, _ = batch.run_with_lse(reference)
    assert torch.equal(out, plain)
    assert_close_to_reference(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert len(backend._functions) == 1
    assert len(backend._buckets) == 1


def test_registered_and_options() -> None:
    assert "flex" in A.backend_names()
    backend = A.create_backend(A.AttentionConfig(backend="flex", compile=False))
    assert isinstance(backend, FlexBackend)
    assert backend.options.compile is False
    with pytest.raises(ValueError, match="extra"):
        FlexOptions(bogus=1)  # type: ignore[call-arg]


# --- compiled: one bucket, compiled once, reused ----------------------------------------


def test_dynamo_limits_count_every_flex_compile_in_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dynamo counts recompiles per code object, and every flex backend in a process compiles
    the same inner function: a new bucket's limit must follow the process's compiles, not the
    backend's own (a fresh backend after ~100 tests on an H200 hit the limit of 64)."""
    from attnsdk.backends.flex import backend as flex_module

    monkeypatch.setattr(flex_module, "_COMPILES_IN_PROCESS", itertools.count(300))
    seen: list[tuple[int, int]] = []

    def compiled_step(*args: Any) -> tuple[torch.Tensor, None]:
        config = torch._dynamo.config
        seen.append((config.recompile_limit, config.accumulated_recompile_limit))
        return args[0], None

    backend = FlexBackend(FlexOptions(compile=True))  # a fresh backend: no buckets of its own
    backend._first_call(("bucket",), compiled_step, (torch.zeros(1),), compiled=True)
    assert seen == [(2 * 300 + 8, 2 * (2 * 300 + 8))]
    assert len(backend.compile_stats) == 1


def test_compiled_matches_and_does_not_recompile_within_a_bucket() -> None:
    from torch._dynamo.utils import counters

    backend = FlexBackend(FlexOptions(compile=True))
    layer, layout = layer_and_layout(num_heads=8, num_kv_heads=2, sliding_window=30, softcap=3.0)
    # One bucket for every step (4 rows: Bb 4; longest query 3-4: Lb 4; 5-8 pages per row: 8;
    # one pool size), with other lengths and pages.
    specs = [BatchSpec((1, 3, 1, 4), (40, 9, 70, 4)), BatchSpec((4, 1, 2, 1), (60, 33, 2, 90))]
    specs += [BatchSpec((1, 1, 3, 1), (5, 17, 30, 100))]
    frames_before = None
    for i, spec in enumerate(specs):
        batch = make_batch(
            spec, layer, layout, seed=i, spare_pages=20 - sum(-(-s // 16) for s in spec.seq_lens)
        )
        check(batch, backend)
        if i == 0:
            frames_before = counters["stats"]["unique_graphs"]
    assert len(backend.compile_stats) == 1, backend.compile_stats
    assert counters["stats"]["unique_graphs"] == frames_before
    assert backend.compile_stats[0].seconds > 0


def test_a_page_at_two_logical_indices_is_refused_before_anything_is_written() -> None:
    layer, layout = layer_and_layout()
    cache = layout.allocate(8)
    # Sequence 1 reads page 3 as its second page, sequence 0 as its first: flex maps one
    # position per page, so this would silently lose keys.
    meta = A.AttentionMetadata.from_seqlens(
        [1, 1], [5, 20], page_table=[[3, 0], [2, 3]], page_size=16
    )
    q = torch.randn(2, 4, 16)
    k = torch.randn(2, 2, 16)
    before = cache.k.clone()
    with pytest.raises(A.InvalidMetadataError, match="page 3 at logical indices"):
        eager.forward(q, k, k.clone(), cache, eager.plan(meta), layer)
    assert torch.equal(cache.k, before)

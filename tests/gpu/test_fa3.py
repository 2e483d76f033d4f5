"""fa3 against the reference backend on random paged batches (H200 / sm90 only).

Every case compares the output (dtype-derived tolerance) and the cache after the KV write.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import attnsdk as A
from attnsdk.backends.fa3.kernels import build_flags
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing import (
    Batch,
    BatchSpec,
    assert_close_to_reference,
    forbid_device_sync,
    make_batch,
)

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.fa3]

FP8 = torch.float8_e4m3fn
DEV = "cuda"


@pytest.fixture(scope="module")
def fa3() -> A.Backend:
    return A.create_backend("fa3")


@pytest.fixture(scope="module")
def ref() -> A.Backend:
    return ReferenceBackend()


def specs(seed: int) -> list[BatchSpec]:
    r = random.Random(seed)
    return [
        BatchSpec.decode(batch_size=r.randint(1, 9), max_context=400, seed=seed),
        BatchSpec.chunked_prefill(seed=seed),
        BatchSpec.prefill(seed=seed),
        BatchSpec.mixed(seed=seed),
        BatchSpec.verify(seed=seed),
        BatchSpec.with_empty_rows(seed=seed),
        BatchSpec.decode(batch_size=3, seed=seed).with_padding(rows=2),
        BatchSpec.mixed(batch_size=4, seed=seed).with_padding(rows=1, query_len=3),
        *(BatchSpec.random(r) for _ in range(4)),
    ]


# name -> (LayerSpec kwargs, KVCacheLayout kwargs, make_batch kwargs)
CONFIGS: dict[str, tuple[dict, dict, dict]] = {
    "gqa-d128-bf16-p16": ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 128}, {}, {}),
    "mqa-d64-fp16-p1": (
        {"num_heads": 8, "num_kv_heads": 1, "head_dim": 64},
        {"page_size": 1, "dtype": torch.float16},
        {},
    ),
    "mha-d256-bf16-p64": (
        {"num_heads": 4, "num_kv_heads": 4, "head_dim": 256},
        {"page_size": 64},
        {},
    ),
    "gqa-d128-fp16-p256": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128},
        {"page_size": 256, "dtype": torch.float16},
        {},
    ),
    "gqa-d80-p16": ({"num_heads": 6, "num_kv_heads": 2, "head_dim": 80}, {}, {}),
    "window-causal": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "sliding_window": 19},
        {},
        {},
    ),
    "window-1": ({"num_heads": 4, "num_kv_heads": 2, "head_dim": 64, "sliding_window": 1}, {}, {}),
    "window-noncausal": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128, "sliding_window": 23, "causal": False},
        {"page_size": 64},
        {},
    ),
    "noncausal": ({"num_heads": 8, "num_kv_heads": 4, "head_dim": 64, "causal": False}, {}, {}),
    "sinks-bf16": ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 64, "has_sinks": True}, {}, {}),
    "sinks-fp16-window": (
        {
            "num_heads": 8,
            "num_kv_heads": 2,
            "head_dim": 128,
            "has_sinks": True,
            "sliding_window": 33,
        },
        {"dtype": torch.float16},
        {},
    ),
    "scale": ({"num_heads": 4, "num_kv_heads": 2, "head_dim": 128, "scale": 0.05}, {}, {}),
    "hnd-p16": ({"num_heads": 8, "num_kv_heads": 2, "head_dim": 128}, {"order": "HND"}, {}),
    "hnd-p64-mqa": (
        {"num_heads": 8, "num_kv_heads": 1, "head_dim": 64},
        {"order": "HND", "page_size": 64},
        {},
    ),
    "fp8-tensor-scale": (
        {"num_heads": 8, "num_kv_heads": 2, "head_dim": 128},
        {"kv_dtype": FP8},
        {},
    ),
    "fp8-head-scale-p64": (
        {"num_heads": 8, "num_kv_heads": 4, "head_dim": 64},
        {"kv_dtype": FP8, "page_size": 64},
        {"per_head_scales": True},
    ),
}


def _build(name: str, spec: BatchSpec, seed: int) -> Batch:
    layer_kw, layout_kw, batch_kw = CONFIGS[name]
    layer = A.LayerSpec(**layer_kw)
    layout = A.KVCacheLayout(layer.num_kv_heads, layer.head_dim, **{"page_size": 16, **layout_kw})
    pages = ("shuffled", "contiguous", "interleaved")[seed % 3]
    return make_batch(spec, layer, layout, pages=pages, seed=seed, device=DEV, **batch_kw)


def check(fa3: A.Backend, ref: A.Backend, batch: Batch) -> None:
    out, cache = batch.run(fa3)
    layout = batch.cache.layout
    if layout.is_quantized:
        # FA3 multiplies in fp8: its oracle sees q rounded to fp8 the same way. FA3 also rounds
        # the probabilities to fp8 before P·V, so allow twice the fp8-KV tolerance.
        q8 = batch.q.to(FP8).to(batch.q.dtype)
        ref_out, ref_cache = dataclasses.replace(batch, q=q8).run(ref)
        assert_close_to_reference(out, ref_out, atol=0.12, rtol=0.12)
        rel = float((out.float() - ref_out.float()).norm() / ref_out.float().norm())
        assert rel < 3e-2, f"relative L2 error {rel:.3g} of fp8 attention"
        for got, want in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
            # Triton's fp32 division may differ from torch's by an ulp before rounding to fp8.
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-3, atol=2**-9)
    else:
        ref_out, ref_cache = batch.run(ref)
        assert_close_to_reference(out, ref_out)
        assert torch.equal(cache.k, ref_cache.k), "K cache differs after the write"
        assert torch.equal(cache.v, ref_cache.v), "V cache differs after the write"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_reference(fa3: A.Backend, ref: A.Backend, name: str, seed: int) -> None:
    for i, spec in enumerate(specs(seed * 100 + len(name))):
        check(fa3, ref, _build(name, spec, seed * 1000 + i))


def test_long_context_and_large_batch(fa3: A.Backend, ref: A.Backend) -> None:
    layer = A.LayerSpec(num_heads=32, num_kv_heads=8, head_dim=128)
    layout = A.KVCacheLayout(8, 128, 16)
    for seed, spec in enumerate(
        [BatchSpec.long_context(batch_size=4, context=5000), BatchSpec.decode(64, 2000, seed=3)]
    ):
        check(fa3, ref, make_batch(spec, layer, layout, seed=seed, device=DEV))


def test_kv_already_written(fa3: A.Backend, ref: A.Backend) -> None:
    """k = v = None: the caller wrote the cache; fa3 only attends."""
    batch = _build("gqa-d128-bf16-p16", BatchSpec.mixed(seed=5), 5)
    cache = batch.fresh_cache()
    ref.forward(batch.q, batch.k, batch.v, cache, ref.plan(batch.metadata), batch.layer)
    out = fa3.forward(batch.q, None, None, cache, fa3.plan(batch.metadata), batch.layer)
    expected, _ = batch.run(ref)
    assert_close_to_reference(out[: batch.metadata.num_tokens], expected)


def test_packed_kv_views(fa3: A.Backend, ref: A.Backend) -> None:
    """vLLM's [N, Hkv, P, 2D] cache: K and V are strided HND halves of one tensor."""
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
    layout = A.KVCacheLayout(2, 128, 16, order="HND")
    batch = make_batch(BatchSpec.mixed(seed=8), layer, layout, seed=8, device=DEV)
    packed = torch.cat([batch.cache.k, batch.cache.v], dim=-1)
    cache = layout.wrap(packed[..., :128], packed[..., 128:])
    out, cache = batch.run(fa3, cache)
    ref_out, ref_cache = batch.run(ref)
    assert_close_to_reference(out, ref_out)
    assert torch.equal(cache.k, ref_cache.k)
    assert torch.equal(cache.v, ref_cache.v)


def test_softcap_per_build(fa3: A.Backend, ref: A.Backend) -> None:
    layer = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128, softcap=20.0)
    layout = A.KVCacheLayout(2, 128, 16)
    batch = make_batch(BatchSpec.mixed(seed=2), layer, layout, seed=2, device=DEV)
    if build_flags().get("FLASHATTENTION_DISABLE_SOFTCAP"):
        with pytest.raises(A.UnsupportedConfigError) as info:
            batch.run(fa3)
        assert [r.field for r in info.value.reasons] == ["softcap"]
        assert any(r.field == "softcap" for r in fa3.unsupported_reasons(layer, layout, DEV))
    else:
        check(fa3, ref, batch)


def test_out_none_allocates(fa3: A.Backend, ref: A.Backend) -> None:
    batch = _build("gqa-d128-bf16-p16", BatchSpec.decode(seed=4), 4)
    cache = batch.fresh_cache()
    plan = fa3.plan(batch.metadata)
    out = fa3.forward(batch.q, batch.k, batch.v, cache, plan, batch.layer)
    expected, _ = batch.run(ref)
    assert out.shape == batch.q.shape
    assert_close_to_reference(out, expected)


@pytest.mark.parametrize("name", ["sinks-bf16", "sinks-fp16-window"])
def test_lse_counts_the_sink_once(fa3: A.Backend, ref: A.Backend, name: str) -> None:
    """FA3's softmax_lse with sinks already holds the sink term, once, also when the KV is
    split (long decodes): attnsdk copies it as it is (``_fa3_kernels._copy_lse``)."""
    specs = [
        BatchSpec.decode(6, 300, seed=2),
        BatchSpec.mixed(seed=2),
        BatchSpec.long_context(batch_size=2, context=6000),
    ]
    for i, spec in enumerate(specs):
        batch = _build(name, spec, i)
        # FA3 reads sinks as bf16: values it can hold exactly, so only the lse is compared.
        sinks = torch.linspace(-2.0, 7.0, batch.layer.num_heads, device=DEV).bfloat16().float()
        strong = dataclasses.replace(batch, sinks=sinks)
        _, lse, _ = strong.run_with_lse(fa3)
        _, want, _ = strong.run_with_lse(ref)
        keys_only = dataclasses.replace(
            strong, layer=dataclasses.replace(batch.layer, has_sinks=False), sinks=None
        )
        _, without, _ = keys_only.run_with_lse(ref)
        err = float((lse - want).abs().max())
        err_keys = float((lse - without).abs().max())
        assert err < 5e-3, (
            f"{spec.name}: FA3's lse differs from the reference's by {err:.3g}; from the "
            f"keys-only lse by {err_keys:.3g} (near 0: this build leaves the sink out, and "
            "_copy_lse must add it with torch.logaddexp(lse, sinks))"
        )


def test_lse_matches_reference(fa3: A.Backend, ref: A.Backend) -> None:
    """Natural log, through the direct op's (Hq, T) softmax_lse, for mixed batches with
    padding rows, fp8 KV (q rounded to fp8 on both sides) and a window."""
    for name in ("gqa-d128-bf16-p16", "window-causal", "noncausal", "fp8-tensor-scale"):
        spec = BatchSpec.mixed(batch_size=5, seed=4).with_padding(rows=2)
        batch = _build(name, spec, 4)
        if batch.cache.layout.is_quantized:
            batch_ref = dataclasses.replace(batch, q=batch.q.to(FP8).to(batch.q.dtype))
            tol = 6e-2
        else:
            batch_ref, tol = batch, 5e-3
        out, lse, _ = batch.run_with_lse(fa3)
        plain, _ = batch.run(fa3)
        _, want, _ = batch_ref.run_with_lse(ref)
        assert torch.equal(out, plain), name
        assert_close_to_reference(lse, want, atol=tol, rtol=1e-3)


def test_no_device_sync(fa3: A.Backend) -> None:
    batch = _build("fp8-tensor-scale", BatchSpec.mixed(seed=6), 6)
    cache = batch.fresh_cache()
    kw = {"k_scale": batch.k_scale, "v_scale": batch.v_scale}
    fa3.forward(batch.q, batch.k, batch.v, cache, fa3.plan(batch.metadata), batch.layer, **kw)
    state = fa3.graph_state(8, 1024, 32, page_size=16, device=DEV)
    captured = fa3.plan_for_capture(state, 8, 1024)
    lse = torch.empty(batch.q.shape[0], batch.layer.num_heads, device=DEV)
    with forbid_device_sync():
        plan = fa3.plan(batch.metadata)
        fa3.forward(batch.q, batch.k, batch.v, cache, plan, batch.layer, **kw)
        fa3.forward(batch.q, None, None, cache, plan, batch.layer, lse=lse, **kw)
        fa3.plan_for_replay(captured, batch.metadata)
    torch.cuda.synchronize()


def test_bad_inputs_raise_typed_errors(fa3: A.Backend) -> None:
    batch = _build("gqa-d128-bf16-p16", BatchSpec.decode(seed=1), 1)
    plan = fa3.plan(batch.metadata)
    cache = batch.fresh_cache()
    with pytest.raises(A.InvalidInputError, match=r"q\.dtype"):
        fa3.forward(batch.q.half(), batch.k, batch.v, cache, plan, batch.layer)
    with pytest.raises(A.InvalidInputError, match=r"q\.device"):
        fa3.forward(batch.q.cpu(), batch.k, batch.v, cache, plan, batch.layer)
    with pytest.raises(A.InvalidInputError, match=r"k\.shape"):
        fa3.forward(batch.q, batch.k[:, :1], batch.v, cache, plan, batch.layer)
    sinks = torch.zeros(batch.layer.num_heads, device=DEV)
    with pytest.raises(A.InvalidInputError, match="sinks"):
        fa3.forward(batch.q, batch.k, batch.v, cache, plan, batch.layer, sinks=sinks)
    layer = dataclasses.replace(batch.layer, head_dim=128, v_head_dim=64)
    layout = A.KVCacheLayout(2, 128, 16, v_head_dim=64)
    assert any(r.field == "v_head_dim" for r in fa3.unsupported_reasons(layer, layout, DEV))
    fp16_fp8 = A.KVCacheLayout(2, 128, 16, dtype=torch.float16, kv_dtype=FP8)
    assert any(r.field == "dtype" for r in fa3.unsupported_reasons(batch.layer, fp16_fp8, DEV))
    e5m2 = A.KVCacheLayout(2, 128, 16, kv_dtype=torch.float8_e5m2)
    bad = make_batch(BatchSpec.decode(seed=1), batch.layer, e5m2, device=DEV)
    with pytest.raises(A.UnsupportedConfigError, match="kv_dtype"):
        bad.run(fa3)
    state = fa3.graph_state(2, 2, 4, page_size=16, device=DEV)
    captured = fa3.plan_for_capture(state, 2, 2)
    with pytest.raises(A.InvalidMetadataError):
        fa3.plan_for_replay(captured, _build("gqa-d128-bf16-p16", BatchSpec.decode(5), 0).metadata)
    with pytest.raises(A.InvalidInputError, match="plan"):
        fa3.plan_for_replay(plan, batch.metadata)

"""The vLLM drop-in backend on fa3 against the reference backend (H200 / sm90 only).

The CPU suite (tests/adapters/test_vllm_*.py) checks the adapter against a float64 oracle; here
the same cases (vLLM's own batch shapes × vLLM's physical KV layouts, padding, windows, sinks, fp8,
encoder-only) run on fa3 and on the reference backend from copies of the same step: outputs
must agree within the dtype's tolerance and vLLM's cache tensors must hold the same bytes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from attnsdk import KVCacheLayout, LayerSpec, UnsupportedConfigError, explain
from attnsdk.adapters.vllm import AttnSDKAttentionBackend
from attnsdk.adapters.vllm.testing import (
    PHYSICAL_LAYOUTS,
    VLLM_BATCH_SPECS,
    VLLMMockBatch,
    mock_vllm_batch,
)
from attnsdk.testing import BatchSpec, assert_close_to_reference

pytestmark = [pytest.mark.gpu, pytest.mark.sm90, pytest.mark.fa3]

DEV = "cuda"
HQ, HKV, D = 8, 2, 128
LAYOUTS = list(PHYSICAL_LAYOUTS)


def fa3_or_skip(dtype: torch.dtype, kv_dtype: torch.dtype | None = None, **layer: Any) -> None:
    """Skip, with fa3's own reasons, the combinations its capabilities exclude."""
    spec = LayerSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, **layer)
    layout = KVCacheLayout(HKV, D, 16, dtype, kv_dtype=kv_dtype)
    reasons = explain("fa3", spec, layout, DEV)["fa3"]
    if reasons:
        pytest.skip("; ".join(str(r) for r in reasons))


def run(
    batch: VLLMMockBatch,
    backend: str,
    *,
    window: int | None = None,
    softcap: float | None = None,
    attn_type: str = "decoder",
    kv_cache_dtype: str = "auto",
    split_update: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer through the drop-in classes on a copy of the step: (real output rows, cache)."""
    kv_cache = torch.empty(0, device=DEV) if attn_type == "encoder_only" else batch.kv_cache.clone()
    cls = type(
        f"{backend}VLLMBackend",
        (AttnSDKAttentionBackend,),
        {
            "attnsdk_backend": backend,
            "forward_includes_kv_cache_update": not split_update,
        },
    )
    builder = cls.get_builder_cls()(None, ["layers.0.attn"], None, torch.device(DEV))
    meta = builder.build(0, batch.common_attn_metadata)
    impl = cls.get_impl_cls()(
        HQ,
        D,
        D**-0.5,
        HKV,
        None,
        window,
        kv_cache_dtype,
        softcap,
        attn_type,
        None,
        sinks=batch.sinks,
    )
    rows = batch.query.shape[0]
    output = torch.full((rows, HQ * D), math.nan, dtype=batch.query.dtype, device=DEV)
    q, k, v = batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)
    if split_update:
        impl.do_kv_cache_update(
            batch.layer, k, v, kv_cache, batch.common_attn_metadata.slot_mapping
        )
    impl.forward(batch.layer, q, k, v, kv_cache, meta, output=output)
    torch.cuda.synchronize()
    real = batch.common_attn_metadata.query_start_loc_cpu[-1]
    return output[:real].view(-1, HQ, D), kv_cache


def compare(batch: VLLMMockBatch, *, kv_cache_dtype: str = "auto", **kwargs: Any) -> None:
    out, cache = run(batch, "fa3", kv_cache_dtype=kv_cache_dtype, **kwargs)
    ref, ref_cache = run(batch, "reference", kv_cache_dtype=kv_cache_dtype, **kwargs)
    fp8 = kv_cache_dtype != "auto"
    keep = ~torch.tensor(
        [p for p, q in zip(batch.spec.padded, batch.spec.query_lens) for _ in range(q)],
        dtype=torch.bool,
        device=DEV,
    )
    assert_close_to_reference(out[keep], ref[keep], kv_dtype=torch.float8_e4m3fn if fp8 else None)
    assert bool(torch.isfinite(out).all()), "padding rows must not produce NaN"
    if fp8:  # one fp8 step apart at most (the store may scale by 1/s instead of dividing by s)
        got = cache.view(torch.float8_e4m3fn if "e5m2" not in kv_cache_dtype else torch.float8_e5m2)
        want = ref_cache.view(got.dtype)
        torch.testing.assert_close(got.float(), want.float(), rtol=0.13, atol=1e-2)
    else:
        assert torch.equal(cache, ref_cache), "fa3 and reference wrote different cache bytes"


def batch_for(spec: BatchSpec, physical: str, dtype: torch.dtype, **kw: Any) -> VLLMMockBatch:
    return mock_vllm_batch(
        spec,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        physical=physical,
        dtype=dtype,
        device=DEV,
        **kw,
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(VLLM_BATCH_SPECS))
def test_vllm_batch_shapes(name: str, layout: str) -> None:
    causal = "encoder" not in name
    fa3_or_skip(torch.bfloat16, causal=causal)
    compare(batch_for(VLLM_BATCH_SPECS[name], layout, torch.bfloat16, causal=causal, seed=7))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp16(layout: str) -> None:
    fa3_or_skip(torch.float16)
    compare(batch_for(VLLM_BATCH_SPECS["mixed_medium"], layout, torch.float16))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_graph_padding(layout: str) -> None:
    fa3_or_skip(torch.bfloat16)
    spec = BatchSpec.mixed(batch_size=5, seed=2).with_padding(rows=2)
    compare(batch_for(spec, layout, torch.bfloat16, pad_requests=3, pad_tokens=5, seed=4))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sliding_window_and_sinks(layout: str) -> None:
    fa3_or_skip(torch.bfloat16, sliding_window=64, has_sinks=True)
    batch = batch_for(VLLM_BATCH_SPECS["mixed_medium"], layout, torch.bfloat16, sinks=True)
    compare(batch, window=64)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_softcap_matches_reference_or_is_refused(layout: str) -> None:
    """Softcap is a build option of FA3: served exactly when fa3 declares it, else refused."""
    spec = LayerSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, softcap=30.0)
    reasons = explain("fa3", spec, KVCacheLayout(HKV, D, 16, torch.bfloat16), DEV)["fa3"]
    batch = batch_for(VLLM_BATCH_SPECS["mixed_medium"], layout, torch.bfloat16)
    if not reasons:
        compare(batch, softcap=30.0)
        return
    assert [r.field for r in reasons] == ["softcap"]
    with pytest.raises(UnsupportedConfigError, match="softcap"):
        run(batch, "fa3", softcap=30.0)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp8_kv_cache(layout: str, kv_cache_dtype: str) -> None:
    fa3_or_skip(torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    batch = batch_for(
        VLLM_BATCH_SPECS["mixed_small"], layout, torch.bfloat16, kv_cache_dtype=kv_cache_dtype
    )
    compare(batch, kv_cache_dtype=kv_cache_dtype)


def test_encoder_only_layer() -> None:
    """ENCODER_ONLY: no cache, bidirectional, ``forward_ragged`` over this step's k/v."""
    fa3_or_skip(torch.bfloat16, causal=False, sliding_window=32)
    spec = VLLM_BATCH_SPECS["small_encoder_prefill"]
    batch = batch_for(spec, "LBNHC", torch.bfloat16, causal=False, pad_requests=1)
    for window in (None, 32):
        out, _ = run(batch, "fa3", attn_type="encoder_only", window=window)
        ref, _ = run(batch, "reference", attn_type="encoder_only", window=window)
        assert_close_to_reference(out, ref)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_split_kv_update(layout: str) -> None:
    fa3_or_skip(torch.bfloat16)
    batch = batch_for(BatchSpec.chunked_prefill(seed=2), layout, torch.bfloat16, pad_tokens=3)
    compare(batch, split_update=True)

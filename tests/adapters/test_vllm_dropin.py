"""The drop-in vLLM classes end to end on the reference backend, against a float64 oracle.

The oracle below is written from DESIGN §2 and vLLM's layout docs, independently of attnsdk: it
decodes vLLM's raw cache tensor itself, applies the step's writes slot by slot, rebuilds each
request's keys densely from its block-table row, and computes attention with explicit masks.
Both the layer output and the whole cache tensor are checked.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from attnsdk import AttentionConfig, UnsupportedConfigError
from attnsdk.adapters.vllm import AttnSDKAttentionBackend, VLLMKVLayout
from attnsdk.adapters.vllm.testing import (
    PHYSICAL_LAYOUTS,
    VLLM_BATCH_SPECS,
    VLLMMockBatch,
    mock_vllm_batch,
)
from attnsdk.testing import BatchSpec

HQ, HKV, D = 4, 2, 32
LAYOUTS = list(PHYSICAL_LAYOUTS)
"""vLLM 0.29+ hands every layer a [N, Hkv, P, 2D] view over one of these physical layouts."""
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# ---- oracle -------------------------------------------------------------------------------


def decode_cache(batch: VLLMMockBatch, raw: torch.Tensor, kv_cache_dtype: str) -> tuple[Any, Any]:
    """(K, V) as float64 [N, P, Hkv, D] from vLLM's raw tensor, by the documented layouts."""
    t = raw.view(FP8[kv_cache_dtype]) if raw.dtype == torch.uint8 else raw
    if batch.layout is VLLMKVLayout.KV_BLOCKS:
        k, v = t[0], t[1]
    elif batch.layout is VLLMKVLayout.BLOCKS_KV:
        k, v = t[:, 0], t[:, 1]
    else:
        per_token = t.permute(0, 2, 1, 3)  # [N, Hkv, P, 2D] -> [N, P, Hkv, 2D]
        k, v = per_token[..., :D], per_token[..., D:]
    k, v = k.double(), v.double()
    if kv_cache_dtype in FP8:
        k, v = k * float(batch.layer._k_scale), v * float(batch.layer._v_scale)
    return k, v


def stored(x: torch.Tensor, kv_cache_dtype: str, scale: torch.Tensor) -> torch.Tensor:
    """What a cache of this dtype holds for x, read back as float64 (fp8 stores x / scale)."""
    if kv_cache_dtype not in FP8:
        return x.double()
    return (x.float() / scale.float()).to(FP8[kv_cache_dtype]).double() * float(scale)


def expected_cache(
    batch: VLLMMockBatch, before: torch.Tensor, kv_cache_dtype: str
) -> tuple[Any, Any]:
    k, v = decode_cache(batch, before, kv_cache_dtype)
    cm = batch.common_attn_metadata
    p = batch.block_size
    for t, slot in enumerate(cm.slot_mapping[: cm.num_actual_tokens].tolist()):
        if slot >= 0:
            page, offset = divmod(slot, p)
            k[page, offset] = stored(batch.key[t], kv_cache_dtype, batch.layer._k_scale)
            v[page, offset] = stored(batch.value[t], kv_cache_dtype, batch.layer._v_scale)
    return k, v


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q (n, Hq, D) at the last n of L positions; k/v (L, Hkv, D). float64 (n, Hq, D)."""
    n, length = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(length - n, length)[:, None]
    k_pos = torch.arange(length)[None, :]
    visible = torch.ones(n, length, dtype=torch.bool)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= (
            (q_pos - k_pos).abs() <= window - 1 if not causal else k_pos >= q_pos - window + 1
        )
    scores = scores.masked_fill(~visible, -math.inf)
    if sinks is not None:
        sink_col = sinks.double()[:, None, None].expand(-1, n, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :length]
    return torch.einsum("hqk,khd->qhd", probs, v)


def oracle_outputs(
    batch: VLLMMockBatch,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    **semantics: Any,
) -> dict[int, torch.Tensor]:
    """Expected output rows of each real request, keyed by its first query row."""
    spec, p = batch.spec, batch.block_size
    qsl = batch.common_attn_metadata.query_start_loc_cpu.tolist()
    expected = {}
    for b in range(spec.num_seqs):
        q0, q1, s = qsl[b], qsl[b + 1], spec.seq_lens[b]
        if q1 == q0 or spec.padded[b]:
            continue
        if k_cache is None or v_cache is None:  # encoder attention: this step's k/v only
            keys, values = batch.key[q0:q1].double(), batch.value[q0:q1].double()
        else:
            pos = torch.arange(s)
            pages = batch.block_table[b].long()[pos // p]
            keys, values = k_cache[pages, pos % p], v_cache[pages, pos % p]
        expected[q0] = attention(batch.query[q0:q1], keys, values, **semantics)
    return expected


# ---- running the drop-in classes ----------------------------------------------------------


def run_dropin(
    batch: VLLMMockBatch,
    *,
    window: int | None = None,
    softcap: float | None = None,
    attn_type: str = "decoder",
    kv_cache_dtype: str = "auto",
    flat: bool = True,
    split_update: bool = False,
    kv_cache: torch.Tensor | None = None,
    backend: str | AttentionConfig = "reference",
) -> torch.Tensor:
    """Build, then forward one layer the way vLLM's ``Attention`` layer does."""
    backend_cls = type(
        "ReferenceVLLMBackend",
        (AttnSDKAttentionBackend,),
        {
            "attnsdk_backend": backend,
            "forward_includes_kv_cache_update": not split_update,
        },
    )
    builder = backend_cls.get_builder_cls()(None, ["layers.0.attn"], None, torch.device("cpu"))
    attn_metadata = builder.build(0, batch.common_attn_metadata)
    impl = backend_cls.get_impl_cls()(
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
    output = torch.full(
        (rows, HQ * D) if flat else (rows, HQ, D), math.nan, dtype=batch.query.dtype
    )
    q, k, v = batch.query, batch.key, batch.value
    if flat:
        q, k, v = q.flatten(1), k.flatten(1), v.flatten(1)
    cache = batch.kv_cache if kv_cache is None else kv_cache
    if split_update:
        impl.do_kv_cache_update(batch.layer, k, v, cache, batch.common_attn_metadata.slot_mapping)
    returned = impl.forward(batch.layer, q, k, v, cache, attn_metadata, output=output)
    assert returned is output
    return output.view(rows, HQ, D)


def check(
    batch: VLLMMockBatch,
    *,
    kv_cache_dtype: str = "auto",
    atol: float = 2e-5,
    **kwargs: Any,
) -> None:
    """Run the drop-in layer and compare output and cache with the oracle."""
    before = batch.kv_cache.clone()
    semantics = {
        "scale": D**-0.5,
        "causal": batch.common_attn_metadata.causal and kwargs.get("attn_type") != "encoder_only",
        "window": kwargs.get("window"),
        "softcap": kwargs.get("softcap"),
        "sinks": batch.sinks,
    }
    out = run_dropin(batch, kv_cache_dtype=kv_cache_dtype, **kwargs)
    k_exp, v_exp = expected_cache(batch, before, kv_cache_dtype)
    k_got, v_got = decode_cache(batch, batch.kv_cache, kv_cache_dtype)
    assert torch.equal(k_got, k_exp), "K cache contents differ"
    assert torch.equal(v_got, v_exp), "V cache contents differ"
    qsl = batch.common_attn_metadata.query_start_loc_cpu.tolist()
    for q0, ref in oracle_outputs(batch, k_exp, v_exp, **semantics).items():
        got = out[q0 : q0 + ref.shape[0]].double()
        torch.testing.assert_close(got, ref, atol=atol, rtol=atol, msg=f"rows from {q0}")
    real = out[: qsl[-1]]
    assert bool(torch.isfinite(real).all()), "padding rows must not produce NaN"


# ---- the cases ----------------------------------------------------------------------------


@pytest.mark.parametrize("physical", LAYOUTS)
@pytest.mark.parametrize("name", sorted(VLLM_BATCH_SPECS))
def test_vllm_batch_shapes(name: str, physical: str) -> None:
    spec = VLLM_BATCH_SPECS[name]
    causal = "encoder" not in name
    batch = mock_vllm_batch(
        spec, num_heads=HQ, num_kv_heads=HKV, head_size=D, physical=physical, causal=causal, seed=7
    )
    check(batch)


@pytest.mark.parametrize("physical", LAYOUTS)
def test_cuda_graph_padding(physical: str) -> None:
    """Padded requests (query 0, seq 0, null block) and padded token rows (slot -1)."""
    spec = BatchSpec.mixed(batch_size=5, seed=2).with_padding(rows=2)
    batch = mock_vllm_batch(
        spec,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        physical=physical,
        pad_requests=3,
        pad_tokens=5,
        seed=4,
    )
    check(batch)  # the null block is part of the cache comparison: it must stay untouched


@pytest.mark.parametrize("physical", LAYOUTS)
def test_encoder_only_dropin(physical: str) -> None:
    """ENCODER_ONLY layers attend this step's k/v bidirectionally; vLLM gives them no cache."""
    spec = VLLM_BATCH_SPECS["small_encoder_prefill"]
    batch = mock_vllm_batch(
        spec,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        physical=physical,
        causal=False,
        pad_requests=1,
        pad_tokens=3,
        seed=5,
    )
    out = run_dropin(batch, attn_type="encoder_only", kv_cache=torch.empty(0))
    semantics = {"scale": D**-0.5, "causal": False, "window": None, "softcap": None, "sinks": None}
    for q0, ref in oracle_outputs(batch, None, None, **semantics).items():
        torch.testing.assert_close(out[q0 : q0 + ref.shape[0]].double(), ref, atol=2e-5, rtol=2e-5)


def test_encoder_only_dropin_in_debug_mode() -> None:
    """Debug mode accepts the drop-in's encoder-only step (ragged attention over the step's
    own k/v, validated without a cache) and serves it exactly like the reference backend."""
    spec = VLLM_BATCH_SPECS["small_encoder_prefill"]
    batch = mock_vllm_batch(
        spec, num_heads=HQ, num_kv_heads=HKV, head_size=D, causal=False, pad_requests=1, seed=5
    )
    debug = AttentionConfig(backend="reference", debug=True)
    run = {"attn_type": "encoder_only", "kv_cache": torch.empty(0)}
    got = run_dropin(batch, backend=debug, **run)
    want = run_dropin(batch, **run)
    assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(causal: bool) -> None:
    spec = BatchSpec.mixed(batch_size=6, seed=1) if causal else VLLM_BATCH_SPECS["small_prefill"]
    batch = mock_vllm_batch(
        spec,
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        causal=causal,
        seed=8,
        physical="BLNHC",
    )
    check(batch, window=9)


def test_encoder_only_window_is_symmetric() -> None:
    batch = mock_vllm_batch(
        BatchSpec((40, 17), (40, 17)), num_heads=HQ, num_kv_heads=HKV, head_size=D, causal=False
    )
    out = run_dropin(batch, attn_type="encoder_only", window=5, kv_cache=torch.empty(0))
    semantics = {"scale": D**-0.5, "causal": False, "window": 5, "softcap": None, "sinks": None}
    for q0, ref in oracle_outputs(batch, None, None, **semantics).items():
        torch.testing.assert_close(out[q0 : q0 + ref.shape[0]].double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("physical", LAYOUTS)
def test_sinks_and_softcap(physical: str) -> None:
    batch = mock_vllm_batch(
        VLLM_BATCH_SPECS["mixed_small"],
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        physical=physical,
        sinks=True,
        seed=9,
    )
    check(batch, softcap=3.0, window=20)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("physical", LAYOUTS)
def test_fp8_kv_cache(physical: str, kv_cache_dtype: str) -> None:
    """uint8 storage and the layer's _k_scale / _v_scale, as vLLM sets them up."""
    batch = mock_vllm_batch(
        BatchSpec.mixed(batch_size=4, seed=3),
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        physical=physical,
        kv_cache_dtype=kv_cache_dtype,
        dtype=torch.bfloat16,
        seed=10,
    )
    assert batch.kv_cache.dtype == torch.uint8
    check(batch, kv_cache_dtype=kv_cache_dtype, atol=2e-2)


def test_bf16_three_dim_output() -> None:
    batch = mock_vllm_batch(
        VLLM_BATCH_SPECS["mixed_small"],
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        dtype=torch.bfloat16,
        seed=11,
    )
    check(batch, flat=False, atol=2e-2)


@pytest.mark.parametrize("physical", LAYOUTS)
def test_split_kv_update(physical: str) -> None:
    """forward_includes_kv_cache_update=False: vLLM calls do_kv_cache_update, then forward."""
    batch = mock_vllm_batch(
        BatchSpec.chunked_prefill(seed=2).with_padding(),
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        physical=physical,
        pad_tokens=2,
        seed=12,
    )
    check(batch, split_update=True)


def test_kv_sharing_layer_does_not_write() -> None:
    batch = mock_vllm_batch(
        VLLM_BATCH_SPECS["small_prefill"], num_heads=HQ, num_kv_heads=HKV, head_size=D
    )
    backend_cls = type("Ref", (AttnSDKAttentionBackend,), {"attnsdk_backend": "reference"})
    builder = backend_cls.get_builder_cls()(None, ["l"], None, torch.device("cpu"))
    impl = backend_cls.get_impl_cls()(HQ, D, D**-0.5, HKV, kv_sharing_target_layer_name="l0")
    before = batch.kv_cache.clone()
    output = torch.empty(batch.query.shape[0], HQ * D)
    impl.do_kv_cache_update(
        batch.layer, batch.key, batch.value, batch.kv_cache, batch.common_attn_metadata.slot_mapping
    )
    impl.forward(
        batch.layer,
        batch.query,
        batch.key,
        batch.value,
        batch.kv_cache,
        builder.build(0, batch.common_attn_metadata),
        output,
    )
    assert torch.equal(batch.kv_cache, before)
    assert bool(torch.isfinite(output).all())


def test_step_of_only_padding() -> None:
    """A captured-size step with no real request: nothing is written, no row is computed."""
    batch = mock_vllm_batch(
        BatchSpec((), ()),
        num_heads=HQ,
        num_kv_heads=HKV,
        head_size=D,
        pad_requests=3,
        pad_tokens=4,
    )
    before = batch.kv_cache.clone()
    out = run_dropin(batch)
    assert torch.equal(batch.kv_cache, before)
    assert bool(out.isnan().all())  # the poisoned padding rows are left as they were


def _encoder_group(backend: Any, names: list[str], spec_cls: Any = None) -> tuple[Any, Any]:
    """An encoder-only KV-cache group as vLLM builds it: the layers' impls, then the group's
    builder (``EncoderOnlyAttentionSpec`` unless ``spec_cls`` names another)."""
    from attnsdk.adapters.vllm.testing import EncoderOnlyAttentionSpec, mock_vllm_config

    cls = type("EncoderVLLM", (AttnSDKAttentionBackend,), {"attnsdk_backend": backend})
    make = cls.get_impl_cls()
    impls = {name: make(HQ, D, D**-0.5, HKV, attn_type="encoder_only") for name in names}
    spec = (spec_cls or EncoderOnlyAttentionSpec)(
        block_size=16, num_kv_heads=HKV, head_size=D, dtype=torch.float32
    )
    builder = cls.get_builder_cls()(spec, names, mock_vllm_config(impls), torch.device("cpu"))
    return builder, impls


def _count_plans(monkeypatch: pytest.MonkeyPatch, backend: Any) -> list[Any]:
    planned: list[Any] = []
    real = backend.plan
    monkeypatch.setattr(backend, "plan", lambda meta: planned.append(meta) or real(meta))
    return planned


@pytest.mark.parametrize("builder_knows", [True, False], ids=["encoder-group", "other-group"])
def test_encoder_layers_run_ragged_planned_once_per_step(
    monkeypatch: pytest.MonkeyPatch, builder_knows: bool
) -> None:
    """Encoder-only layers run ``forward_ragged`` over the step's own k/v, planned once per
    step: by the builder of vLLM's encoder-only group, else by the step's first encoder layer
    (a builder that could not tell), and shared by every layer."""
    from attnsdk import create_backend
    from attnsdk.adapters.vllm.testing import FullAttentionSpec

    backend = create_backend("reference")
    names = ["model.layers.0.attn", "model.layers.1.attn"]
    spec_cls = None if builder_knows else FullAttentionSpec
    builder, impls = _encoder_group(backend, names, spec_cls)
    if not builder_knows:  # the layers are known, but the spec says a decoder group
        builder.encoder = False
    assert backend.prepared == []  # no cache: checked for ragged attention, nothing to prepare
    batch = mock_vllm_batch(
        VLLM_BATCH_SPECS["small_encoder_prefill"], num_heads=HQ, num_kv_heads=HKV, head_size=D,
        causal=False, pad_requests=1, pad_tokens=3, seed=5,
    )  # fmt: skip
    planned = _count_plans(monkeypatch, backend)
    metadata = builder.build(0, batch.common_attn_metadata)
    semantics = {"scale": D**-0.5, "causal": False, "window": None, "softcap": None, "sinks": None}
    forward_ragged = backend.forward_ragged
    ragged_calls: list[Any] = []
    monkeypatch.setattr(
        backend,
        "forward_ragged",
        lambda *a, **k: ragged_calls.append(a[3]) or forward_ragged(*a, **k),
    )
    for impl in impls.values():
        output = torch.full((batch.query.shape[0], HQ * D), math.nan)
        q, k, v = (x.flatten(1) for x in (batch.query, batch.key, batch.value))
        impl.forward(batch.layer, q, k, v, torch.empty(0), metadata, output=output)
        out = output.view(-1, HQ, D)
        for q0, ref in oracle_outputs(batch, None, None, **semantics).items():
            got = out[q0 : q0 + ref.shape[0]].double()
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    # One ragged step (no page table: the keys come with the call), whoever planned it.
    ragged = [meta for meta in planned if meta.key_start_loc is not None]
    assert len(ragged) == 1
    assert ragged[0].page_table.shape[1] == 0
    assert len(planned) == (1 if builder_knows else 2)  # else the builder's paged plan too
    assert ragged_calls == [metadata.ragged] * len(impls)


def test_a_backend_without_ragged_attention_is_refused_for_encoder_layers_at_start_up() -> None:
    with pytest.raises(UnsupportedConfigError) as info:
        _encoder_group("flex", ["model.layers.0.attn", "model.layers.1.attn"])
    fields = [r.field for r in info.value.reasons]
    assert "model.layers.0.attn, model.layers.1.attn.ragged" in fields

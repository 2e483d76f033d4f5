"""The model is declared once: each KV-cache group's builder prepares its layers at start-up.

vLLM builds the model's ``Attention`` layers (each constructs its impl), then one metadata
builder per KV-cache group (``init_attn_backend`` / ``AttentionGroup.create_metadata_builders``),
then the KV cache, then the first step. Through vLLM's own code:

- after start-up and before any step, the attnsdk backend has prepared every distinct layer
  shape of the model (``Backend.prepared``), with each group's KV layout; the steps add
  nothing (a non-causal step adds its own variant);
- a model the backend cannot serve (a soft cap, which vLLM's selection does not ask about) is
  refused when its builders are made, every reason naming vLLM's layers;
- encoder-only layers (``EncoderOnlyAttention``, no KV cache) on a backend without ragged
  attention (flex) are refused there too, with its reason; on the reference backend their
  builder plans each step once, as ragged attention over the step's own K/V;
- the MLA drop-in's builder declares its MLA layer the same way.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from tests.v1.attention.utils import create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention import Attention, EncoderOnlyAttention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec, FullAttentionSpec
from vllm.v1.worker.utils import AttentionGroup
from vllm_engine import attnsdk_ref
from vllm_engine.attnsdk_ref import FLEX, NO_SOFTCAP, REF_FRESH
from vllm_engine.mini_engine import BS, CPU, HKV, LAYERS, D, H, MiniEngine, name

from attnsdk import KVCacheLayout, LayerSpec, UnsupportedConfigError
from attnsdk.adapters.vllm.testing import mock_common_attn_metadata
from attnsdk.testing import BatchSpec


def model_shapes(engine: MiniEngine, dtype: torch.dtype) -> list[tuple[LayerSpec, KVCacheLayout]]:
    """Every distinct (spec, layout) of the mini engine's layers: their impls' causal specs over
    the cache the impls read (block size BS, the model dtype)."""
    layout = KVCacheLayout(num_kv_heads=HKV, head_dim=D, page_size=BS, dtype=dtype, kv_dtype=dtype)
    specs = [engine.layers[n].impl.layer_spec for n in LAYERS]
    return [(spec, layout) for spec in dict.fromkeys(specs)]


@pytest.mark.parametrize("hybrid", [True, False], ids=["two-groups", "one-group"])
def test_every_layer_shape_is_prepared_at_start_up(use_custom_backend, hybrid: bool) -> None:
    backend = attnsdk_ref.fresh()
    use_custom_backend(REF_FRESH)
    engine = MiniEngine("LBNHC", "auto", torch.float32, hybrid=hybrid)
    assert engine.backend_cls is attnsdk_ref.RefFresh
    want = model_shapes(engine, torch.float32)
    assert len(want) == 4  # full, window, sinks, window + sinks (the KV-sharing layer = full)
    assert sorted(map(str, backend.prepared)) == sorted(map(str, want))
    a, b = engine.add(20), engine.add(7)
    engine.step([(a, 20), (b, 7)])
    engine.step([(a, 1), (b, 1)], pad_requests=1, pad_tokens=1)
    assert sorted(map(str, backend.prepared)) == sorted(map(str, want))


def test_fp8_caches_are_declared_with_their_storage_dtype(use_custom_backend) -> None:
    backend = attnsdk_ref.fresh()
    use_custom_backend(REF_FRESH)
    engine = MiniEngine("BLNHC", "fp8", torch.bfloat16)
    layouts = {layout for _, layout in backend.prepared}
    assert layouts == {
        KVCacheLayout(HKV, D, BS, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    }
    before = list(backend.prepared)
    c = engine.add(9)
    engine.step([(c, 9)])
    assert backend.prepared == before


def group_builder(vllm_config, layers: dict[str, Attention], spec) -> AttentionGroup:
    """vLLM's worker making a KV-cache group's builder (``AttentionGroup``)."""
    backend = next(iter(layers.values())).get_attn_backend()
    group = AttentionGroup(backend, list(layers), spec, 0)
    group.create_metadata_builders(vllm_config, CPU)
    return group


def test_a_model_the_backend_cannot_serve_is_refused_at_start_up_naming_its_layers(
    use_custom_backend,
) -> None:
    backend = attnsdk_ref.no_softcap()
    use_custom_backend(NO_SOFTCAP)
    vc = create_vllm_config(block_size=BS, max_model_len=128, dtype=torch.float32)
    vc.attention_config.backend = AttentionBackendEnum.CUSTOM
    caps = {name(0): None, name(1): 30.0, name(2): None, name(3): 30.0}
    with set_current_vllm_config(vc):
        layers = {
            n: Attention(H, D, D**-0.5, HKV, cache_config=vc.cache_config, prefix=n,
                         logits_soft_cap=cap)
            for n, cap in caps.items()
        }  # fmt: skip
    # vLLM's selection and the impls let the model through: soft caps are the backend's call.
    assert all(layer.get_attn_backend() is attnsdk_ref.NoSoftcapRef for layer in layers.values())
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    with pytest.raises(UnsupportedConfigError) as info:
        group_builder(vc, layers, spec)
    assert [r.field for r in info.value.reasons] == [f"{name(1)}, {name(3)}.softcap"]
    assert backend.prepared == []


ENCODER = {name(0): {}, name(1): {"window": 6}}


def encoder_layers(vc) -> dict[str, EncoderOnlyAttention]:
    with set_current_vllm_config(vc):
        return {
            n: EncoderOnlyAttention(
                H, D, D**-0.5, num_kv_heads=HKV, cache_config=vc.cache_config, prefix=n,
                per_layer_sliding_window=o.get("window"),
            )
            for n, o in ENCODER.items()
        }  # fmt: skip


def encoder_spec() -> EncoderOnlyAttentionSpec:
    return EncoderOnlyAttentionSpec(
        block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32
    )


def test_encoder_layers_on_a_backend_without_ragged_attention_are_refused_at_start_up(
    use_custom_backend,
) -> None:
    use_custom_backend(FLEX)
    vc = create_vllm_config(block_size=BS, max_model_len=128, dtype=torch.float32)
    vc.attention_config.backend = AttentionBackendEnum.CUSTOM
    layers = encoder_layers(vc)
    # vLLM selected flex for them (wrapped for encoder-only attention).
    assert all(
        issubclass(layer.get_attn_backend(), attnsdk_ref.FlexRef) for layer in layers.values()
    )
    with pytest.raises(UnsupportedConfigError) as info:
        group_builder(vc, layers, encoder_spec())
    fields = {r.field for r in info.value.reasons}
    assert fields == {f"{name(0)}.ragged", f"{name(1)}.ragged"}
    assert "forward_ragged" in str(info.value)


def test_encoder_steps_are_planned_once_as_ragged_attention(use_custom_backend) -> None:
    backend = attnsdk_ref.fresh()
    use_custom_backend(REF_FRESH)
    vc = create_vllm_config(block_size=BS, max_model_len=128, dtype=torch.float32)
    vc.attention_config.backend = AttentionBackendEnum.CUSTOM
    group = group_builder(vc, encoder_layers(vc), encoder_spec())
    builder = group.get_metadata_builder()
    assert builder.encoder
    assert backend.prepared == []  # no cache: nothing to prepare, checked for ragged attention
    mock = mock_common_attn_metadata(BatchSpec((5, 17), (5, 17)), block_size=BS, causal=False)
    cm = CommonAttentionMetadata(**{f.name: getattr(mock, f.name) for f in fields(mock)})
    planned = []
    plan = backend.plan
    backend.plan = lambda meta: planned.append(meta) or plan(meta)  # type: ignore[method-assign]
    md = builder.build(0, cm)
    assert md.ragged is md.plan
    assert len(planned) == 1
    assert md.plan.metadata.page_table.shape == (2, 0)  # the keys come with each call
    assert md.plan.metadata.key_start_loc.tolist() == [0, 5, 22]


def test_the_mla_builder_declares_its_layer_at_start_up() -> None:
    from vllm_engine.test_vllm_mla import BS as MLA_BS
    from vllm_engine.test_vllm_mla import DTYPE, RANK, ROPE, Model

    model = Model()
    impl = model.layer.impl
    layout = KVCacheLayout.for_mla(MLA_BS, kv_lora_rank=RANK, rope_dim=ROPE, dtype=DTYPE)
    assert (impl.spec, layout) in model.builder.backend.prepared

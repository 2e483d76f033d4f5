"""attnsdk's vLLM mocks (``attnsdk.adapters.vllm.testing``) cannot drift from the real vLLM.

The unit tests (tests/adapters/test_vllm_*.py) run without vLLM on the mocks; this module proves
each mock is what this vLLM release really hands a backend:

* ``MockCommonAttentionMetadata``: every field is a field of vLLM's ``CommonAttentionMetadata``
  with the same type and default, it has every field vLLM requires (a mock converts into a real
  instance field for field), both are mutable dataclasses, and the adapter reads both alike.
* ``VLLM_BATCH_SPECS`` is the harness's ``BATCH_SPECS`` (vLLM's BatchSpec is
  (seq_lens, query_lens), attnsdk's (query_lens, seq_lens)).
* ``PHYSICAL_LAYOUTS`` is vLLM's ``KVCacheLayout`` (names and stride orders).
* ``make_kv_cache(..., physical=X, num_layers=L, layer=i)`` has the shape, strides, storage
  offset and dtype of layer i of a real ``allocate_kv_cache`` allocation (``create_kv_cache_views``)
  in layout X, for bf16 and fp8 (uint8) caches, with K and V where vLLM's logical view has them.
* ``MockAttentionLayer``'s attributes are members of vLLM's ``AttentionLayer`` protocol, with
  the types vLLM's real ``Attention`` layer gives them.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest
import torch
from tests.v1.attention import test_attention_backends as harness
from tests.v1.attention.utils import create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import AttentionLayer, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
    get_kv_quant_mode,
)
from vllm.v1.worker.utils import allocate_kv_cache

from attnsdk.adapters.vllm import VLLMAdapter
from attnsdk.adapters.vllm.testing import (
    PHYSICAL_LAYOUTS,
    VLLM_BATCH_SPECS,
    MockAttentionLayer,
    MockCommonAttentionMetadata,
    make_kv_cache,
    mock_common_attn_metadata,
)
from attnsdk.testing import BatchSpec

NUM_BLOCKS, BLOCK_SIZE, HKV, D = 6, 4, 2, 8


def _hints(cls: type) -> dict[str, object]:
    return typing.get_type_hints(cls)


def test_common_attn_metadata_fields_are_real_fields() -> None:
    real = {f.name: f for f in dataclasses.fields(CommonAttentionMetadata)}
    real_types, mock_types = _hints(CommonAttentionMetadata), _hints(MockCommonAttentionMetadata)
    for field in dataclasses.fields(MockCommonAttentionMetadata):
        assert field.name in real, f"{field.name} is not a CommonAttentionMetadata field"
        assert mock_types[field.name] == real_types[field.name], field.name
        assert field.default == real[field.name].default, field.name
        assert field.default_factory == real[field.name].default_factory, field.name
    required = {n for n, f in real.items() if f.default is f.default_factory is dataclasses.MISSING}
    assert required <= {f.name for f in dataclasses.fields(MockCommonAttentionMetadata)}
    # Both mutable: vLLM's runners set fields on the instance (EncoderOnlyAttention: causal).
    assert not CommonAttentionMetadata.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert not MockCommonAttentionMetadata.__dataclass_params__.frozen  # type: ignore[attr-defined]


@pytest.mark.parametrize("pad", [0, 2])
def test_mock_converts_to_real_and_reads_the_same(pad: int) -> None:
    spec = BatchSpec((1, 5, 3), (9, 5, 20))
    mock = mock_common_attn_metadata(spec, block_size=4, pad_requests=pad, pad_tokens=pad)
    real = CommonAttentionMetadata(
        **{f.name: getattr(mock, f.name) for f in dataclasses.fields(mock)}
    )
    real.causal = False
    mock.causal = False
    a, b = VLLMAdapter().build_metadata(mock), VLLMAdapter().build_metadata(real)
    for name in ("query_start_loc", "seq_lens", "page_table", "slot_mapping", "seq_lens_cpu"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert VLLMAdapter().causal(real) is False


def test_batch_specs_are_the_harness_specs() -> None:
    assert len(harness.BATCH_SPECS) == 13
    assert set(VLLM_BATCH_SPECS) == set(harness.BATCH_SPECS)
    for name, theirs in harness.BATCH_SPECS.items():
        ours = VLLM_BATCH_SPECS[name]
        assert list(ours.query_lens) == list(theirs.query_lens), name
        assert list(ours.seq_lens) == list(theirs.seq_lens), name


def test_physical_layouts_are_vllm_layouts() -> None:
    assert {m.name: m.value for m in KVCacheLayout} == PHYSICAL_LAYOUTS


def _real_views(layout: KVCacheLayout, num_layers: int, kv_cache_dtype: str) -> list[torch.Tensor]:
    """Each layer's view of one real vLLM allocation (allocate_kv_cache -> create_kv_cache_views)."""
    dtype = torch.uint8 if kv_cache_dtype.startswith("fp8") else torch.bfloat16
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=HKV,
        head_size=D,
        dtype=dtype,
        kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
    )
    names = [f"model.layers.{i}.attn" for i in range(num_layers)]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, NUM_BLOCKS, num_layers, layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * NUM_BLOCKS * num_layers,
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    views = allocate_kv_cache(config, torch.device("cpu"), layout)
    return [views[n] for n in names]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("num_layers", [1, 3])
@pytest.mark.parametrize("physical", list(PHYSICAL_LAYOUTS))
def test_make_kv_cache_is_a_real_layer_view(
    physical: str, num_layers: int, kv_cache_dtype: str
) -> None:
    real = _real_views(KVCacheLayout[physical], num_layers, kv_cache_dtype)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16
    for layer, view in enumerate(real):
        k, v = (
            torch.randn(NUM_BLOCKS, BLOCK_SIZE, HKV, D, generator=gen).to(dtype) for _ in range(2)
        )
        mock = make_kv_cache(k, v, physical=physical, num_layers=num_layers, layer=layer)
        assert mock.dtype == view.dtype
        assert mock.shape == view.shape
        assert mock.stride() == view.stride(), (physical, layer)
        assert mock.storage_offset() == view.storage_offset(), (physical, layer)
        assert mock.untyped_storage().nbytes() == view.untyped_storage().nbytes()
        # K and V sit where vLLM's logical [N, Hkv, P, 2D] view puts them: [..., :D], [..., D:].
        typed = mock.view(dtype) if kv_cache_dtype == "fp8" else mock
        assert torch.equal(typed[..., :D].transpose(1, 2).float(), k.float())
        assert torch.equal(typed[..., D:].transpose(1, 2).float(), v.float())


def test_mock_attention_layer_matches_the_protocol_and_the_real_layer() -> None:
    protocol = _hints(AttentionLayer)
    mock_types = _hints(MockAttentionLayer)
    assert set(mock_types) <= set(protocol), set(mock_types) - set(protocol)
    for name, hint in mock_types.items():
        assert hint == protocol[name], name
    vllm_config = create_vllm_config()
    vllm_config.attention_config.backend = AttentionBackendEnum.CUSTOM
    with set_current_vllm_config(vllm_config):
        real = Attention(4, 64, 0.125, 2, cache_config=vllm_config.cache_config, prefix="l.0")
    for name, hint in mock_types.items():
        assert isinstance(getattr(real, name), hint), name  # type: ignore[arg-type]


def test_start_up_mocks_are_vllms_fields() -> None:
    """What a builder reads at start-up: the group's spec (named as vLLM's, whose class names a
    builder tells groups by) and the ``VllmConfig``'s model dtype and forward context."""
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    from attnsdk.adapters.vllm import testing

    for mock, real in (
        (testing.FullAttentionSpec, FullAttentionSpec),
        (testing.EncoderOnlyAttentionSpec, EncoderOnlyAttentionSpec),
        (testing.MockVllmConfig, VllmConfig),
        (testing.MockCompilationConfig, CompilationConfig),
        (testing.MockModelConfig, ModelConfig),
    ):
        if mock.__name__.startswith("Mock"):
            assert mock.__name__ == f"Mock{real.__name__}"
        else:
            assert mock.__name__ == real.__name__
        real_fields = {f.name for f in dataclasses.fields(real)}
        assert {f.name for f in dataclasses.fields(mock)} <= real_fields, mock.__name__
    vllm_config = create_vllm_config()
    vllm_config.attention_config.backend = AttentionBackendEnum.CUSTOM
    with set_current_vllm_config(vllm_config):
        real_layer = Attention(4, 64, 0.125, 2, cache_config=vllm_config.cache_config, prefix="l.1")
    for f in dataclasses.fields(testing.MockAttention):
        assert hasattr(real_layer, f.name), f.name
    assert vllm_config.compilation_config.static_forward_context["l.1"] is real_layer

"""The backend members a running vLLM engine calls, called from vLLM's own code.

Nothing here calls our classes directly where vLLM has a call site:

* selection: ``vllm.v1.attention.selector.get_attn_backend`` (what ``Attention.__init__``
  calls) with our class registered as CUSTOM picks it for configurations we serve, and the
  platform refuses, with our reasons, those we do not (DCP, PCP, R-SWA, adaptive verification,
  MLA, batch invariance, a float16 cache under a bf16 model); cross-attention is picked
  (test_vllm_cross.py runs it);
* KV cache spec: ``Attention.get_kv_cache_spec`` of a sliding-window layer (``customize_spec``
  and ``get_supported_kernel_block_sizes(spec)``), and the worker's
  ``attn_utils.get_kv_cache_spec`` (``customize_attention_spec``);
* layout: ``get_supported_kv_cache_layouts`` + ``resolve_kv_cache_layout`` (engine core) with our
  ``supported_kv_cache_layouts()``, for the default and every ``VLLM_KV_CACHE_LAYOUT``;
* builders: ``AttentionGroup.create_metadata_builders`` (reads ``requires_block_table_width``)
  and ``init_attn_backend``; capture metadata through ``build_attn_metadata``;
* CUDA graphs: ``get_attn_cg_support`` and ``CompilationConfig.resolve_cudagraph_mode_and_sizes``
  with our ``get_cudagraph_support`` (NEVER: full graphs refused, piecewise kept), the varlen
  and adaptive-verification runner checks;
* speculative decoding: the speculator's ``_configure_decode_metadata_update`` reads
  ``supports_draft_decode_metadata_update``; vLLM 0.33's ``build_metadata_for_drafting``;
* ``update_block_table``, as vLLM 0.33's V1 GPUModelRunner calls it (that runner needs a whole
  model to drive, so this one is called directly, with the runner's arguments).
"""

from __future__ import annotations

import importlib.metadata
import types
from typing import Any

import pytest
import torch
from tests.v1.attention.utils import create_vllm_config
from vllm.config import SpeculativeConfig, set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention import selector
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import (
    get_supported_kv_cache_layouts,
    resolve_kv_cache_layout,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec
from vllm.v1.worker.gpu import attn_utils
from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator
from vllm.v1.worker.utils import AttentionGroup
from vllm_engine.attnsdk_ref import Ref

from attnsdk.adapters.vllm import AttnSDKMetadataBuilder, VLLMAttentionMetadata

VLLM_VERSION = importlib.metadata.version("vllm")
NEW_034 = tuple(int(x) for x in VLLM_VERSION.split(".")[:2]) >= (0, 34)
CPU = torch.device("cpu")


def engine_config(**cache: Any) -> Any:
    vllm_config = create_vllm_config(block_size=16, max_model_len=256)
    vllm_config.attention_config.backend = AttentionBackendEnum.CUSTOM
    for name, value in cache.items():
        setattr(vllm_config.cache_config, name, value)
    return vllm_config


def select(vllm_config: Any, **kwargs: Any) -> type:
    args = {"head_size": 128, "dtype": torch.bfloat16, "kv_cache_dtype": "auto", **kwargs}
    with set_current_vllm_config(vllm_config):
        return selector.get_attn_backend(**args)


# ---- selection ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"has_sink": True, "has_sliding_window": True},
        {"kv_cache_dtype": "fp8"},
        {"kv_cache_dtype": "fp8_e5m2", "dtype": torch.float16},
        {"kv_cache_dtype": "bfloat16"},
        {"attn_type": "encoder_only"},
        {"attn_type": "encoder", "has_sliding_window": True},
        {"attn_type": "encoder_decoder"},
        {"head_size": 64, "dtype": torch.float32},
    ],
    ids=[
        "plain",
        "sinks-window",
        "fp8",
        "fp8_e5m2",
        "bf16-cache",
        "encoder_only",
        "encoder",
        "cross-attention",
        "fp32",
    ],
)
def test_selector_picks_ref(kwargs: dict[str, Any]) -> None:
    assert select(engine_config(), **kwargs) is Ref


def test_selector_picks_ref_for_non_causal_decoders() -> None:
    vllm_config = engine_config()
    vllm_config.attention_config.use_non_causal = True  # DFlash drafts
    assert select(vllm_config) is Ref


def _dcp(c: Any) -> None:
    c.parallel_config.decode_context_parallel_size = 2


def _pcp(c: Any) -> None:
    c.parallel_config.prefill_context_parallel_size = 2


def _rswa(c: Any) -> None:
    c.model_config.model_arch_config.rswa_window = 64


def _adaptive(c: Any) -> None:
    c.speculative_config = SpeculativeConfig(
        method="ngram", num_speculative_tokens=2, enable_adaptive_verification=True
    )


@pytest.mark.parametrize(
    ("configure", "kwargs", "reason"),
    [
        (_dcp, {}, "DCP not supported"),
        (_pcp, {}, "PCP not supported"),
        (_rswa, {}, "R-SWA not supported"),
        (_adaptive, {}, "needed for adaptive verification"),
        (None, {"use_mla": True}, "AttnSDKMLABackend"),
        (None, {"kv_cache_dtype": "float16"}, "kv_cache_dtype 'float16' with a torch.bfloat16"),
    ],
    ids=["dcp", "pcp", "rswa", "adaptive-verification", "mla", "fp16-cache"],
)
def test_selector_refuses_with_our_reason(configure: Any, kwargs: Any, reason: str) -> None:
    vllm_config = engine_config()
    if configure is not None:
        configure(vllm_config)
    with pytest.raises(ValueError, match="CUSTOM is not valid") as raised:
        select(vllm_config, **kwargs)
    assert reason in str(raised.value)


def test_selector_refuses_batch_invariance(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(ValueError, match="batch invariance not supported"):
        select(engine_config())


# ---- KV cache spec and layout ---------------------------------------------------------------


def test_sliding_window_kv_cache_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, Any]] = []
    customize, sizes = Ref.customize_spec.__func__, Ref.get_supported_kernel_block_sizes.__func__  # type: ignore[attr-defined]

    def spy_customize(cls: type, spec: Any) -> Any:
        seen.append(("customize_spec", spec))
        return customize(cls, spec)

    def spy_sizes(cls: type, spec: Any = None) -> Any:
        seen.append(("get_supported_kernel_block_sizes", spec))
        return sizes(cls, spec)

    monkeypatch.setattr(Ref, "customize_spec", classmethod(spy_customize))
    monkeypatch.setattr(Ref, "get_supported_kernel_block_sizes", classmethod(spy_sizes))
    vllm_config = engine_config()
    with set_current_vllm_config(vllm_config):
        layer = Attention(
            8, 64, 0.125, 2, cache_config=vllm_config.cache_config, per_layer_sliding_window=40,
            prefix="model.layers.0.self_attn.attn",
        )  # fmt: skip
        spec = layer.get_kv_cache_spec(vllm_config)
        worker_specs = attn_utils.get_kv_cache_spec(vllm_config)
    assert layer.get_attn_backend() is Ref
    assert isinstance(spec, SlidingWindowSpec)
    assert (spec.block_size, spec.sliding_window, spec.num_kv_heads) == (16, 40, 2)
    assert worker_specs == {"model.layers.0.self_attn.attn": spec}
    called = [name for name, _ in seen]
    assert called[:2] == ["customize_spec", "get_supported_kernel_block_sizes"]
    assert isinstance(seen[1][1], SlidingWindowSpec)  # the spec, passed positionally
    assert "customize_spec" in called[2:]  # the worker's customize_attention_spec


def test_supported_layouts_are_vllms_default_preference() -> None:
    assert Ref.supported_kv_cache_layouts() is None
    layouts = get_supported_kv_cache_layouts([Ref])
    assert set(layouts) == set(KVCacheLayout)
    assert layouts[0] is KVCacheLayout.LBNHC


@pytest.mark.parametrize("requested", [None, *(m.name for m in KVCacheLayout)])
def test_resolve_kv_cache_layout(monkeypatch: pytest.MonkeyPatch, requested: str | None) -> None:
    if requested is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", requested)
    vllm_config = engine_config(kv_cache_layout=None)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    names = [m.name for m in get_supported_kv_cache_layouts([Ref])]
    layout = resolve_kv_cache_layout(vllm_config, [names], [spec])
    assert layout is KVCacheLayout[requested or "LBNHC"]
    assert vllm_config.cache_config.kv_cache_layout == layout.name


# ---- builders, CUDA graphs, speculative decoding --------------------------------------------


def attention_groups(vllm_config: Any) -> list[list[AttentionGroup]]:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    group = AttentionGroup(Ref, ["model.layers.0.attn", "model.layers.1.attn"], spec, 0)
    with set_current_vllm_config(vllm_config):
        group.create_metadata_builders(vllm_config, CPU, kernel_block_size=16)
    return [[group]]


def test_builders_created_by_the_worker() -> None:
    assert Ref.get_builder_cls().requires_block_table_width is False
    (group,) = attention_groups(engine_config())[0]
    (builder,) = group.metadata_builders
    assert isinstance(builder, AttnSDKMetadataBuilder)
    assert builder.backend.name == "reference"  # bound to Ref's attnsdk backend
    assert group.kernel_block_size is None  # block 16 is ours as it is: no kernel blocks
    assert builder.layer_names == group.layer_names
    assert builder.device == CPU


def test_capture_metadata_through_build_attn_metadata() -> None:
    """The runner's capture path (for_cudagraph_capture): padded rows, slot -1, null blocks."""
    vllm_config = engine_config()
    groups = attention_groups(vllm_config)
    num_reqs, num_tokens = 4, 4
    metadata = attn_utils.build_attn_metadata(
        attn_groups=groups,
        num_reqs=num_reqs,
        num_tokens=num_tokens,
        query_start_loc_gpu=torch.tensor([0, 1, 1, 1, 1], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 1, 1, 1], dtype=torch.int32),
        max_query_len=1,
        seq_lens=torch.tensor([7, 0, 0, 0], dtype=torch.int32),
        max_seq_len=256,
        block_tables=[torch.tensor([[3, 0], [0, 0], [0, 0], [0, 0]], dtype=torch.int32)],
        slot_mappings=torch.tensor([[54, -1, -1, -1]]),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[None]),
        seq_lens_cpu_upper_bound=torch.tensor([7, 0, 0, 0], dtype=torch.int32),
        for_cudagraph_capture=True,
    )
    assert set(metadata) == {"model.layers.0.attn", "model.layers.1.attn"}
    built = metadata["model.layers.0.attn"]
    assert isinstance(built, VLLMAttentionMetadata)
    assert (built.num_actual_tokens, built.max_seq_len) == (num_tokens, 256)
    assert built.metadata.seq_lens_cpu.tolist() == [7, 0, 0, 0]
    assert built.slot_mapping.tolist() == [54, -1, -1, -1]


def test_cudagraph_support_as_the_runner_resolves_it() -> None:
    vllm_config = engine_config()
    groups = attention_groups(vllm_config)
    (builder,) = groups[0][0].metadata_builders
    assert builder.get_cudagraph_support(vllm_config, groups[0][0].kv_cache_spec) is (
        AttentionCGSupport.NEVER
    )
    info = attn_utils.get_attn_cg_support(groups, vllm_config)
    assert (info.min_cg_support, info.min_cg_attn_backend) == (AttentionCGSupport.NEVER, "Ref")
    compilation = vllm_config.compilation_config
    compilation.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    resolved = compilation.resolve_cudagraph_mode_and_sizes(
        info.min_cg_support, info.min_cg_attn_backend
    )
    assert resolved in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE)
    assert not resolved.has_full_cudagraphs()
    compilation.cudagraph_mode = CUDAGraphMode.FULL
    with pytest.raises(ValueError, match="not supported with Ref backend"):
        compilation.resolve_cudagraph_mode_and_sizes(AttentionCGSupport.NEVER, "Ref")
    assert attn_utils.get_varlen_cudagraph_unsupported_backend(groups, vllm_config, 1) == (
        "Ref",
        None,
    )
    # Adaptive verification trims drafts on the device: we plan from host lengths.
    assert attn_utils.get_query_lens_mismatch_unsupported_backend(groups) == "Ref"


def test_speculator_reads_draft_decode_metadata_update() -> None:
    groups = attention_groups(engine_config())
    assert groups[0][0].supports_draft_decode_metadata_update is False
    speculator = types.SimpleNamespace(attn_groups=groups)
    DraftModelSpeculator._configure_decode_metadata_update(speculator)  # type: ignore[arg-type]
    assert speculator.supports_decode_metadata_update is False


def common_metadata(block_table: list[list[int]], slots: list[int]) -> CommonAttentionMetadata:
    """Two requests: a decode at position 4 and a 2-token step at positions 16..17."""
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 1, 3], dtype=torch.int32),
        seq_lens=torch.tensor([5, 18], dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor([5, 18], dtype=torch.int32),
        num_reqs=2,
        num_actual_tokens=3,
        max_query_len=2,
        max_seq_len=18,
        block_table_tensor=torch.tensor(block_table, dtype=torch.int32),
        slot_mapping=torch.tensor(slots),
    )


def test_update_block_table_equals_a_build() -> None:
    """vLLM 0.33's GPUModelRunner reuses a group's metadata for another group with the same
    spec through update_block_table(metadata, block_table, slot_mapping) (0.34's runner only
    for Mamba): the result must be what build() makes from that group's tables."""
    (group,) = attention_groups(engine_config())[0]
    (builder,) = group.metadata_builders
    assert builder.supports_update_block_table is True
    first = group.build_metadata(common_metadata([[1, 0], [2, 3]], [20, 48, 49]))
    other = common_metadata([[4, 0], [5, 6]], [68, 96, 97])
    updated = builder.update_block_table(first, other.block_table_tensor, other.slot_mapping)
    built = group.build_metadata(other)
    for field in ("page_table", "slot_mapping", "seq_lens", "query_start_loc", "seq_lens_cpu"):
        assert torch.equal(getattr(updated.metadata, field), getattr(built.metadata, field)), field
    assert (updated.num_actual_tokens, updated.causal) == (built.num_actual_tokens, built.causal)


def test_draft_model_metadata_hook() -> None:
    """0.33's runner builds draft metadata with build_metadata_for_drafting; 0.34 uses build."""
    vllm_config = engine_config()
    (group,) = attention_groups(vllm_config)[0]
    if NEW_034:
        assert not hasattr(AttentionGroup, "build_metadata_for_drafting")
        return
    cm = common_metadata([[1, 0], [2, 3]], [20, 48, 49])
    built = group.build_metadata_for_drafting(cm, draft_index=1)  # type: ignore[attr-defined]
    assert isinstance(built, VLLMAttentionMetadata)
    assert built.metadata.query_lens_cpu.tolist() == [1, 2]
    assert built.slot_mapping.tolist() == [20, 48, 49]

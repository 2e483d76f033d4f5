"""The drop-in classes' vLLM-facing surface: shapes, support checks, configuration, errors."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from typing import TYPE_CHECKING

import pytest
import torch

from attnsdk import (
    AttentionConfig,
    BackendUnavailableError,
    InvalidInputError,
    UnsupportedConfigError,
    create_backend,
)
from attnsdk.adapters.vllm import (
    AttnSDKAttentionBackend,
    AttnSDKMetadataBuilder,
    VLLMCudaGraphSupport,
    register,
)
from attnsdk.adapters.vllm.testing import VLLM_BATCH_SPECS, mock_vllm_batch

if TYPE_CHECKING:
    from attnsdk.testing import BatchSpec


class RefBackend(AttnSDKAttentionBackend):
    attnsdk_backend = "reference"


def test_vllm_owns_the_cache_layout() -> None:
    """vLLM 0.29+ allocates every layer's cache itself and hands a [N, Hkv, P, 2D] view in any
    of its physical layouts; the drop-in votes for none and defines no shape hooks."""
    assert RefBackend.supported_kv_cache_layouts() is None
    for gone in ("get_kv_cache_shape", "get_kv_cache_stride_order", "kv_cache_layout"):
        assert not hasattr(RefBackend, gone), gone


def test_subclass_configures_builder_and_impl() -> None:
    impl_cls, builder_cls = RefBackend.get_impl_cls(), RefBackend.get_builder_cls()
    assert impl_cls.attnsdk_backend == "reference"
    assert builder_cls.attnsdk_backend == "reference"
    assert RefBackend.get_impl_cls() is impl_cls  # bound once, not per call
    impl = impl_cls(8, 64, 0.125, 2)
    builder = builder_cls(None, ["l"], None, torch.device("cpu"))
    assert impl.backend is builder.backend  # plans and layers share one backend
    assert issubclass(builder_cls, AttnSDKMetadataBuilder)
    assert RefBackend.get_name() == "CUSTOM"


def test_backend_from_config_or_instance_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = AttentionConfig(backend="reference", options={"max_scores": 4096})
    by_config = type("C", (AttnSDKAttentionBackend,), {"attnsdk_backend": config})
    assert by_config.get_impl_cls()(4, 32, 0.1, 2).backend.options.max_scores == 4096
    instance = create_backend("reference")
    by_instance = type("I", (AttnSDKAttentionBackend,), {"attnsdk_backend": instance})
    assert by_instance.get_impl_cls()(4, 32, 0.1, 2).backend is instance
    monkeypatch.setenv("ATTNSDK_BACKEND", "reference")
    assert AttnSDKAttentionBackend.get_impl_cls()(4, 32, 0.1, 2).backend.name == "reference"


def test_unknown_backend_name_lists_known_ones() -> None:
    bad = type("X", (AttnSDKAttentionBackend,), {"attnsdk_backend": "no-such-kernel"})
    with pytest.raises(UnsupportedConfigError, match="known backends"):
        bad.get_impl_cls()(4, 32, 0.1, 2)


def test_validate_configuration_returns_reasons() -> None:
    ok = RefBackend.validate_configuration(128, torch.bfloat16, "auto", 16, False, False, False)
    assert ok == []
    assert RefBackend.validate_configuration(128, torch.float16, "fp8", 16) == []
    assert (
        RefBackend.validate_configuration(64, torch.float16, "auto", 16, has_sliding_window=True)
        == []
    )
    reasons = RefBackend.validate_configuration(
        2048, torch.float64, "int8", 16, use_mla=True, use_sparse=True
    )
    text = "\n".join(reasons)
    for needle in ("dtype", "AttnSDKMLABackend", "sparse", "kv_cache_dtype 'int8'"):
        assert needle in text, text
    too_big = RefBackend.validate_configuration(2048, torch.float16, "auto", 16)
    assert any("head_dim" in r for r in too_big)
    unavailable = type("F", (AttnSDKAttentionBackend,), {"attnsdk_backend": "no-such-kernel"})
    assert (
        "unknown attention backend"
        in unavailable.validate_configuration(64, torch.float16, "auto", 16)[0]
    )


@pytest.mark.parametrize(
    ("flag", "needle"),
    [
        ("use_dcp", "DCP not supported"),
        ("use_pcp", "PCP not supported"),
        ("use_rswa", "R-SWA not supported"),
        ("use_adaptive_verification", "adaptive verification"),
        ("use_batch_invariant", "batch invariance"),
        ("use_some_future_feature", "use_some_future_feature=True is not checked by attnsdk"),
    ],
)
def test_validate_configuration_refuses_every_flag_it_does_not_serve(
    flag: str, needle: str
) -> None:
    reasons = RefBackend.validate_configuration(64, torch.bfloat16, "auto", 16, **{flag: True})
    assert any(needle in r for r in reasons), reasons
    assert RefBackend.validate_configuration(64, torch.bfloat16, "auto", 16, **{flag: False}) == []


def test_a_kv_cache_dtype_other_than_the_model_dtype_is_refused_up_front() -> None:
    reasons = RefBackend.validate_configuration(64, torch.bfloat16, "float16", 16)
    assert any("kv_cache_dtype 'float16' with a torch.bfloat16 model" in r for r in reasons)
    assert RefBackend.validate_configuration(64, torch.float16, "float16", 16) == []


def test_support_queries() -> None:
    assert RefBackend.supports_sink()
    assert RefBackend.supports_non_causal()
    assert RefBackend.supports_attn_type("encoder_only")
    assert RefBackend.supports_attn_type("decoder")
    assert RefBackend.supports_attn_type("encoder_decoder")  # cross-attention
    assert not RefBackend.supports_attn_type("mamba")
    assert RefBackend.supports_head_size(256)
    assert not RefBackend.supports_head_size(4096)
    assert RefBackend.supports_dtype(torch.float32)
    assert not RefBackend.supports_dtype(torch.int8)
    assert RefBackend.supports_kv_cache_dtype("fp8_e5m2")
    assert not RefBackend.supports_kv_cache_dtype("int4")
    assert RefBackend.supports_block_size(7)
    assert RefBackend.get_preferred_block_size(16) == 16
    assert not RefBackend.is_mla()
    assert not RefBackend.supports_mm_prefix()
    # Without vLLM loaded the kernel block sizes are plain ints and the graph level our own enum.
    assert RefBackend.get_supported_kernel_block_sizes() == [1]
    assert RefBackend.get_supported_kernel_block_sizes(object()) == [1]  # vLLM passes the spec
    assert not RefBackend.supports_device_cpu_query_lens_mismatch()
    assert RefBackend.supports_sliding_window()
    assert (
        RefBackend.get_builder_cls().get_cudagraph_support(None, None) is VLLMCudaGraphSupport.NEVER
    )


def test_unsupported_layer_features_raise_with_reasons() -> None:
    impl_cls = RefBackend.get_impl_cls()
    with pytest.raises(UnsupportedConfigError, match="ALiBi"):
        impl_cls(4, 32, 0.1, 2, alibi_slopes=[0.5] * 4)
    with pytest.raises(UnsupportedConfigError, match="attn_type mamba"):
        impl_cls(4, 32, 0.1, 2, attn_type="mamba")
    with pytest.raises(
        UnsupportedConfigError, match=r"use_alibi_sqrt is not served \(found True\)"
    ):
        impl_cls(4, 32, 0.1, 2, use_alibi_sqrt=True)
    assert impl_cls(4, 32, 0.1, 2, use_alibi_sqrt=False).num_heads == 4
    with pytest.raises(InvalidInputError, match=r"sinks\.shape"):
        impl_cls(4, 32, 0.1, 2, sinks=torch.zeros(3))


def _step(spec: BatchSpec) -> tuple[object, object, object]:
    batch = mock_vllm_batch(spec, num_heads=4, num_kv_heads=2, head_size=32)
    builder = RefBackend.get_builder_cls()(None, ["l"], None, torch.device("cpu"))
    impl = RefBackend.get_impl_cls()(4, 32, 32**-0.5, 2)
    return batch, builder, impl


def test_profiling_run_and_output_errors() -> None:
    batch, builder, impl = _step(VLLM_BATCH_SPECS["small_decode"])
    output = torch.full((2, 128), math.nan)
    impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, None, output)
    assert output.eq(0).all()  # vLLM's profiling run passes no metadata
    meta = builder.build(0, batch.common_attn_metadata)
    with pytest.raises(InvalidInputError, match="output"):
        impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, meta)
    with pytest.raises(UnsupportedConfigError, match="output quantization"):
        impl.forward(
            batch.layer,
            batch.query,
            batch.key,
            batch.value,
            batch.kv_cache,
            meta,
            output,
            output_scale=torch.ones(()),
        )
    with pytest.raises(InvalidInputError, match=r"query.shape: expected \(T, 4, 32\)"):
        impl.forward(
            batch.layer, batch.query[:, :3], batch.key, batch.value, batch.kv_cache, meta, output
        )


def test_unviewable_output_is_copied_back() -> None:
    batch, builder, impl = _step(VLLM_BATCH_SPECS["small_prefill"])
    meta = builder.build(0, batch.common_attn_metadata)
    wide = torch.full((16, 256), math.nan)
    output = wide[:, ::2]  # (T, Hq * D) that no (T, Hq, D) view can alias
    impl.forward(batch.layer, batch.query, batch.key, batch.value, batch.kv_cache, meta, output)
    assert bool(torch.isfinite(output).all())
    assert bool(wide[:, 1::2].isnan().all())


def test_update_block_table_replans_for_another_group() -> None:
    batch, builder, _ = _step(VLLM_BATCH_SPECS["mixed_small"])
    meta = builder.build(0, batch.common_attn_metadata)
    table = batch.common_attn_metadata.block_table_tensor + 1
    slots = batch.common_attn_metadata.slot_mapping + 16
    moved = builder.update_block_table(meta, table, slots)
    assert torch.equal(moved.metadata.page_table, table)
    assert torch.equal(moved.metadata.slot_mapping, slots[: meta.num_actual_tokens])
    assert torch.equal(moved.metadata.seq_lens, meta.metadata.seq_lens)
    assert moved.plan is not meta.plan


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_register_without_vllm_names_the_install_command() -> None:
    with pytest.raises(BackendUnavailableError, match="pip install vllm"):
        register()


def test_supports_compute_capability_honours_both_bounds() -> None:
    """vLLM must not pick a Hopper-only attnsdk backend on an older or newer GPU."""
    from types import SimpleNamespace

    import attnsdk as A
    from attnsdk.backends.reference import ReferenceBackend

    class HopperOnly(ReferenceBackend):
        capabilities = A.Capabilities(
            devices=frozenset({"cpu"}),
            dtypes=ReferenceBackend.capabilities.dtypes,
            kv_dtypes=frozenset(),
            max_head_dim=256,
            min_compute_capability=(9, 0),
            max_compute_capability=(9, 9),
        )

    cls = type("H", (AttnSDKAttentionBackend,), {"attnsdk_backend": HopperOnly()})
    cc = lambda major, minor: SimpleNamespace(major=major, minor=minor)  # noqa: E731
    assert cls.supports_compute_capability(cc(9, 0))
    assert not cls.supports_compute_capability(cc(8, 9))
    assert not cls.supports_compute_capability(cc(10, 0))


def test_a_builder_of_kv_sharing_layers_plans_no_writes() -> None:
    """vLLM's KV-sharing fast prefill gives the sharing layers their own builder and cuts their
    batch to the logits rows while the slot mapping stays the full batch's: they write nothing."""
    from types import SimpleNamespace

    batch, _, _ = _step(VLLM_BATCH_SPECS["mixed_small"])
    context = {
        "l0": SimpleNamespace(kv_sharing_target_layer_name=None),
        "l1": SimpleNamespace(kv_sharing_target_layer_name="l0"),
    }
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=context))
    builder_cls = RefBackend.get_builder_cls()
    sharing = builder_cls(None, ["l1"], config, torch.device("cpu"))
    owning = builder_cls(None, ["l0", "l1"], config, torch.device("cpu"))
    cm = batch.common_attn_metadata
    assert sharing.build(0, cm).metadata.slot_mapping.eq(-1).all()
    assert torch.equal(
        owning.build(0, cm).metadata.slot_mapping, cm.slot_mapping[: cm.num_actual_tokens]
    )


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_the_mla_drop_in_without_vllm_names_what_is_missing() -> None:
    """The MLA classes subclass vLLM's MLA machinery: without vLLM, asking for one says so
    (tests/engines/vllm_engine/test_vllm_mla.py runs them inside vLLM)."""
    import attnsdk.adapters.vllm as vllm_adapter

    with pytest.raises(BackendUnavailableError, match="mla_attention") as err:
        vllm_adapter.AttnSDKMLABackend  # noqa: B018
    assert err.value.install_command == "pip install vllm"


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_the_mla_prefill_without_vllm_names_what_is_missing() -> None:
    """The MLA prefill backend subclasses vLLM's ``MLAPrefillBackend`` and registers in vLLM's
    MLA prefill registry: without vLLM both say which module is missing."""
    import attnsdk.adapters.vllm as vllm_adapter

    with pytest.raises(BackendUnavailableError, match=r"prefill\.base") as err:
        vllm_adapter.AttnSDKMLAPrefillBackend  # noqa: B018
    assert err.value.install_command == "pip install 'vllm>=0.33'"
    with pytest.raises(BackendUnavailableError, match=r"prefill\.registry"):
        vllm_adapter.register_mla_prefill()


def test_speculative_steps_plan_from_exact_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the adapter's host seq_lens is vLLM's ``seq_lens_cpu_upper_bound``, which takes
    every draft as accepted. With a ``speculative_config`` the builder plans from the exact
    (device) lengths, so host-planning backends attend over the accepted tokens only."""
    from types import SimpleNamespace

    from attnsdk.adapters.vllm import VLLMAdapter

    def upper_bound(self: VLLMAdapter, cm: object, num_reqs: int) -> torch.Tensor:
        return cm.seq_lens[:num_reqs] + 2  # type: ignore[attr-defined]  # two rejected drafts

    monkeypatch.setattr(VLLMAdapter, "host_seq_lens", upper_bound)
    batch = mock_vllm_batch(VLLM_BATCH_SPECS["small_decode"], num_heads=4, num_kv_heads=2)
    cm = batch.common_attn_metadata
    exact = cm.seq_lens.tolist()
    cm.max_seq_len = max(exact) + 2  # vLLM derives it from the same host bound
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2))
    builder = RefBackend.get_builder_cls()(None, ["l"], config, torch.device("cpu"))
    meta = builder.build(0, cm).metadata
    assert meta.seq_lens_cpu.tolist() == exact
    assert meta.max_seq_len == max(exact)


GROUP = {  # one KV-cache group: (num_heads, head_size, scale, num_kv_heads) and extras
    "model.layers.0.self_attn.attn": {},
    "model.layers.1.self_attn.attn": {"sliding_window": 24},
    "model.layers.2.self_attn.attn": {"logits_soft_cap": 30.0},
    "model.layers.3.self_attn.attn": {"sinks": torch.zeros(4)},
    "model.layers.4.self_attn.attn": {},
    "model.layers.5.self_attn.attn": {"logits_soft_cap": 30.0},
}


def _group(backend_cls: type, layers: dict[str, dict[str, object]], **impl: object) -> object:
    """The impls of ``layers`` (4 query / 2 KV heads of 32 dims), as vLLM builds a model."""
    from attnsdk.adapters.vllm.testing import mock_vllm_config

    make = backend_cls.get_impl_cls()
    return mock_vllm_config(
        {name: make(4, 32, 32**-0.5, 2, **{**impl, **extra}) for name, extra in layers.items()}
    )


def test_the_builder_declares_its_groups_layers_at_start_up() -> None:
    """vLLM builds a builder per KV-cache group after the model: it prepares every distinct
    layer shape there, with the group's KV layout, before any step."""
    from attnsdk.adapters.vllm.testing import FullAttentionSpec

    backend = create_backend("reference")
    cls = type("Fresh", (AttnSDKAttentionBackend,), {"attnsdk_backend": backend})
    config = _group(cls, GROUP, kv_cache_dtype="fp8")
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.uint8)
    cls.get_builder_cls()(spec, list(GROUP), config, torch.device("cpu"))
    impls = config.compilation_config.static_forward_context
    specs = list(dict.fromkeys(impls[name].impl.layer_spec for name in GROUP))
    assert len(specs) == 4
    layouts = {layout for _, layout in backend.prepared}
    assert [layer for layer, _ in backend.prepared] == specs
    (layout,) = layouts
    assert (layout.page_size, layout.dtype, layout.kv_dtype) == (
        16,
        torch.float32,
        torch.float8_e4m3fn,
    )
    # The first step's forward runs on the declared (spec, layout): nothing more is prepared.
    batch = mock_vllm_batch(
        VLLM_BATCH_SPECS["mixed_small"], num_heads=4, num_kv_heads=2, head_size=32,
        kv_cache_dtype="fp8", sinks=True,
    )  # fmt: skip
    builder = cls.get_builder_cls()(spec, list(GROUP), config, torch.device("cpu"))
    metadata = builder.build(0, batch.common_attn_metadata)
    output = torch.empty(batch.query.shape[0], 4 * 32)
    for name in GROUP:
        impl = impls[name].impl
        args = (batch.query, batch.key, batch.value, batch.kv_cache, metadata, output)
        impl.forward(batch.layer, *args)
    assert [layer for layer, _ in backend.prepared] == specs


def test_a_group_the_backend_cannot_serve_fails_at_start_up_naming_its_layers() -> None:
    from attnsdk import Feature
    from attnsdk.adapters.vllm.testing import FullAttentionSpec
    from attnsdk.backends.reference import ReferenceBackend

    class NoSoftcap(ReferenceBackend):
        capabilities = dataclasses.replace(
            ReferenceBackend.capabilities,
            features=ReferenceBackend.capabilities.features - {Feature.SOFTCAP},
        )

    backend = NoSoftcap()
    cls = type("NoSoftcapVLLM", (AttnSDKAttentionBackend,), {"attnsdk_backend": backend})
    config = _group(cls, GROUP)  # the impls refuse nothing: their builder asks the backend
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    with pytest.raises(UnsupportedConfigError) as info:
        cls.get_builder_cls()(spec, list(GROUP), config, torch.device("cpu"))
    assert [r.field for r in info.value.reasons] == [
        "model.layers.2.self_attn.attn, model.layers.5.self_attn.attn.softcap"
    ]
    assert str(info.value).startswith(
        "AttnSDKMetadataBuilder: the reference backend cannot serve this model:"
    )
    assert backend.prepared == []


def test_a_builder_made_outside_vllms_start_up_declares_nothing() -> None:
    """No spec or no config (a builder made by hand): each layer is prepared at its first
    forward, as before."""
    backend = create_backend("reference")
    cls = type("Fresh", (AttnSDKAttentionBackend,), {"attnsdk_backend": backend})
    cls.get_builder_cls()(None, ["l"], None, torch.device("cpu"))
    assert backend.prepared == []

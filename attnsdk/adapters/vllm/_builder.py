"""vLLM's per-step side of the drop-in: ``AttnSDKMetadataBuilderBase`` turns vLLM's
``CommonAttentionMetadata`` into one attnsdk plan per step (``VLLMAttentionMetadata``), which
every layer's ``AttnSDKAttentionImpl`` reads.

vLLM builds one builder per KV-cache group at start-up, after the model's layers and before
its KV cache: each declares its group's layers to the attnsdk backend there (``declare_group``,
``Backend.prepare``), so a model the backend cannot serve fails before the first step, with
every reason naming its layers."""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from attnsdk.adapters._common import ModelLayer, declare_model, resolve_backend
from attnsdk.adapters.vllm._adapter import VLLMAdapter
from attnsdk.adapters.vllm._layout import compute_dtype_by_name
from attnsdk.adapters.vllm._resolve import vllm_symbol
from attnsdk.contract.kv import COMPUTE_DTYPES
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from attnsdk.adapters.vllm._resolve import BackendSpec
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.plan import Plan

__all__ = [
    "AttnSDKMetadataBuilderBase",
    "VLLMAttentionMetadata",
    "VLLMCudaGraphSupport",
    "declare_group",
    "encoder_plan",
    "no_full_graphs",
]


class VLLMCudaGraphSupport(enum.IntEnum):
    """Stand-in for vLLM's ``AttentionCGSupport`` (same names and values) when vLLM is not loaded."""

    NEVER = 0
    UNIFORM_SINGLE_TOKEN_DECODE = 1
    UNIFORM_BATCH = 2
    ALWAYS = 3


@dataclass
class VLLMAttentionMetadata:
    """What ``AttnSDKMetadataBuilder.build`` returns and every layer's ``forward`` reads.

    Mutable, like vLLM's own metadata classes: vLLM's KV-sharing fast prefill subclasses the
    metadata class and sets fields on it."""

    plan: Plan
    """The attnsdk plan of this step (``plan.metadata`` is the ``AttentionMetadata``)."""
    backend: Backend
    """The backend that made ``plan``; the layers run with it, so plan and kernel always match."""
    num_actual_tokens: int
    """Query rows that are real (vLLM's name); later rows of q and output are padding."""
    max_query_len: int
    max_seq_len: int
    causal: bool
    """The step's causal flag (False for non-causal / encoder-only batches)."""
    encoder_slot_mapping: torch.Tensor | None = None
    """Cross-attention: the encoder tokens' slots, for the requests whose encoder K/V this step
    writes (vLLM's ``CrossAttentionBuilder`` assigns ``slot_mapping`` after ``build``); None
    otherwise."""
    ragged: Plan | None = None
    """Encoder-only layers: the step planned as ragged attention over its own K/V
    (``AttentionMetadata.for_ragged``, every request's keys its new tokens), which every layer
    runs through ``Backend.forward_ragged``. The builder of an encoder-only group plans it (and
    it is then ``plan`` too); otherwise the first encoder layer of the step does
    (``encoder_plan``), once for all."""

    @property
    def metadata(self) -> AttentionMetadata:
        return self.plan.metadata

    # vLLM's FlashAttentionMetadata names, for engine code that peeks at a backend's metadata.

    @property
    def query_start_loc(self) -> torch.Tensor:
        return self.plan.metadata.query_start_loc

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.plan.metadata.seq_lens

    @property
    def block_table(self) -> torch.Tensor:
        return self.plan.metadata.page_table

    @property
    def slot_mapping(self) -> torch.Tensor:
        if self.encoder_slot_mapping is not None:
            return self.encoder_slot_mapping
        return self.plan.metadata.slot_mapping

    @slot_mapping.setter
    def slot_mapping(self, value: torch.Tensor) -> None:
        # vLLM's CrossAttentionBuilder sets the encoder tokens' slots after build.
        self.encoder_slot_mapping = value


class AttnSDKMetadataBuilderBase:
    """vLLM's ``AttentionMetadataBuilder``: one ``CommonAttentionMetadata`` → one plan per step.

    Use it as ``attnsdk.adapters.vllm.AttnSDKMetadataBuilder`` (vLLM's base mixed in).
    """

    attnsdk_backend: ClassVar[BackendSpec] = None
    adapter: ClassVar[VLLMAdapter] = VLLMAdapter()
    """Subclass ``VLLMAdapter`` and set it here to read a fork's fields."""
    reorder_batch_threshold: ClassVar[int | None] = None
    """attnsdk backends take mixed batches in any order, so vLLM need not reorder them."""
    supports_update_block_table: ClassVar[bool] = True
    requires_block_table_width: ClassVar[bool] = False
    supports_draft_decode_metadata_update: ClassVar[bool] = False

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = layer_names
        self.vllm_config = vllm_config
        self.device = device
        self.backend = resolve_backend(self.attnsdk_backend)
        self.reads_only = _kv_sharing_only(vllm_config, layer_names)
        """Every layer of this builder reads another layer's cache (vLLM's KV-sharing fast
        prefill gives them their own builder): its steps write nothing."""
        self.cross = type(kv_cache_spec).__name__ == "CrossAttentionSpec"
        """The builder of cross-attention layers (vLLM's ``CrossAttentionBuilder`` subclasses
        this class): its steps read the encoder's keys, ``seq_lens`` being their lengths."""
        self.speculative = getattr(vllm_config, "speculative_config", None) is not None
        """Speculative decoding: vLLM's host ``seq_lens`` is an upper bound, so each step
        reads the exact lengths (``VLLMAdapter.with_exact_seq_lens``, one sync)."""
        declared = declare_group(
            self.backend, kv_cache_spec, layer_names, vllm_config, device, type(self).__name__
        )
        self.encoder = type(kv_cache_spec).__name__ == "EncoderOnlyAttentionSpec" or (
            bool(declared) and all(layer.layout is None for layer in declared)
        )
        """The builder of encoder-only layers (vLLM's ``EncoderOnlyAttentionSpec`` group): its
        steps are planned as ragged attention over their own K/V (``VLLMAttentionMetadata.
        ragged``); there is no cache."""

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any = None, kv_cache_spec: Any = None) -> Any:
        """NEVER for full graphs: plans are per-step objects; piecewise graphs work (see docs)."""
        return no_full_graphs()

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> VLLMAttentionMetadata:
        """Plan the step (``common_prefix_len`` is always 0 in vLLM 0.33+: no cascade)."""
        meta = self._no_writes(self.adapter.build_metadata(common_attn_metadata))
        if self.encoder:
            plan = self.backend.plan(encoder_metadata(meta))
            return VLLMAttentionMetadata(
                plan=plan,
                backend=self.backend,
                num_actual_tokens=int(common_attn_metadata.num_actual_tokens),
                max_query_len=meta.max_query_len,
                max_seq_len=meta.max_query_len,
                causal=False,
                ragged=plan,
            )
        if self.speculative:
            meta = self.adapter.with_exact_seq_lens(meta)
        if self.cross:
            meta = dataclasses.replace(meta, cross_attention=True)
        return VLLMAttentionMetadata(
            plan=self.backend.plan(meta),
            backend=self.backend,
            num_actual_tokens=int(common_attn_metadata.num_actual_tokens),
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            causal=self.adapter.causal(common_attn_metadata),
        )

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> VLLMAttentionMetadata:
        return self.build(0, common_attn_metadata)

    def build_for_drafting(
        self, common_attn_metadata: Any, draft_index: int
    ) -> VLLMAttentionMetadata:
        """vLLM 0.33's draft-model hook (0.34 calls ``build``)."""
        return self.build(0, common_attn_metadata, fast_build=True)

    def update_block_table(
        self, metadata: VLLMAttentionMetadata, blk_table: torch.Tensor, slot_mapping: torch.Tensor
    ) -> VLLMAttentionMetadata:
        """Same batch, another KV-cache group's block table and slots: re-plan, no rebuild."""
        old = metadata.metadata
        meta = dataclasses.replace(
            old,
            page_table=blk_table[: old.num_seqs].to(torch.int32),
            slot_mapping=slot_mapping[: metadata.num_actual_tokens].to(torch.int64),
        )
        return dataclasses.replace(metadata, plan=self.backend.plan(self._no_writes(meta)))

    def _no_writes(self, meta: AttentionMetadata) -> AttentionMetadata:
        """KV-sharing layers never write, and vLLM's fast prefill cuts their batch to the
        logits rows while its ``slot_mapping`` stays the full batch's: say "no write" (-1).
        Neither does a cross-attention step: the encoder's K/V go to their own slots."""
        if not self.reads_only and not self.cross:
            return meta
        return dataclasses.replace(meta, slot_mapping=torch.full_like(meta.slot_mapping, -1))


def encoder_metadata(meta: AttentionMetadata) -> AttentionMetadata:
    """An encoder-only step (``meta``, vLLM's batch) as ragged attention: each request's keys
    are its own new tokens, from the host lengths (``for_ragged``: one pinned, non-blocking
    copy on a GPU, no sync)."""
    lengths = meta.query_lens_cpu
    return AttentionMetadata.for_ragged(lengths, lengths, device=meta.device)


def encoder_plan(metadata: VLLMAttentionMetadata) -> Plan:
    """The step's ragged plan (``VLLMAttentionMetadata.ragged``), made by the first encoder
    layer of the step when its builder did not know its layers were encoder-only."""
    if metadata.ragged is None:
        metadata.ragged = metadata.backend.plan(encoder_metadata(metadata.metadata))
    return metadata.ragged


def declare_group(
    backend: Backend,
    kv_cache_spec: Any,
    layer_names: list[str],
    vllm_config: Any,
    device: torch.device,
    what: str,
) -> list[ModelLayer]:
    """Declare a KV-cache group's layers to ``backend`` (``declare_model``: ``prepare`` with
    the group's KV layout) and return them, as vLLM names them.

    vLLM's ``static_forward_context`` maps each name to its layer, whose ``impl`` (a drop-in's)
    says what it runs (``attnsdk_layer``) over a cache of ``kv_cache_spec.block_size`` tokens
    per block (the kernel block size) in the model's dtype. Nothing is declared where these are
    unknown (a builder made outside vLLM's start-up): each layer is then prepared at its first
    forward. Layers without a drop-in impl are not vLLM's attention over this backend."""
    page_size = getattr(kv_cache_spec, "block_size", None)
    dtype = _model_dtype(vllm_config, kv_cache_spec)
    if not isinstance(page_size, int) or dtype is None:
        return []
    declared = [
        layer.impl.attnsdk_layer(name, page_size, dtype)
        for name, layer in _group_layers(vllm_config, layer_names).items()
        if callable(getattr(getattr(layer, "impl", None), "attnsdk_layer", None))
    ]
    declare_model(backend, declared, device, what)
    return declared


def _model_dtype(vllm_config: Any, kv_cache_spec: Any) -> torch.dtype | None:
    """The compute dtype the group's layers run in: the model's, else the cache spec's when
    it is one (an fp8 cache's spec dtype is its uint8 storage)."""
    dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    if isinstance(dtype, str):
        dtype = compute_dtype_by_name(dtype)
    if dtype in COMPUTE_DTYPES:
        return dtype
    spec_dtype = getattr(kv_cache_spec, "dtype", None)
    return spec_dtype if spec_dtype in COMPUTE_DTYPES else None


def _group_layers(vllm_config: Any, layer_names: list[str]) -> dict[str, Any]:
    """vLLM's layers named ``layer_names``, from its ``static_forward_context`` (those found)."""
    compilation = getattr(vllm_config, "compilation_config", None)
    context = getattr(compilation, "static_forward_context", None)
    if not isinstance(context, dict):
        return {}
    return {name: context[name] for name in layer_names if name in context}


def _kv_sharing_only(vllm_config: Any, layer_names: list[str]) -> bool:
    """True when vLLM's layers named ``layer_names`` all have a ``kv_sharing_target_layer_name``."""
    layers = _group_layers(vllm_config, layer_names)
    if not layer_names or len(layers) < len(layer_names):
        return False
    return all(getattr(layer, "kv_sharing_target_layer_name", None) for layer in layers.values())


def no_full_graphs() -> Any:
    """vLLM's ``AttentionCGSupport.NEVER`` (full graphs would bake one step's plan in)."""
    enum_cls = vllm_symbol("AttentionCGSupport")
    return VLLMCudaGraphSupport.NEVER if enum_cls is None else enum_cls.NEVER

"""What the ``flashinfer`` backend plans with: the kernel variants a FlashInfer wrapper is
planned for, the step's plan (``FlashInferPlan``) and the CUDA-graph state
(``FlashInferGraphState``) whose fixed buffers captured wrappers read.

A *variant* is what a FlashInfer wrapper is planned for (heads, head dims, scale, mask, window,
softcap, sinks, dtypes, page size and order); layers of one variant share one wrapper and one
``plan()`` per step (``attnsdk.backends.flashinfer.planner``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from attnsdk.contract.plan import GraphBuffers, Plan

if TYPE_CHECKING:
    from attnsdk.backends.flashinfer.csr import PagedCSR
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = [
    "FP8",
    "FlashInferGraphState",
    "FlashInferPlan",
    "Kind",
    "RaggedPlans",
    "RaggedVariant",
    "StepCSR",
    "Variant",
]

FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
"""KV storage dtypes FlashInfer reads with a bf16 / fp16 query."""

Kind = Literal["decode", "prefill", "mla"]
"""Which wrapper a variant runs in a step: the decode, paged prefill or MLA wrapper."""


@dataclass(frozen=True, slots=True)
class _LayerFields:
    """What every FlashInfer wrapper is planned for, from the layer; each variant adds what its
    wrapper also needs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_dim: int
    scale: float
    causal: bool
    window_left: int

    @staticmethod
    def of_layer(layer: LayerSpec) -> dict[str, Any]:
        """These fields and ``softcap`` of ``layer``, as keyword arguments."""
        return {
            "num_heads": layer.num_heads,
            "num_kv_heads": layer.num_kv_heads,
            "head_dim": layer.head_dim,
            "v_dim": layer.v_dim,
            "scale": layer.softmax_scale,
            "causal": layer.causal,
            "window_left": layer.window_left,
            "softcap": float(layer.softcap or 0.0),
        }


@dataclass(frozen=True, slots=True)
class Variant(_LayerFields):
    """What one paged FlashInfer wrapper is planned for; the backend's per-layer state."""

    chunk: int | None
    """``LayerSpec.attention_chunk_size``: planned over the step's virtual batch."""
    softcap: float
    sinks: bool
    dtype: torch.dtype
    kv_dtype: torch.dtype
    page_size: int
    order: str
    mla: bool = False
    """``LayerSpec.mla``: FlashInfer's MLA wrapper, over the packed latent cache."""

    @classmethod
    def of(cls, layer: LayerSpec, layout: KVCacheLayout) -> Variant:
        """The variant of ``layer`` over a cache of ``layout``."""
        return cls(
            **cls.of_layer(layer),
            chunk=layer.attention_chunk_size,
            sinks=layer.has_sinks,
            dtype=layout.dtype,
            kv_dtype=layout.storage_dtype,
            page_size=layout.page_size,
            order=layout.kv_order.value,
            mla=layout.mla,
        )

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in FP8


@dataclass(frozen=True, slots=True)
class RaggedVariant(_LayerFields):
    """What a ragged wrapper (``BatchPrefillWithRaggedKVCacheWrapper``) is planned for."""

    softcap: float
    dtype: torch.dtype

    @classmethod
    def of(cls, layer: LayerSpec, dtype: torch.dtype) -> RaggedVariant:
        """The ragged variant of ``layer`` with queries, keys and values of ``dtype``."""
        return cls(**cls.of_layer(layer), dtype=dtype)


@dataclass(frozen=True, slots=True)
class StepCSR:
    """A CSR form of one step on the device, shared by every variant planned in it."""

    host: PagedCSR
    indices: torch.Tensor
    """(nnz,) int32 on the device (a prefix of a static buffer in a captured plan)."""


class RaggedPlans(dict[RaggedVariant, Any]):
    """One plan's ragged wrappers (variant -> its planned wrapper). A dict the backend can hold
    a weak reference to: a pooled wrapper whose plan is gone is free for the next plan."""


@dataclass(frozen=True, slots=True)
class FlashInferPlan(Plan):
    """``Plan`` plus what FlashInfer was planned with in this step.

    ``wrappers`` maps each variant planned in this step to its planned wrapper; a layer whose
    variant is missing (``forward`` before ``prepare``) is planned on its first use, which costs
    one FlashInfer ``plan()`` (~390 µs of host time) in that step.
    """

    csr: dict[tuple[bool, int, int | None], StepCSR] = field(default_factory=dict)
    """(per_token, page_size, chunk size) -> the step's CSR on the device."""
    wrappers: dict[Variant, tuple[Any, Kind]] = field(default_factory=dict)
    ragged: RaggedPlans = field(default_factory=RaggedPlans)
    """Each ragged variant planned for this plan (``forward_ragged``) -> its wrapper, valid
    while the backend still counts this plan its owner."""
    virtual: dict[tuple[int, int], AttentionMetadata] = field(default_factory=dict)
    """(chunk size, page size) -> the step's virtual batch for chunked variants."""


class FlashInferGraphState(GraphBuffers):
    """``GraphBuffers`` plus FlashInfer's CUDA-graph wrappers and their fixed CSR buffers.

    Wrappers of a captured graph have a fixed batch size, so there is one per (captured batch
    size, token rows, kind, variant); each holds FlashInfer's 8 MiB integer workspace on the
    device and 8 MiB of pinned host memory. All variants of one capture share the CSR buffers.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wrappers: dict[tuple[int, int, Kind, Variant], Any] = {}
        self.csr_buffers: dict[tuple[int, int, bool, int | None], dict[str, torch.Tensor]] = {}
        self.mla_lse: dict[int, torch.Tensor] = {}
        """Query heads -> a static (max_tokens, heads) fp32 buffer: the log-sum-exp FlashInfer's
        MLA wrapper always writes, in captured steps that were not asked for one."""

    def lse_buffer(self, heads: int) -> torch.Tensor:
        """The static lse buffer of captured MLA steps with ``heads`` query heads."""
        found = self.mla_lse.get(heads)
        if found is None:
            found = self.mla_lse[heads] = torch.empty(
                self.max_tokens, heads, device=self.seq_lens.device
            )
        return found

    def buffers(
        self, batch_size: int, tokens: int, per_token: bool, chunk: int | None
    ) -> dict[str, torch.Tensor]:
        """Fixed CSR buffers of one capture (allocated at its first plan); chunked variants
        read other pages than the rest, so each chunk size has its own."""
        key = (batch_size, tokens, per_token, chunk)
        found = self.csr_buffers.get(key)
        if found is None:
            rows = tokens if per_token else batch_size
            cap = rows * max(self.max_pages, 1)
            dev = self.seq_lens.device
            i32 = torch.int32
            found = self.csr_buffers[key] = {
                "qo_indptr": torch.zeros(rows + 1, dtype=i32, device=dev),
                "kv_indptr": torch.zeros(rows + 1, dtype=i32, device=dev),
                "indices": torch.zeros(cap, dtype=i32, device=dev),
                "last_page_len": torch.zeros(rows, dtype=i32, device=dev),
                "kv_len": torch.zeros(rows, dtype=i32, device=dev),
                "rows": torch.zeros(2 * rows + 1, dtype=torch.int64, device=dev),
            }
        return found

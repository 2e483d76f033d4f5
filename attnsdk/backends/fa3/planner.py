"""fa3's per-step planning: what ``FA3Backend.make_plan`` works out once per step for the
prepared layer shapes, and how each layer's call finds it.

- **Scheduler metadata.** FA3's ``get_scheduler_metadata`` depends on the batch and the layer
  shape (``LayerArgs.key``), not on the layer: with ``FA3Options.precompute_scheduler`` it is
  made once per step and shape (and per tree pass) instead of inside every layer's call. MLA
  layers get none, as SGLang's.
- **Chunked local attention** (``LayerSpec.attention_chunk_size``): FA3 has no chunk mask, so a
  chunked layer runs the same kernel over the step's virtual batch (``attnsdk.features.chunked``:
  one sequence per chunk a sequence's queries touch), made once per step and chunk size for
  the prepared layers. The chunk size must be a multiple of the page size. CUDA graphs capture
  chunked layers in decode graphs only, where the virtual batch has one row per sequence and
  is rebuilt on the device inside the graph.
- **Tree verify** (``AttentionMetadata.tree_mask``): the step's two passes
  (``attnsdk.features.tree``), made once per step and page size.

A layer that was not prepared works out its own at its call. A captured plan makes the
scheduler metadata and the virtual batch while capturing instead, once for every layer of the
same shape: the computation is then part of the graph and reruns on each replay, over the
buffers the replay refreshed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.contract.plan import Plan
from attnsdk.features.chunked import check_capture, prepared_chunks, virtual_metadata
from attnsdk.features.tree import TreePasses, tree_passes

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = [
    "FA3Plan",
    "LayerArgs",
    "Scheduler",
    "fa3_window",
    "plan_step",
    "step_scheduler",
    "step_tree",
    "step_virtual",
]


@dataclass(frozen=True, slots=True)
class FA3Plan(Plan):
    """``Plan`` plus what ``make_plan`` works out once per step for the prepared layer shapes
    (a captured plan fills ``scheduler`` and ``virtual`` while capturing instead: the graph
    reruns them on each replay)."""

    scheduler: dict[tuple[object, ...], torch.Tensor] = field(default_factory=dict)
    """(part, layer shape) -> FA3's scheduler metadata for that pass of the step."""
    virtual: dict[tuple[int, int], AttentionMetadata] = field(default_factory=dict)
    """(chunk size, page size) -> the step's virtual batch for chunked layers."""
    tree: dict[int, TreePasses] = field(default_factory=dict)
    """Page size -> a tree verify step's two passes (``attnsdk.features.tree``); empty otherwise."""


@dataclass(frozen=True, slots=True)
class LayerArgs:
    """Per (layer, layout) kernel arguments, worked out once (``FA3Backend.layer_state``)."""

    scale: float
    causal: bool
    window: tuple[int, int]
    softcap: float
    chunk: int | None
    """``LayerSpec.attention_chunk_size``: attend over the step's virtual batch."""
    quantized: bool
    q_dtype: torch.dtype
    """What the kernel multiplies in: the cache's fp8 dtype or the compute dtype."""
    page_size: int
    key: tuple[object, ...]
    """What FA3's scheduler metadata depends on besides the batch."""
    latent: int | None = None
    """An MLA layer's kv_lora_rank: q and the cache split there into ``qv`` / latent and
    q / rope (``KVCacheLayout.mla``)."""

    @classmethod
    def of(cls, layer: LayerSpec, layout: KVCacheLayout) -> LayerArgs:
        window = fa3_window(layer)
        return cls(
            scale=layer.softmax_scale,
            causal=layer.causal,
            window=window,
            softcap=float(layer.softcap or 0.0),
            chunk=layer.attention_chunk_size,
            quantized=layout.is_quantized,
            q_dtype=layout.storage_dtype,
            page_size=layout.page_size,
            key=(
                layer.num_heads,
                layer.num_kv_heads,
                layer.head_dim,
                layer.v_dim,
                layer.causal,
                window,
                layer.has_softcap,
                layout.storage_dtype,
                layout.page_size,
                layer.attention_chunk_size,
            ),
            latent=layer.kv_lora_rank,
        )

    @property
    def in_tree(self) -> bool:
        """Whether a layer of this shape runs in a tree step (causal, no window, no chunks)."""
        return self.causal and self.window == (-1, -1) and self.chunk is None


def fa3_window(layer: LayerSpec) -> tuple[int, int]:
    """FA3's (left, right) window of ``layer``; (-1, -1) without one."""
    wl = layer.window_left
    # Non-causal windows are symmetric (DESIGN §2); FA3 takes the right edge separately.
    return (wl, 0 if layer.causal else wl) if wl >= 0 else (-1, -1)


@dataclass(frozen=True, slots=True)
class Scheduler:
    """FA3's ``get_scheduler_metadata`` op with the split options every launch passes."""

    op: Callable[..., Any]
    num_splits: int
    pack_gqa: bool | None

    def make(
        self,
        meta: AttentionMetadata,
        layer: LayerSpec,
        st: LayerArgs,
        *,
        causal: bool,
        page_size: int,
    ) -> torch.Tensor:
        """One ``get_scheduler_metadata`` launch."""
        return self.op(
            meta.num_seqs, meta.max_query_len, meta.page_table.shape[1] * page_size,
            layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim, st.q_dtype,
            meta.seq_lens, meta.query_start_loc, None, None, None, None, page_size, 0,
            causal, st.window[0], st.window[1], 0, st.softcap > 0,
            self.num_splits, self.pack_gqa, 0,
        )  # fmt: skip

    def plan_layer(self, plan: FA3Plan, layer: LayerSpec, st: LayerArgs) -> None:
        """``plan``'s scheduler metadata for one prepared layer shape (none for MLA, as SGLang,
        nor for layers this step refuses)."""
        meta = plan.metadata
        if st.latent is not None or (meta.tree_mask is not None and not st.in_tree):
            return
        if meta.tree_mask is not None:
            passes = plan.tree.get(st.page_size)
            if passes is None:
                return
            parts = (("tree-context", passes.context, st.page_size),
                     ("tree-drafts", passes.drafts, 1))  # fmt: skip
            for part, pass_meta, page_size in parts:
                key = (part, *st.key)
                if key not in plan.scheduler:
                    plan.scheduler[key] = self.make(
                        pass_meta, layer, st, causal=False, page_size=page_size
                    )
            return
        step = meta if st.chunk is None else plan.virtual.get((st.chunk, st.page_size))
        key = ("step", *st.key)
        if step is not None and key not in plan.scheduler:
            plan.scheduler[key] = self.make(
                step, layer, st, causal=st.causal, page_size=st.page_size
            )


def plan_step(
    meta: AttentionMetadata,
    states: Mapping[tuple[LayerSpec, KVCacheLayout], LayerArgs],
    scheduler: Scheduler | None,
) -> FA3Plan:
    """``make_plan``: a tree step's two passes (per page size), chunked layers' virtual
    batches, and FA3's scheduler metadata per layer shape, for the layer shapes of ``states``
    (the backend's prepared ones)."""
    plan = FA3Plan(meta)
    if meta.tree_mask is not None:
        # The draft pass reads through the page table, in the cache's pages: the recorded
        # page size, else the prepared layouts'.
        sizes = {meta.page_size} if meta.page_size else {lay.page_size for _, lay in states}
        for page_size in sizes:
            plan.tree[page_size] = tree_passes(meta, page_size)
    elif not meta.cross_attention:  # chunked layers are refused in tree and cross steps
        for chunk, page_size in prepared_chunks(states, meta):
            plan.virtual[(chunk, page_size)] = virtual_metadata(meta, chunk, page_size)
    # A step with no sequence launches nothing (``forward`` returns first), and FA3's scheduler
    # op fails on a batch of 0 by ending the process: no scheduler metadata for it.
    if scheduler is not None and meta.num_seqs > 0:
        for (layer, _), st in states.items():
            scheduler.plan_layer(plan, layer, st)
    return plan


def step_scheduler(
    scheduler: Scheduler | None,
    plan: Plan,
    meta: AttentionMetadata,
    layer: LayerSpec,
    st: LayerArgs,
    *,
    causal: bool,
    page_size: int,
    part: str = "step",
) -> torch.Tensor | None:
    """FA3 scheduler metadata for ``meta`` (the step, or one ``part`` of it: a tree pass)
    and this layer shape: ``make_plan``'s for a prepared layer of an eager plan; None
    (FA3 then works it out inside the call) without precomputation (``scheduler`` None), for
    MLA layers (as SGLang), for any layer not prepared, and for eager calls on a captured
    plan. A captured plan makes it while capturing, once for every layer of the same shape
    (module docstring)."""
    if scheduler is None or st.latent is not None or not isinstance(plan, FA3Plan):
        return None
    key = (part, *st.key)
    if plan.graph is None:
        return plan.scheduler.get(key)
    if not _capturing(meta.device) or meta.num_seqs == 0:
        return None
    found = plan.scheduler.get(key)
    if found is None:
        found = plan.scheduler[key] = scheduler.make(
            meta, layer, st, causal=causal, page_size=page_size
        )
    return found


def step_tree(plan: Plan, page_size: int) -> TreePasses:
    """The tree step's passes over pages of ``page_size``: ``make_plan``'s for a prepared
    layout, else made for this call."""
    found = plan.tree.get(page_size) if isinstance(plan, FA3Plan) else None
    return found if found is not None else tree_passes(plan.metadata, page_size)


def step_virtual(plan: Plan, chunk: int, page_size: int) -> AttentionMetadata:
    """The step's virtual batch for chunks of ``chunk`` tokens: ``make_plan``'s for a
    prepared layer, else made for this call. A captured plan (a decode graph) makes it
    while capturing, once for every layer, inside the graph: each replay then rebuilds it
    from the buffers it refreshed."""
    meta = plan.metadata
    if plan.graph is not None:
        check_capture(meta)
    store = plan.virtual if isinstance(plan, FA3Plan) else None
    key = (chunk, page_size)
    if store is not None and (plan.graph is None or _capturing(meta.device)):
        found = store.get(key)
        if found is None and plan.graph is not None:
            found = store[key] = virtual_metadata(meta, chunk, page_size)
        if found is not None:
            return found
    return virtual_metadata(meta, chunk, page_size)


def _capturing(device: torch.device) -> bool:
    """Whether the current stream is capturing a CUDA graph (a CPU-only torch raises when
    asked, so only CUDA devices ask)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

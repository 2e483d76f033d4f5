"""The ``Backend`` protocol every attention backend implements, and the checks they share.

Shape legend (every argument below refers to it): B sequences, T query-token rows (>= the real
``num_tokens`` under CUDA-graph padding), Hq query heads, Hkv KV heads, D QK head dim, Dv V head
dim, P page size, N pages, W page-table width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict

from attnsdk.contract.errors import (
    InvalidInputError,
    InvalidMetadataError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.kv import KVCache
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.contract.plan import Plan

if TYPE_CHECKING:
    from collections.abc import Iterable

    from attnsdk.contract.capabilities import Capabilities, Feature, Request
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.plan import GraphBuffers

__all__ = [
    "BACKEND_MEMBERS",
    "Backend",
    "BackendClass",
    "EnvironmentProbe",
    "NoOptions",
    "check_forward_args",
    "check_no_grad",
    "check_plan",
    "check_tensor",
    "missing_members",
]


@runtime_checkable
class Backend(Protocol):
    """A paged-attention implementation: every member attnsdk calls. ``create_backend``
    returns one; ``BackendBase`` implements each with a documented default, so an author
    writes only ``attend`` (and ``attend_ragged``, ``layer_state``, ``make_plan`` where needed).

    Lifecycle: ``prepare(layers, layout)`` once per model (and ``warmup()`` to compile its
    kernels), then per step ``plan(meta)`` once (outside CUDA-graph capture, no device sync)
    and ``forward`` once per layer with that plan (``forward_ragged`` for K/V given in the
    call). Under CUDA graphs: ``graph_state`` once, ``plan_for_capture`` per captured batch
    size, ``plan_for_replay`` before each replay.
    """

    @property
    def name(self) -> str:
        """The registry name ("fa3")."""
        ...

    @property
    def capabilities(self) -> Capabilities:
        """What it can serve, as data."""
        ...

    def unsupported_reasons(
        self,
        layer: LayerSpec | None = None,
        layout: KVCacheLayout | None = None,
        device: torch.device | str | None = None,
        *,
        uses: Iterable[Feature] = (),
        dtype: torch.dtype | None = None,
    ) -> list[Reason]:
        """Every reason this backend cannot serve ``layer`` over ``layout`` on ``device`` with
        the step features ``uses`` (``lse=``, ``forward_ragged``, tree and cross-attention
        steps; ``dtype``: q's, for a ragged call); [] if it can. Environment first."""
        ...

    def prepare(
        self,
        layers: Iterable[LayerSpec],
        layout: KVCacheLayout,
        device: torch.device | str | None = None,
    ) -> None:
        """Declare the model: check every layer (``UnsupportedConfigError`` naming each layer it
        cannot serve) and work out what it needs per layer shape, before the first step."""
        ...

    def warmup(self, device: torch.device | str | None = None, num_pages: int = 8) -> None:
        """Compile or load the kernels the prepared layers need (small scratch steps)."""
        ...

    def plan(self, meta: AttentionMetadata) -> Plan:
        """Per-step precomputation shared by all layers. No device sync."""
        ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        cache: KVCache,
        plan: Plan,
        layer: LayerSpec,
        *,
        sinks: torch.Tensor | None = None,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write new K/V into ``cache`` at ``slot_mapping``, then attend.

        q: (T, Hq, D). k: (T, Hkv, D) and v: (T, Hkv, Dv), or both None when the caller has
        already written them. An MLA layer (``layer.mla``) takes k (T, 1, D) alone, latent
        then rope, and v None: V is the latent part of the cache. sinks: (Hq,) fp32 when
        ``layer.has_sinks``. k_scale / v_scale: fp32 () / (1,) / (Hkv,) for fp8 caches.
        out: optional (T, Hq, Dv) destination. lse: optional (T, Hq) fp32 contiguous
        destination of each row's natural-log log-sum-exp (docs/kv_layout.md, "The
        log-sum-exp"); a backend without ``Feature.LSE`` refuses it before writing anything.
        Returns (T, Hq, Dv) in q's dtype; rows past ``num_tokens`` (of the output and of
        ``lse``) are unspecified.
        """
        ...

    def forward_ragged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: Plan,
        layer: LayerSpec,
        *,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention over K/V given in the call (no cache; ``attnsdk.features.ragged``):
        q (T, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), sequence b's keys at rows
        ``key_start_loc[b]:key_start_loc[b+1]``. A backend without ``Feature.RAGGED`` refuses
        it, typed, before reading anything."""
        ...

    def graph_state(
        self,
        max_batch: int,
        max_tokens: int,
        max_pages: int,
        *,
        page_size: int,
        device: torch.device | str,
    ) -> GraphBuffers:
        """Allocate the static buffers that captured plans view (once, before capture)."""
        ...

    def plan_for_capture(
        self,
        state: GraphBuffers,
        batch_size: int,
        num_tokens: int,
        *,
        max_query_len: int | None = None,
    ) -> Plan:
        """A plan whose tensors are basic-slice views of ``state``, for capturing ``batch_size``.

        ``max_query_len`` bounds every replayed row's query length (see
        ``GraphBuffers.capture_metadata``); uniform graphs pass their tokens per row.
        """
        ...

    def plan_for_replay(self, plan: Plan, meta: AttentionMetadata) -> None:
        """Copy ``meta`` (B <= captured batch) into a captured plan's buffers, padding the rest.

        No allocation, no device sync, no advanced indexing into the static buffers.
        """
        ...

    def sync_check(self, device: torch.device) -> None:
        """Raise now, with a device sync, any error the backend's device code recorded (debug
        mode calls it after every forward); a backend without device-side checks does
        nothing."""
        ...


BACKEND_MEMBERS = (
    "name",
    "capabilities",
    "unsupported_reasons",
    "prepare",
    "warmup",
    "plan",
    "forward",
    "forward_ragged",
    "graph_state",
    "plan_for_capture",
    "plan_for_replay",
    "sync_check",
)
"""Every member of ``Backend``, in its order (tests/core/test_public_api.py pins it)."""


def missing_members(obj: object) -> list[str]:
    """The members of ``Backend`` that ``obj`` lacks: [] for a complete backend. The registry
    checks what a factory returns with it, naming what is missing."""
    return [m for m in BACKEND_MEMBERS if not hasattr(obj, m)]


def check_forward_args(
    q: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    cache: KVCache,
    plan: Plan,
    layer: LayerSpec,
    *,
    sinks: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
) -> None:
    """Host-only checks of ``Backend.forward`` arguments (shape, dtype, device); no sync.

    Raises ``InvalidInputError`` naming the argument before anything is written.
    """
    check_plan(plan)
    check_no_grad(q=q, k=k, v=v, sinks=sinks, k_scale=k_scale, v_scale=v_scale)
    if not isinstance(cache, KVCache):
        raise InvalidInputError(
            "cache", "a KVCache (KVCacheLayout.allocate or .wrap)", _kind(cache)
        )
    if not isinstance(layer, LayerSpec):
        raise InvalidInputError("layer", "a LayerSpec", _kind(layer))
    layout = cache.layout
    meta = plan.metadata
    if meta.page_size is not None and meta.page_size != layout.page_size:
        raise InvalidInputError(
            "plan.metadata.page_size",
            f"{layout.page_size}, the cache's page size",
            meta.page_size,
            "The page table and slots were built for another page size",
        )
    # Metadata without a page size (vLLM's) could not be checked against the page table's
    # width in plan(); the cache's page size settles it here, before anything is written.
    needed = -(-meta.max_seq_len // layout.page_size)
    if meta.page_table.dim() == 2 and meta.page_table.shape[1] < needed:
        raise InvalidMetadataError(
            "page_table",
            f"at least {needed} columns for max_seq_len={meta.max_seq_len} at the cache's page "
            f"size {layout.page_size}",
            meta.page_table.shape[1],
        )
    hq, hkv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim
    if (layout.num_kv_heads, layout.head_dim, layout.v_dim) != (hkv, d, dv):
        raise InvalidInputError(
            "layer",
            f"num_kv_heads/head_dim/v_head_dim = {(layout.num_kv_heads, layout.head_dim, layout.v_dim)}"
            " like the cache layout",
            (hkv, d, dv),
        )
    if layer.mla != layout.mla:
        raise InvalidInputError(
            "layer.mla", f"{layout.mla} like the cache layout", layer.mla, _MLA_HINT
        )
    check_tensor("q", q, (None, hq, d), layout.dtype, cache.device)
    rows = q.shape[0]
    if rows < meta.num_tokens:
        raise InvalidInputError("q.shape[0]", f">= num_tokens={meta.num_tokens}", rows)
    if layout.mla:
        for name, given in (("v", v), ("v_scale", v_scale)):
            if given is not None:
                raise InvalidInputError(
                    name,
                    "None for an MLA layer: V is the first kv_lora_rank dims of k "
                    "(and k_scale covers both)",
                    "a tensor",
                )
    elif (k is None) != (v is None):
        raise InvalidInputError("k/v", "both tensors or both None", "only one of them")
    if k is not None:
        check_tensor("k", k, (rows, hkv, d), layout.dtype, cache.device)
        if v is not None:
            check_tensor("v", v, (rows, hkv, dv), layout.dtype, cache.device)
        if meta.slot_mapping.shape[0] < meta.num_tokens:
            raise InvalidInputError(
                "plan.metadata.slot_mapping",
                f">= {meta.num_tokens} entries",
                meta.slot_mapping.shape[0],
            )
    if out is not None:
        check_tensor("out", out, (rows, hq, dv), layout.dtype, cache.device)
    if lse is not None:
        check_tensor("lse", lse, (rows, hq), torch.float32, cache.device)
        # Kernels write (T, Hq) rows in place, and a CUDA graph keeps the pointer it captured.
        if not lse.is_contiguous():
            raise InvalidInputError(
                "lse.stride()",
                f"contiguous strides ({hq}, 1)",
                lse.stride(),
                "Allocate it with torch.empty(T, Hq, dtype=torch.float32)",
            )
    if layer.has_sinks:
        if sinks is None:
            raise InvalidInputError(
                "sinks", f"an fp32 tensor of shape ({hq},) (layer.has_sinks)", None
            )
        check_tensor("sinks", sinks, (hq,), torch.float32, cache.device)
    elif sinks is not None:
        raise InvalidInputError("sinks", "None (layer.has_sinks is False)", tuple(sinks.shape))
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if not isinstance(scale, torch.Tensor):
            raise InvalidInputError(name, "an fp32 tensor or None", type(scale).__name__)
        if not layout.is_quantized:
            raise InvalidInputError(
                name, f"None for a {layout.storage_dtype} cache", tuple(scale.shape)
            )
        if scale.numel() not in (1, hkv) or scale.dim() > 1:
            raise InvalidInputError(name, f"shape (), (1,) or ({hkv},)", tuple(scale.shape))
        if scale.dtype != torch.float32:
            raise InvalidInputError(f"{name}.dtype", "torch.float32", scale.dtype)
        if scale.device != cache.device:
            raise InvalidInputError(f"{name}.device", str(cache.device), scale.device)
    if meta.device != cache.device:
        raise InvalidInputError("plan.metadata.device", str(cache.device), meta.device)


def check_no_grad(**tensors: object) -> None:
    """Refuse a call that would need gradients: grad mode on and an input that requires grad.

    attnsdk's backends compute inference attention only (their kernels and the reference's
    in-place score updates have no backward), so such a call would give a loss that looks
    right and gradients that are NaN or missing. Refused before anything is written, with
    every input that asks for a gradient named.
    """
    if not torch.is_grad_enabled():
        return
    wanting = [
        name for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad
    ]
    if wanting:
        raise UnsupportedConfigError(
            "attnsdk backends serve inference only; this call would need gradients:",
            [
                Reason(
                    ReasonKind.CONFIGURATION,
                    f"{name}.requires_grad",
                    "must be False, or grad mode off: run under torch.no_grad() or "
                    "torch.inference_mode() (for training use another attention "
                    "implementation, e.g. attn_implementation='sdpa' in transformers)",
                )
                for name in wanting
            ],
        )


def check_plan(plan: object) -> None:
    """``plan`` is a ``Plan`` holding an ``AttentionMetadata`` (the metadata itself is named)."""
    if not isinstance(plan, Plan):
        hint = (
            "Pass backend.plan(metadata), made once per step, not the metadata itself"
            if isinstance(plan, AttentionMetadata)
            else ""
        )
        raise InvalidInputError("plan", "a Plan from backend.plan(metadata)", _kind(plan), hint)
    if not isinstance(plan.metadata, AttentionMetadata):
        raise InvalidInputError(
            "plan.metadata",
            "an AttentionMetadata (plans come from backend.plan)",
            _kind(plan.metadata),
        )


_MLA_HINT = "Build both with LayerSpec.for_mla and KVCacheLayout.for_mla"


def _kind(value: object) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def check_tensor(
    name: str,
    t: object,
    shape: tuple[int | None, ...],
    dtype: torch.dtype,
    device: torch.device,
    *,
    dtype_of: str = "",
    device_of: str = "the cache's",
) -> None:
    """``t`` is a tensor of ``shape`` (None: any length, shown as T), ``dtype`` and ``device``;
    else ``InvalidInputError`` naming ``name``. ``dtype_of`` / ``device_of`` say whose dtype
    and device those are, for the message."""
    if not isinstance(t, torch.Tensor):
        raise InvalidInputError(name, "a torch.Tensor", type(t).__name__)
    if t.dim() != len(shape) or any(e is not None and e != f for e, f in zip(shape, t.shape)):
        legend = tuple("T" if e is None else e for e in shape)
        raise InvalidInputError(f"{name}.shape", str(legend), tuple(t.shape))
    if t.dtype != dtype:
        expected = f"{dtype} ({dtype_of} dtype)" if dtype_of else str(dtype)
        raise InvalidInputError(f"{name}.dtype", expected, t.dtype)
    if t.device != device:
        raise InvalidInputError(f"{name}.device", f"{device_of} device {device}", t.device)


class NoOptions(BaseModel):
    """Options model of a backend that takes none."""

    model_config = ConfigDict(frozen=True, extra="forbid")


@runtime_checkable
class EnvironmentProbe(Protocol):
    """A factory that says, without creating anything or importing a kernel library, why its
    backend cannot run on a device. The registry asks it before creating a backend; a plain
    factory function need not have it (its backend then answers once created)."""

    def environment_reasons(self, device: torch.device | str | None = None) -> list[Reason]: ...


@runtime_checkable
class BackendClass(Protocol):
    """What the registry reads from a backend class without creating it.

    ``BackendBase`` subclasses satisfy it; a plain factory function registered with
    ``register_backend`` need not (the registry then asks the created backend instead).
    """

    name: str
    priority: int
    Options: type[BaseModel]

    def __call__(self, options: Any) -> Backend: ...

    def environment_reasons(self, device: torch.device | str | None = None) -> list[Reason]:
        """Why it cannot run on ``device`` at all (not installed, wrong GPU). Imports nothing."""
        ...

    def refusals(self, request: Request) -> list[Reason]:
        """Every reason it cannot serve ``request`` (its options: ``request.options``, None for
        the defaults), environment first."""
        ...

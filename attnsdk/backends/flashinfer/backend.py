"""``flashinfer``: FlashInfer paged attention (compute capability 8.0 and newer).

Each step is planned once per kernel variant, never per layer: a *variant* is what a FlashInfer
wrapper is planned for (heads, head dims, scale, mask, window, softcap, sinks, dtypes, page size
and order), and ``make_plan`` plans one wrapper per variant of the prepared layers. A step whose
rows all hold at most one query token runs the tensor-core decode wrapper
(``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True)``); any other step (extend,
prefill, mixed) runs the paged prefill wrapper with ``qo_indptr``. Layers with attention sinks
run FlashInfer's sink wrappers (the plain wrappers ignore ``sinks=`` on their fa2/fa3 paths).

FlashInfer reads pages in CSR form (``indptr``, ``indices``, ``last_page_len``). ``build_csr``
derives it from the metadata's host twins; only ``indices`` needs the device page table, and it
is gathered there with one ``index_select`` whose size is known on the host, so planning never
syncs the device. The decode form has one CSR row per query token row, so zero-length rows drop
out and the decode wrapper's row ``i`` is query row ``i``.

``lse=``: every wrapper fills the caller's buffer (``run(..., lse=, return_lse=True)``) with
FlashInfer's base-2 log-sum-exp, scaled by ln 2 in place afterwards; the sink wrappers fold the
sink logit into each row's running max and sum (``AttentionSink``'s ``REGISTER_M_D_UPDATE``), so
it is in the value already.

Chunked local attention (``LayerSpec.attention_chunk_size``): FlashInfer has no chunk mask, so a
chunked variant's wrapper is planned over the step's virtual batch (``attnsdk.features.chunked``: one
sequence per chunk a sequence's queries touch, made once per step and chunk size) with its
own CSR. The chunk size must be a multiple of the page size. CUDA graphs capture chunked
variants in decode graphs only, where the virtual batch keeps one row per sequence.

MLA (``LayerSpec.mla``, kv_lora_rank 512 + rope 64): every step of an MLA layer runs
``BatchMLAPagedAttentionWrapper`` over the latent cache as one packed (N, P, 576) tensor and q
as (T, Hq, 576), planned per sequence with each row's KV length and the natural-log
log-sum-exp always on (its lse mode is fixed at plan time; without ``lse=`` it goes to a scratch
buffer). FlashInfer's MLA ``plan()`` reads the range of the page ids, which live on the device:
one device sync per step, not per layer. CUDA graphs capture MLA layers in uniform graphs only
(every row the same query length: decode, verify): the kernel's cluster size, fixed at
capture, follows the average query length.

fp8 KV (e4m3 / e5m2, bf16 or fp16 q): FlashInfer would take ``k_scale`` / ``v_scale`` as host
floats (a device read per layer). Instead q is multiplied by ``k_scale`` before the kernel and
the output by ``v_scale`` after it, on the device, which also serves per-KV-head scales. An
MLA layer's e4m3 latent (Hopper only, bf16 q) is read the same way with its one scale.

Importing this module imports no kernel library; ``FlashInferBackend(...)`` imports flashinfer.
"""

from __future__ import annotations

import importlib
import math
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
from pydantic import BaseModel, ConfigDict, Field

from attnsdk.backends.flashinfer.csr import PagedCSR, build_csr, gather_indices
from attnsdk.backends.gpu import DeviceStoreBackend, mla_kernel_reasons
from attnsdk.contract.capabilities import (
    Capabilities,
    Feature,
    GraphSupport,
    device_reasons,
    is_mla,
)
from attnsdk.contract.device import compute_capability
from attnsdk.contract.errors import (
    BackendUnavailableError,
    InvalidInputError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.kv import KVOrder
from attnsdk.contract.plan import GraphBuffers, Plan
from attnsdk.features.chunked import check_capture, chunk_reasons, virtual_metadata
from attnsdk.kernels.probes import module_present

if TYPE_CHECKING:
    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = [
    "INSTALL_COMMAND",
    "FlashInferBackend",
    "FlashInferOptions",
    "FlashInferPlan",
    "PagedCSR",
    "build_csr",
    "gather_indices",
]

INSTALL_COMMAND = "pip install flashinfer-python"
"""What error messages name. From a checkout, ``pip install -e "/path/to/attnsdk[flashinfer]"``
installs the same package (attnsdk itself is not on the package index)."""

_CFG = ReasonKind.CONFIGURATION
_FP8 = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
_CUDA_CORE_GROUPS = frozenset({1, 2, 3, 4, 6, 8, 16})
"""Query heads per KV head that FlashInfer's CUDA-core decode kernel is compiled for."""
_HEAD_DIMS = frozenset({64, 128, 256})
"""Head dims FlashInfer's kernels dispatch, its split-KV merge included."""
_LN2 = math.log(2.0)
"""FlashInfer's log-sum-exp is log2 of the softmax denominator; attnsdk's is the natural log."""

Kind = Literal["decode", "prefill", "mla"]


class FlashInferOptions(BaseModel):
    """Options of the ``flashinfer`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode: Literal["tensor_cores", "cuda_cores"] = "tensor_cores"
    """Kernel of decode steps. Tensor cores read 98% of the H200's copy bandwidth at batch 64 x
    4k, CUDA cores 66% (docs/backends.md); sink layers always use tensor cores."""
    prefill_backend: Literal["fa2", "auto"] = "fa2"
    """FlashInfer backend of the prefill wrapper. "auto" lets FlashInfer pick FA3 on Hopper for
    long queries (its sm90 module takes minutes to compile); fp8-KV and sink layers stay on fa2,
    whose kernels take a bf16 / fp16 query with an fp8 cache."""
    mla_backend: Literal["auto", "fa3", "fa2"] = "auto"
    """FlashInfer backend of the MLA wrapper (``LayerSpec.mla`` layers): "auto" takes its fa3
    variant on Hopper and fa2 elsewhere (each JIT-compiled on first use), "fa3" insists on
    Hopper's, "fa2" runs on any GPU of sm 8.0 or newer."""
    workspace_mib: int = Field(default=128, ge=16, le=4096)
    """Float workspace (split-KV partial results) per device, shared by every wrapper."""


@dataclass(frozen=True, slots=True)
class _Variant:
    """What one FlashInfer wrapper is planned for; the backend's per-layer state."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_dim: int
    scale: float
    causal: bool
    window_left: int
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

    @property
    def quantized(self) -> bool:
        return self.kv_dtype in _FP8


@dataclass(frozen=True, slots=True)
class _Ragged:
    """What a ragged wrapper (``BatchPrefillWithRaggedKVCacheWrapper``) is planned for."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_dim: int
    scale: float
    causal: bool
    window_left: int
    softcap: float
    dtype: torch.dtype


# -- plans and graph state ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _StepCSR:
    """A CSR form of one step on the device, shared by every variant planned in it."""

    host: PagedCSR
    indices: torch.Tensor
    """(nnz,) int32 on the device (a prefix of a static buffer in a captured plan)."""


class _RaggedPlans(dict[_Ragged, Any]):
    """One plan's ragged wrappers (variant -> its planned wrapper). A dict the backend can hold
    a weak reference to: a pooled wrapper whose plan is gone is free for the next plan."""


_RAGGED_POOL = 8
"""Ragged wrappers per variant and device. A step may keep several ragged plans alive at once
and use them in turn (SGLang's chunked prefix: one per prefix chunk, every layer running chunk
0, 1, ...); each needs a wrapper of its own. Past this many live plans the least recently
planned wrapper is taken over and its plan re-plans on its next use: correct, one plan() more."""


@dataclass(frozen=True, slots=True)
class FlashInferPlan(Plan):
    """``Plan`` plus what FlashInfer was planned with in this step.

    ``wrappers`` maps each variant planned in this step to its planned wrapper; a layer whose
    variant is missing (``forward`` before ``prepare``) is planned on its first use, which costs
    one FlashInfer ``plan()`` (~390 µs of host time) in that step.
    """

    csr: dict[tuple[bool, int, int | None], _StepCSR] = field(default_factory=dict)
    """(per_token, page_size, chunk size) -> the step's CSR on the device."""
    wrappers: dict[_Variant, tuple[Any, Kind]] = field(default_factory=dict)
    ragged: _RaggedPlans = field(default_factory=_RaggedPlans)
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
        self.wrappers: dict[tuple[int, int, Kind, _Variant], Any] = {}
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


# -- the backend --------------------------------------------------------------------------------


class FlashInferBackend(DeviceStoreBackend):
    """FlashInfer's paged prefill and tensor-core decode wrappers. See the module docstring."""

    name = "flashinfer"
    priority = 90
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kv_dtypes=_FP8,
        max_head_dim=256,
        head_dim_multiple=16,
        orders=frozenset(KVOrder),
        min_compute_capability=(8, 0),
        features=frozenset(Feature) - {Feature.TREE_MASK, Feature.CROSS_ATTENTION},
        graph_support=GraphSupport.ANY_BATCH,
        mla_dims=frozenset({(512, 64)}),
    )
    Options = FlashInferOptions
    plan_type = FlashInferPlan
    options: FlashInferOptions

    def __init__(self, options: FlashInferOptions | None = None) -> None:
        super().__init__(options)
        if not module_present("flashinfer"):
            raise BackendUnavailableError(
                "the flashinfer backend needs FlashInfer (the flashinfer module); it is not "
                "installed.",
                INSTALL_COMMAND,
            )
        self._fi: Any = importlib.import_module("flashinfer")
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._wrappers: dict[tuple[Kind, _Variant], Any] = {}
        self._ragged_pool: dict[tuple[_Ragged, torch.device], list[Any]] = {}
        """(variant, device) -> its ragged wrappers, least recently planned first."""
        self._ragged_owner: dict[int, weakref.ref[_RaggedPlans]] = {}
        self._owner: dict[int, FlashInferPlan] = {}
        self._planned_copy: dict[int, torch.cuda.Event] = {}
        self.plan_calls = 0
        """FlashInfer ``plan()`` calls so far (each ~390 µs of host time); tests and benchmarks
        read it to check one call per variant per step."""

    # -- what it can serve ------------------------------------------------------------------

    @classmethod
    def environment_reasons(cls, device: torch.device | str | None = None) -> list[Reason]:
        """Is FlashInfer installed, is there a CUDA device of sm 8.0 or newer? Imports nothing."""
        reasons = device_reasons(cls.capabilities, device)
        if not module_present("flashinfer"):
            reasons.append(
                Reason(
                    ReasonKind.ENVIRONMENT,
                    "install",
                    f"needs FlashInfer (module flashinfer), found none: {INSTALL_COMMAND}",
                )
            )
        return sorted(reasons)

    @classmethod
    def extra_reasons(cls, layer: LayerSpec | None, layout: KVCacheLayout | None) -> list[Reason]:
        """What FlashInfer's kernels cannot express, and chunk sizes that are not a multiple of
        the page size."""
        reasons = chunk_reasons(layer, layout)
        dims = {}
        if layer is not None:
            dims = {"head_dim": layer.head_dim, "v_head_dim": layer.v_dim}
        if layout is not None:
            dims = {"head_dim": layout.head_dim, "v_head_dim": layout.v_dim}
        if is_mla(layer, layout):
            return (
                reasons
                + mla_kernel_reasons(
                    layer,
                    layout,
                    "FlashInfer's MLA wrapper",
                    "FlashInfer's MLA wrapper reads an e4m3 latent only",
                    fp8_ok=frozenset({torch.float8_e4m3fn}),
                )
                + _fp8_mla_reasons(layout)
            )  # its dims: ``mla_dims``
        for name, d in dims.items():
            if d not in _HEAD_DIMS:
                # Measured on an H200: head_dim 80 compiles, then its split-KV merge kernel
                # raises "Unsupported head_dim" and leaves the CUDA context unusable.
                reasons.append(
                    Reason(
                        _CFG,
                        name,
                        f"must be one of {sorted(_HEAD_DIMS)} (FlashInfer's merge kernels), "
                        f"found {d}",
                    )
                )
        if layer is None:
            return reasons
        if not layer.causal and layer.sliding_window is not None:
            reasons.append(
                Reason(
                    _CFG,
                    "sliding_window",
                    "must be None when causal=False: FlashInfer's fa2 kernels have a left "
                    "window only (window_left), not the symmetric non-causal window",
                )
            )
        if layer.has_sinks and layer.has_softcap:
            reasons.append(
                Reason(
                    _CFG,
                    "softcap",
                    "must be None with has_sinks=True: FlashInfer's attention-sink variant "
                    "applies no logits soft cap",
                )
            )
        return reasons

    @classmethod
    def option_reasons(
        cls,
        options: FlashInferOptions,
        layer: LayerSpec | None,
        layout: KVCacheLayout | None,
        device: torch.device,
    ) -> list[Reason]:
        """What the CUDA-core decode kernel (``decode="cuda_cores"``) is not compiled for."""
        cuda_cores = (
            layer is not None
            and options.decode == "cuda_cores"
            and not layer.has_sinks
            and layer.head_dim == layer.v_dim  # else the prefill wrapper decodes it
        )
        if device.type == "cuda" and is_mla(layer, layout):
            cc = compute_capability(device)
            if cc is not None and cc[0] != 9:
                if options.mla_backend == "fa3":
                    return [
                        Reason(
                            _CFG,
                            "mla_backend",
                            f"'fa3' needs a Hopper GPU (sm 9.x), found sm {cc[0]}.{cc[1]}: use "
                            "'auto' or 'fa2'",
                        )
                    ]
                if layout is not None and layout.is_quantized:
                    return [
                        Reason(
                            _CFG,
                            "kv_dtype",
                            f"an fp8 latent needs a Hopper GPU (sm 9.x) in FlashInfer's MLA "
                            f"wrapper, found sm {cc[0]}.{cc[1]}",
                        )
                    ]
        if not cuda_cores or layer is None or layer.group_size in _CUDA_CORE_GROUPS:
            return []
        return [
            Reason(
                _CFG,
                "num_heads",
                f"num_heads / num_kv_heads must be one of {sorted(_CUDA_CORE_GROUPS)} with "
                f"decode='cuda_cores'; use decode='tensor_cores', found {layer.group_size}",
            )
        ]

    def layer_state(self, layer: LayerSpec, layout: KVCacheLayout) -> _Variant:
        return _Variant(
            num_heads=layer.num_heads,
            num_kv_heads=layer.num_kv_heads,
            head_dim=layer.head_dim,
            v_dim=layer.v_dim,
            scale=layer.softmax_scale,
            causal=layer.causal,
            window_left=layer.window_left,
            chunk=layer.attention_chunk_size,
            softcap=float(layer.softcap or 0.0),
            sinks=layer.has_sinks,
            dtype=layout.dtype,
            kv_dtype=layout.storage_dtype,
            page_size=layout.page_size,
            order=layout.kv_order.value,
            mla=layout.mla,
        )

    def ragged_reasons(self, layer: LayerSpec, device: torch.device | str | None) -> list[Reason]:
        """``BackendBase``'s and what FlashInfer's ragged prefill cannot express: head dims
        outside its kernels (q / k also 192: DeepSeek's expanded prefill), sinks (its sink
        wrappers are paged) and chunked layers (a virtual batch needs a page table)."""
        reasons = super().ragged_reasons(layer, device) + self.environment_reasons(device)
        for name, d, dims in (
            ("head_dim", layer.head_dim, _HEAD_DIMS | {192}),
            ("v_head_dim", layer.v_dim, _HEAD_DIMS),
        ):
            if d not in dims:
                reasons.append(
                    Reason(_CFG, name, f"must be one of {sorted(dims)} in a ragged step, found {d}")
                )
        if not layer.causal and layer.sliding_window is not None:
            reasons.append(Reason(_CFG, "sliding_window", "must be None when causal=False"))
        for name, asked in (
            ("has_sinks", layer.has_sinks),
            ("attention_chunk_size", layer.attention_chunk_size is not None),
        ):
            if asked:
                reasons.append(Reason(_CFG, name, "is served in paged steps only"))
        return sorted(set(reasons))

    def warmup(self, device: torch.device | str | None = None, num_pages: int = 8) -> None:
        """``BackendBase.warmup`` (a prefill and a mixed step) plus one decode-only step per
        prepared layer, so the decode wrapper's module is loaded or compiled too."""
        super().warmup(device, num_pages)
        from attnsdk.contract.metadata import AttentionMetadata

        for layer, layout in self.prepared:
            dev = torch.device(device) if device is not None else torch.device("cuda")
            cache = layout.allocate(2, device=dev)
            meta = AttentionMetadata.from_seqlens([1], [1], [[1]], layout.page_size, device=dev)
            q = torch.zeros(1, layer.num_heads, layer.head_dim, dtype=layout.dtype, device=dev)
            k = torch.zeros(1, layer.num_kv_heads, layer.head_dim, dtype=layout.dtype, device=dev)
            v = None
            if not layout.mla:  # an MLA layer's V is the latent part of k
                v = torch.zeros(1, layer.num_kv_heads, layer.v_dim, dtype=layout.dtype, device=dev)
            sinks = torch.zeros(layer.num_heads, device=dev) if layer.has_sinks else None
            self.forward(q, k, v, cache, self.plan(meta), layer, sinks=sinks)
        if self.prepared and torch.device(device or "cuda").type == "cuda":
            torch.cuda.synchronize()

    # -- per step ---------------------------------------------------------------------------

    def make_plan(self, meta: AttentionMetadata) -> FlashInferPlan:
        plan = FlashInferPlan(meta)
        if meta.cross_attention:  # forward_ragged's alone (a paged forward refuses it)
            return plan
        for variant in self._variants(meta):
            self._plan_variant(plan, variant)
        return plan

    def _variants(self, meta: AttentionMetadata) -> list[_Variant]:
        """The variants of the layers seen so far (``prepare`` or ``forward``) that can run
        with this step's page table: of its page size, when it records one, and of a page size
        its width covers. Any other is planned (or refused) by the ``forward`` that needs it."""
        found = dict.fromkeys(self._layer_states.values())
        width, longest = meta.page_table.shape[1], meta.max_seq_len
        return [
            v
            for v in found
            if (meta.page_size is None or v.page_size == meta.page_size)
            and width * v.page_size >= longest
        ]

    def graph_state(
        self,
        max_batch: int,
        max_tokens: int,
        max_pages: int,
        *,
        page_size: int,
        device: torch.device | str,
    ) -> FlashInferGraphState:
        return FlashInferGraphState(
            max_batch, max_tokens, max_pages, page_size=page_size, device=device
        )

    def plan_for_capture(
        self,
        state: GraphBuffers,
        batch_size: int,
        num_tokens: int,
        *,
        max_query_len: int | None = None,
    ) -> FlashInferPlan:
        """A captured plan with every prepared variant planned on CUDA-graph wrappers.

        A capture whose rows hold one token each (``num_tokens == batch_size``) runs the decode
        wrapper; any other runs the prefill wrapper. Call ``prepare`` first: a variant cannot be
        planned during capture.
        """
        if not isinstance(state, FlashInferGraphState):
            raise InvalidInputError(
                "state", "the FlashInferGraphState of this backend's graph_state()", type(state)
            )
        meta = state.capture_metadata(batch_size, num_tokens, max_query_len=max_query_len)
        plan = FlashInferPlan(meta, graph=state)
        variants = self._variants(meta)
        if any(v.chunk is not None for v in variants):
            check_capture(meta)
        if any(v.mla for v in variants) and meta.max_query_len * batch_size != num_tokens:
            raise UnsupportedConfigError(
                "the flashinfer backend captures MLA layers in uniform graphs only:",
                [
                    Reason(
                        ReasonKind.BATCH,
                        "num_tokens",
                        f"must be batch_size * max_query_len = {batch_size} * "
                        f"{meta.max_query_len} for MLA (FlashInfer's MLA kernel fixes its "
                        f"cluster size, which follows the mean query length, at capture), "
                        f"found {num_tokens}",
                    )
                ],
            )
        for variant in variants:
            self._plan_variant(plan, variant)
        return plan

    def plan_for_replay(self, plan: Plan, meta: AttentionMetadata) -> None:
        """Copy ``meta`` into the captured buffers, then re-plan each captured wrapper (one
        FlashInfer ``plan()`` per variant, which writes into the wrapper's fixed buffers)."""
        captured = cast("FlashInferPlan", plan)
        if isinstance(plan, FlashInferPlan):
            _check_mla_cluster(captured, meta)
        super().plan_for_replay(plan, meta)  # refuses any plan but a captured FlashInferPlan
        captured.csr.clear()
        captured.virtual.clear()
        for variant in list(captured.wrappers):
            self._plan_variant(captured, variant)

    def _kind(self, plan: FlashInferPlan, variant: _Variant) -> Kind:
        meta = plan.metadata
        if variant.mla:
            return "mla"
        if variant.head_dim != variant.v_dim:
            return "prefill"  # FlashInfer's decode wrappers need head_dim == v_head_dim
        if plan.graph is not None:
            return "decode" if meta.max_query_len <= 1 else "prefill"
        q = meta.query_start_loc_cpu
        return "decode" if q.shape[0] < 2 or int((q[1:] - q[:-1]).max()) <= 1 else "prefill"

    def _step_meta(self, plan: FlashInferPlan, v: _Variant) -> AttentionMetadata:
        """The batch ``v`` is planned over: the step's, or for a chunked variant its virtual
        batch, made once per plan and chunk size."""
        if v.chunk is None:
            return plan.metadata
        if plan.graph is not None:
            check_capture(plan.metadata)  # a layer no capture planned for (not prepared)
        key = (v.chunk, v.page_size)
        found = plan.virtual.get(key)
        if found is None:
            found = plan.virtual[key] = virtual_metadata(plan.metadata, v.chunk, v.page_size)
        return found

    def _csr(self, plan: FlashInferPlan, per_token: bool, v: _Variant) -> _StepCSR:
        key = (per_token, v.page_size, v.chunk)
        found = plan.csr.get(key)
        if found is not None:
            return found
        meta = self._step_meta(plan, v)
        state = plan.graph
        rows = meta.num_tokens if per_token and state is not None else None
        host = build_csr(
            meta.query_start_loc_cpu,
            meta.seq_lens_cpu,
            v.page_size,
            meta.page_table.shape[1],
            per_token=per_token,
            rows=rows,
        )
        if isinstance(state, FlashInferGraphState):
            bufs = state.buffers(meta.num_seqs, meta.num_tokens, per_token, v.chunk)
            indices = gather_indices(
                meta.page_table, host, out=bufs["indices"], staging=bufs["rows"]
            )
        else:
            indices = gather_indices(meta.page_table, host)
        found = plan.csr[key] = _StepCSR(host, indices)
        return found

    def _plan_variant(self, plan: FlashInferPlan, variant: _Variant) -> tuple[Any, Kind]:
        """Plan (or re-plan) the wrapper of ``variant`` for this step: one FlashInfer plan()."""
        meta = plan.metadata
        kind = self._kind(plan, variant)
        if meta.num_seqs == 0 or meta.num_tokens == 0:
            plan.wrappers.pop(variant, None)
            return None, kind
        csr = self._csr(plan, kind == "decode", variant)
        wrapper = self._wrapper(plan, kind, variant)
        host, v = csr.host, variant
        common: dict[str, Any] = {
            "window_left": v.window_left,
            "logits_soft_cap": v.softcap or None,
            "sm_scale": v.scale,
            "q_data_type": v.dtype,
            "kv_data_type": v.kv_dtype,
            "o_data_type": v.dtype,
            "non_blocking": True,
        }
        self._wait_for_previous_plan(wrapper, meta.device)
        if kind == "mla":
            wrapper.plan(
                # Host lengths: a CUDA-graph wrapper copies them into its ``kv_len`` buffer.
                metadata=self._fi.mla.MLAPlanMetadata.csr(
                    host.qo_indptr, host.kv_indptr, csr.indices, meta.seq_lens_cpu.contiguous()
                ),
                num_heads=v.num_heads,
                head_dim_ckv=v.v_dim,
                head_dim_kpe=v.head_dim - v.v_dim,
                page_size=v.page_size,
                causal=v.causal,
                sm_scale=v.scale,
                q_data_type=v.dtype,
                kv_data_type=v.kv_dtype,
                lse_mode="basee",
            )
        elif kind == "decode":
            wrapper.plan(
                host.kv_indptr, csr.indices, host.last_page_len,
                v.num_heads, v.num_kv_heads, v.head_dim, v.page_size, **common,
            )  # fmt: skip
        else:
            wrapper.plan(
                host.qo_indptr, host.kv_indptr, csr.indices, host.last_page_len,
                v.num_heads, v.num_kv_heads, v.head_dim, v.page_size,
                head_dim_vo=v.v_dim, causal=v.causal, **common,
            )  # fmt: skip
        if meta.device.type == "cuda":
            done = self._planned_copy.get(id(wrapper))
            if done is None:
                done = self._planned_copy[id(wrapper)] = torch.cuda.Event()
            done.record(torch.cuda.current_stream(meta.device))
        self.plan_calls += 1
        self._owner[id(wrapper)] = plan
        plan.wrappers[variant] = (wrapper, kind)
        return wrapper, kind

    def _wait_for_previous_plan(self, wrapper: Any, device: torch.device) -> None:
        """FlashInfer's plan() writes its schedule into the wrapper's pinned host buffer and
        queues an asynchronous copy to the device without waiting for the previous one. Before
        the buffer is rewritten, the previous copy must have run: a non-blocking event query,
        which only waits (a sync) when the host is a whole step ahead of the device."""
        done = self._planned_copy.get(id(wrapper))
        if done is not None and device.type == "cuda" and not done.query():
            done.synchronize()

    def _workspace(self, device: torch.device) -> torch.Tensor:
        ws = self._workspaces.get(device)
        if ws is None:
            size = self.options.workspace_mib * 1024 * 1024
            ws = self._workspaces[device] = torch.zeros(size, dtype=torch.uint8, device=device)
        return ws

    def _wrapper(self, plan: FlashInferPlan, kind: Kind, v: _Variant) -> Any:
        """The wrapper of (kind, variant): one per backend, or one per capture in a graph."""
        meta = plan.metadata
        state = plan.graph
        if isinstance(state, FlashInferGraphState):
            key = (meta.num_seqs, meta.num_tokens, kind, v)
            found = state.wrappers.get(key)
            if found is None:
                bufs = state.buffers(meta.num_seqs, meta.num_tokens, kind == "decode", v.chunk)
                found = state.wrappers[key] = self._new_wrapper(kind, v, meta, bufs)
            return found
        found = self._wrappers.get((kind, v))
        if found is None:
            found = self._wrappers[(kind, v)] = self._new_wrapper(kind, v, meta, None)
        return found

    def _new_wrapper(
        self,
        kind: Kind,
        v: _Variant,
        meta: AttentionMetadata,
        bufs: dict[str, torch.Tensor] | None,
    ) -> Any:
        fi = self._fi
        ws = self._workspace(meta.device)
        if kind == "mla":
            mla_kw: dict[str, Any] = {}
            if bufs is not None:
                mla_kw = {
                    "use_cuda_graph": True,
                    "qo_indptr": bufs["qo_indptr"],
                    "kv_indptr": bufs["kv_indptr"],
                    "kv_indices": bufs["indices"],
                    "kv_len_arr": bufs["kv_len"],
                }
            backend = self.options.mla_backend
            if backend == "auto":
                # Chosen here, not by FlashInfer's "auto" policy, whose per-run dispatch
                # measured ~45 µs of host time per eager layer on the H200.
                cc = compute_capability(meta.device)
                backend = "fa3" if cc is not None and cc[0] == 9 else "fa2"
            return fi.BatchMLAPagedAttentionWrapper(ws, backend=backend, **mla_kw)
        fa2_only = v.sinks or v.quantized
        backend = "fa2" if fa2_only else self.options.prefill_backend
        sink_kw = {
            "q_data_type": v.dtype,
            "kv_data_type": v.kv_dtype,
            "head_dim_qk": v.head_dim,
            "head_dim_vo": v.v_dim,
            "window_left": v.window_left,
        }
        if kind == "decode":
            graph_kw: dict[str, Any] = {}
            if bufs is not None:
                graph_kw = {
                    "use_cuda_graph": True,
                    "paged_kv_indptr_buffer": bufs["kv_indptr"],
                    "paged_kv_indices_buffer": bufs["indices"],
                    "paged_kv_last_page_len_buffer": bufs["last_page_len"],
                }
            if v.sinks:
                return fi.BatchDecodeWithAttentionSinkWrapper(
                    ws, v.order, backend="fa2", **sink_kw, **graph_kw
                )
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                v.order,
                use_tensor_cores=self.options.decode == "tensor_cores",
                backend="fa2",
                **graph_kw,
            )
        graph_kw = {}
        if bufs is not None:
            graph_kw = {
                "use_cuda_graph": True,
                "qo_indptr_buf": bufs["qo_indptr"],
                "paged_kv_indptr_buf": bufs["kv_indptr"],
                "paged_kv_indices_buf": bufs["indices"],
                "paged_kv_last_page_len_buf": bufs["last_page_len"],
            }
        if v.sinks:
            return fi.BatchAttentionWithAttentionSinkWrapper(
                ws, v.order, backend="fa2", **sink_kw, **graph_kw
            )
        if bufs is not None:
            graph_kw["max_total_num_rows"] = meta.num_tokens
        return fi.BatchPrefillWithPagedKVCacheWrapper(ws, v.order, backend=backend, **graph_kw)

    # -- per layer --------------------------------------------------------------------------

    def attend(
        self,
        q: torch.Tensor,
        cache: KVCache,
        plan: Plan,
        layer: LayerSpec,
        state: _Variant,
        *,
        sinks: torch.Tensor | None,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> torch.Tensor:
        if not isinstance(plan, FlashInferPlan):
            raise InvalidInputError(
                "plan", "a FlashInferPlan from this backend's plan()", type(plan).__name__
            )
        meta = plan.metadata
        if meta.num_seqs == 0 or meta.num_tokens == 0:
            return out
        variant = state
        planned = plan.wrappers.get(variant)
        if planned is None or self._owner.get(id(planned[0])) is not plan:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise InvalidInputError(
                    "layer",
                    "a layer shape planned before capture",
                    f"{layer} (not in backend.prepared when plan_for_capture ran)",
                    "Call backend.prepare(layers, layout) before plan_for_capture",
                )
            planned = self._plan_variant(plan, variant)
        wrapper, kind = planned
        csr = plan.csr[(kind == "decode", variant.page_size, variant.chunk)].host
        if kind == "mla":
            return self._attend_mla(
                wrapper, q, cache, csr.num_q_rows, out, lse, plan.graph,
                variant.quantized, k_scale if variant.quantized else None,
            )  # fmt: skip
        rows = csr.num_q_rows if kind == "prefill" else csr.num_rows
        q = q[:rows]
        if q.stride(-1) != 1 or not q.is_contiguous():
            q = q.contiguous()
        dest = out[:rows]
        o = dest if dest.is_contiguous() else torch.empty_like(dest)
        if variant.quantized and k_scale is not None:
            q = _per_kv_head(q, k_scale, variant.num_kv_heads).to(q.dtype)
        kv = (cache.k, cache.v)
        # A prefix of the caller's contiguous (T, Hq) buffer is contiguous: written in place.
        lse_rows = None if lse is None else lse[:rows]
        with_lse = {} if lse_rows is None else {"lse": lse_rows, "return_lse": True}
        if variant.sinks:
            wrapper.run(q, kv, sinks, variant.scale, out=o, **with_lse)
        else:
            wrapper.run(q, kv, out=o, **with_lse)
        if lse_rows is not None:
            lse_rows.mul_(_LN2)
        if variant.quantized and v_scale is not None:
            o.copy_(_per_kv_head(o, v_scale, variant.num_kv_heads))
        if o is not dest:
            dest.copy_(o)
        return out

    def attend_ragged(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        plan: Plan,
        layer: LayerSpec,
        key_start_loc: torch.Tensor,
        *,
        sinks: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> torch.Tensor:
        """``BatchPrefillWithRaggedKVCacheWrapper``, planned once per plan and ragged variant
        from the host twins (its indptrs: no sync; ``key_start_loc`` is not read). Each live
        plan holds a wrapper of its own from a small pool (``_RAGGED_POOL``), so plans used in
        turn (one per prefix chunk, every layer) never run on another plan's schedule."""
        if not isinstance(plan, FlashInferPlan):
            raise InvalidInputError(
                "plan", "a FlashInferPlan from this backend's plan()", type(plan).__name__
            )
        meta = plan.metadata
        rows = meta.num_tokens
        if meta.num_seqs == 0 or rows == 0:
            return out
        variant = _Ragged(
            layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim,
            layer.softmax_scale, layer.causal, layer.window_left, float(layer.softcap or 0.0),
            q.dtype,
        )  # fmt: skip
        wrapper = plan.ragged.get(variant)
        if wrapper is None or self._ragged_plans_of(wrapper) is not plan.ragged:
            wrapper = plan.ragged[variant] = self._plan_ragged(plan, variant)
        q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q[:rows], k, v))
        dest = out[:rows]
        o = dest if dest.is_contiguous() else torch.empty_like(dest)
        lse_rows = None if lse is None else lse[:rows]
        with_lse = {} if lse_rows is None else {"lse": lse_rows, "return_lse": True}
        wrapper.run(q, k, v, out=o, **with_lse)
        if lse_rows is not None:
            lse_rows.mul_(_LN2)
        if o is not dest:
            dest.copy_(o)
        return out

    def _ragged_plans_of(self, wrapper: Any) -> _RaggedPlans | None:
        """The live plan's wrappers ``wrapper`` was last planned for; None when that plan is
        gone (or it never was planned)."""
        owner = self._ragged_owner.get(id(wrapper))
        return None if owner is None else owner()

    def _plan_ragged(self, plan: FlashInferPlan, v: _Ragged) -> Any:
        """A ragged wrapper of ``v`` planned for ``plan`` (one FlashInfer plan(), host
        indptrs): a pooled one no live plan owns, a new one while the pool has room, else the
        least recently planned one (its plan re-plans when it next runs)."""
        meta = plan.metadata
        pool = self._ragged_pool.setdefault((v, meta.device), [])
        wrapper = next((w for w in pool if self._ragged_plans_of(w) is None), None)
        if wrapper is None and len(pool) < _RAGGED_POOL:
            wrapper = self._fi.BatchPrefillWithRaggedKVCacheWrapper(
                self._workspace(meta.device), "NHD", backend="fa2"
            )
        elif wrapper is None:
            wrapper = pool[0]
        pool[:] = [w for w in pool if w is not wrapper] + [wrapper]
        self._ragged_owner[id(wrapper)] = weakref.ref(plan.ragged)
        kv_indptr = torch.zeros(meta.num_seqs + 1, dtype=torch.int32)
        torch.cumsum(meta.seq_lens_cpu, 0, out=kv_indptr[1:])
        self._wait_for_previous_plan(wrapper, meta.device)
        wrapper.plan(
            meta.query_start_loc_cpu, kv_indptr, v.num_heads, v.num_kv_heads, v.head_dim,
            head_dim_vo=v.v_dim, causal=v.causal, window_left=v.window_left,
            logits_soft_cap=v.softcap or None, sm_scale=v.scale, q_data_type=v.dtype,
            kv_data_type=v.dtype, o_data_type=v.dtype, non_blocking=True,
        )  # fmt: skip
        if meta.device.type == "cuda":
            done = self._planned_copy.get(id(wrapper))
            if done is None:
                done = self._planned_copy[id(wrapper)] = torch.cuda.Event()
            done.record(torch.cuda.current_stream(meta.device))
        self.plan_calls += 1
        return wrapper

    def _attend_mla(
        self,
        wrapper: Any,
        q: torch.Tensor,
        cache: KVCache,
        rows: int,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        graph: GraphBuffers | None,
        quantized: bool = False,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """FlashInfer's MLA wrapper: q (rows, Hq, 576) packed, the latent cache (N, P, 576).

        An e4m3 latent (``quantized``) is read with unit scales (FlashInfer takes them as host
        floats) and its ``scale``, if any, applied on the device instead, as for fp8 KV: K and
        V are both the latent times ``scale``, so q is multiplied by it before the kernel (the
        scores, hence the lse, come out exact) and the output after it."""
        q = q[:rows]
        # One KV head, one scale: a 0-dim factor keeps q's dtype (fp32 math, one kernel each).
        factor = None if scale is None else scale.reshape(())
        if factor is not None:
            q = q * factor
        elif not q.is_contiguous():
            q = q.contiguous()
        dest = out[:rows]
        o = dest if dest.is_contiguous() else torch.empty_like(dest)
        if lse is None:
            # Planned with its lse on, the wrapper writes one anyway: a captured step into the
            # graph state's static buffer (a replay writes where the capture did), an eager one
            # into a buffer of its own.
            if isinstance(graph, FlashInferGraphState):
                lse = graph.lse_buffer(q.shape[1])
            else:
                lse = torch.empty(q.shape[0], q.shape[1], device=q.device)
        lse_rows = lse[: q.shape[0]]
        unit = {"ckv_scale": 1.0, "kpe_scale": 1.0} if quantized else {}
        wrapper.run(
            query=q,
            kv_cache=cache.k.squeeze(2),
            out=o,
            lse=lse_rows,
            return_lse=True,
            return_lse_base_on_e=True,
            **unit,
        )
        if factor is not None:
            o.mul_(factor)
        if o is not dest:
            dest.copy_(o)
        return out


def _mla_cluster(query_rows: int, num_heads: int, batch_size: int) -> int:
    """CTAs per cluster that FlashInfer's sm90 MLA plan picks (``MLAPlan`` in its
    scheduler.cuh): 2 when a row holds more than 64 (query, head) pairs on average."""
    return 2 if batch_size and query_rows * num_heads // batch_size > 64 else 1


def _check_mla_cluster(captured: FlashInferPlan, meta: AttentionMetadata) -> None:
    """Refuse, before anything is copied, a replay whose MLA cluster size differs from the
    captured one: the captured launch keeps its grid, which a re-plan would change."""
    bs, rows = captured.metadata.num_seqs, captured.metadata.num_tokens
    # Replay pads the batch to ``bs`` rows, which share the leftover token rows as
    # GraphBuffers._pad deals them.
    t, pad_rows, longest = meta.num_tokens, bs - meta.num_seqs, captured.metadata.max_query_len
    padded = t
    if pad_rows > 0:
        share = min((rows - t) // pad_rows, longest)
        padded = min(rows, t + share * (pad_rows - 1) + longest)
    for v in captured.wrappers:
        if not v.mla:
            continue
        then, now = _mla_cluster(rows, v.num_heads, bs), _mla_cluster(padded, v.num_heads, bs)
        if then != now:
            raise UnsupportedConfigError(
                "the flashinfer backend cannot replay this MLA step in this graph:",
                [
                    Reason(
                        ReasonKind.BATCH,
                        "query_lens",
                        f"give {padded} query rows in {bs} rows, a cluster size of {now}; the "
                        f"graph was captured with {then} (FlashInfer's MLA kernel fixes it at "
                        "capture). Capture uniform graphs (decode, verify) and replay full rows",
                    )
                ],
            )


def _fp8_mla_reasons(layout: KVCacheLayout | None) -> list[Reason]:
    """FlashInfer's MLA wrapper reads an e4m3 latent with bf16 queries only."""
    if layout is None or not layout.is_quantized or layout.dtype == torch.bfloat16:
        return []
    return [
        Reason(
            _CFG,
            "dtype",
            f"must be torch.bfloat16 over an fp8 latent (FlashInfer's MLA wrapper), found "
            f"{layout.dtype}",
        )
    ]


def _per_kv_head(x: torch.Tensor, scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """x (T, Hq, D) times a (), (1,) or (Hkv,) scale, in fp32 (query head h uses KV head
    h // (Hq / Hkv))."""
    t, hq, d = x.shape
    s = scale.reshape(1, -1, 1, 1)
    return (x.float().view(t, num_kv_heads, hq // num_kv_heads, d) * s).view(t, hq, d)

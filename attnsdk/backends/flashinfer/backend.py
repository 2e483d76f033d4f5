"""``flashinfer``: FlashInfer paged attention (compute capability 8.0 and newer).

Each step is planned once per kernel variant, never per layer: ``make_plan`` plans one
FlashInfer wrapper per variant of the prepared layers, the decode wrapper for steps of one query
token per row and the paged prefill wrapper for any other. ``planner`` owns the wrappers and
their ``plan()`` calls (the CSR page lists, chunked variants' virtual batches), ``plan`` the
records a step is planned with, ``mla`` the MLA layers' path, ``refusals`` what the backend
refuses beyond its declared capabilities.

``lse=``: every wrapper fills the caller's buffer (``run(..., lse=, return_lse=True)``) with
FlashInfer's base-2 log-sum-exp, scaled by ln 2 in place afterwards; the sink wrappers fold the
sink logit into each row's running max and sum (``AttentionSink``'s ``REGISTER_M_D_UPDATE``), so
it is in the value already.

fp8 KV (e4m3 / e5m2, bf16 or fp16 q): FlashInfer would take ``k_scale`` / ``v_scale`` as host
floats (a device read per layer). Instead q is multiplied by ``k_scale`` before the kernel and
the output by ``v_scale`` after it, on the device, which also serves per-KV-head scales. An
MLA layer's e4m3 latent (Hopper only, bf16 q) is read the same way with its one scale.

Importing this module imports no kernel library; ``FlashInferBackend(...)`` imports flashinfer.
"""

from __future__ import annotations

import importlib
import math
from typing import TYPE_CHECKING, Any, cast

import torch

from attnsdk.backends.flashinfer.mla import attend_mla, check_mla_capture, check_mla_replay
from attnsdk.backends.flashinfer.options import FlashInferOptions
from attnsdk.backends.flashinfer.plan import (
    FP8,
    FlashInferGraphState,
    FlashInferPlan,
    RaggedVariant,
    Variant,
)
from attnsdk.backends.flashinfer.planner import WrapperPlanner
from attnsdk.backends.flashinfer.refusals import option_reasons, paged_reasons, ragged_reasons
from attnsdk.backends.gpu import DeviceStoreBackend
from attnsdk.contract.capabilities import (
    Capabilities,
    Feature,
    GraphSupport,
    default_device,
    device_reasons,
)
from attnsdk.contract.errors import BackendUnavailableError, InvalidInputError, Reason, ReasonKind
from attnsdk.contract.kv import KVOrder
from attnsdk.features.chunked import check_capture
from attnsdk.kernels.probes import module_present

if TYPE_CHECKING:
    from attnsdk.backends.base import AttendArgs, RaggedArgs
    from attnsdk.contract.capabilities import Request
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import GraphBuffers, Plan

__all__ = ["INSTALL_COMMAND", "FlashInferBackend"]

INSTALL_COMMAND = "pip install flashinfer-python"
"""What error messages name. From a checkout, ``pip install -e "/path/to/attnsdk[flashinfer]"``
installs the same package (attnsdk itself is not on the package index)."""

_LN2 = math.log(2.0)
"""FlashInfer's log-sum-exp is log2 of the softmax denominator; attnsdk's is the natural log."""


class FlashInferBackend(DeviceStoreBackend):
    """FlashInfer's paged prefill and tensor-core decode wrappers. See the module docstring."""

    name = "flashinfer"
    priority = 90
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        dtypes=frozenset({torch.float16, torch.bfloat16}),
        kv_dtypes=FP8,
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
    buffers_type = FlashInferGraphState
    options: FlashInferOptions

    def __init__(self, options: FlashInferOptions | None = None) -> None:
        super().__init__(options)
        if not module_present("flashinfer"):
            raise BackendUnavailableError(
                "the flashinfer backend needs FlashInfer (the flashinfer module); it is not "
                "installed.",
                INSTALL_COMMAND,
            )
        self._planner = WrapperPlanner(importlib.import_module("flashinfer"), self.options)

    @property
    def plan_calls(self) -> int:
        """FlashInfer ``plan()`` calls so far (each ~390 µs of host time); tests and benchmarks
        read it to check one call per variant per step."""
        return self._planner.plan_calls

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
    def refusals(cls, request: Request) -> list[Reason]:
        """``BackendBase``'s, what FlashInfer's kernels cannot express (paged: head dims outside
        its merge kernels, a symmetric non-causal window, softcap with sinks, chunk sizes off
        the page size; ragged: its ragged prefill's dims, no sinks or chunks), and the kernel
        variants an option selects (``refusals``)."""
        reasons = super().refusals(request)
        layer, layout = request.layer, request.layout
        if Feature.RAGGED in request.uses:
            reasons += [] if layer is None else ragged_reasons(layer)
        else:
            reasons += paged_reasons(layer, layout)
        device = request.device or default_device(cls.capabilities)
        reasons += option_reasons(cls.options_of(request), layer, layout, device)
        return sorted(set(reasons))

    def layer_state(self, layer: LayerSpec, layout: KVCacheLayout) -> Variant:
        return Variant.of(layer, layout)

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
            self._planner.plan_variant(plan, variant)
        return plan

    def _variants(self, meta: AttentionMetadata) -> list[Variant]:
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

    def capture_plan(self, meta: AttentionMetadata, state: GraphBuffers) -> FlashInferPlan:
        """A captured plan with every prepared variant planned on CUDA-graph wrappers.

        A capture whose rows hold one token each (``num_tokens == batch_size``) runs the decode
        wrapper; any other runs the prefill wrapper. Call ``prepare`` first: a variant cannot be
        planned during capture.
        """
        if not isinstance(state, FlashInferGraphState):
            raise InvalidInputError(
                "state", "the FlashInferGraphState of this backend's graph_state()", type(state)
            )
        plan = FlashInferPlan(meta, graph=state)
        variants = self._variants(meta)
        if any(v.chunk is not None for v in variants):
            check_capture(meta)
        if any(v.mla for v in variants):
            check_mla_capture(meta, meta.num_seqs, meta.num_tokens)
        for variant in variants:
            self._planner.plan_variant(plan, variant)
        return plan

    def plan_for_replay(self, plan: Plan, meta: AttentionMetadata) -> None:
        """Copy ``meta`` into the captured buffers, then re-plan each captured wrapper (one
        FlashInfer ``plan()`` per variant, which writes into the wrapper's fixed buffers)."""
        captured = cast("FlashInferPlan", plan)
        if isinstance(plan, FlashInferPlan):
            check_mla_replay(captured, meta)
        super().plan_for_replay(plan, meta)  # refuses any plan but a captured FlashInferPlan
        captured.csr.clear()
        captured.virtual.clear()
        for variant in list(captured.wrappers):
            self._planner.plan_variant(captured, variant)

    # -- per layer --------------------------------------------------------------------------

    def attend(self, call: AttendArgs) -> torch.Tensor:
        q, cache, plan, layer, state = call.q, call.cache, call.plan, call.layer, call.state
        sinks, k_scale, v_scale, out, lse = call.unpacked()
        plan = _flashinfer_plan(plan)
        meta = plan.metadata
        if meta.num_seqs == 0 or meta.num_tokens == 0:
            return out
        variant = state
        planned = self._planner.current(plan, variant)
        if planned is None:
            if q.is_cuda and torch.cuda.is_current_stream_capturing():
                raise InvalidInputError(
                    "layer",
                    "a layer shape planned before capture",
                    f"{layer} (not in backend.prepared when plan_for_capture ran)",
                    "Call backend.prepare(layers, layout) before plan_for_capture",
                )
            planned = self._planner.plan_variant(plan, variant)
        wrapper, kind = planned
        csr = plan.csr[(kind == "decode", variant.page_size, variant.chunk)].host
        if kind == "mla":
            return attend_mla(
                wrapper, q, cache, csr.num_q_rows, out, lse, plan.graph,
                variant.quantized, k_scale if variant.quantized else None,
            )  # fmt: skip
        rows = csr.num_q_rows if kind == "prefill" else csr.num_rows
        q = q[:rows]
        if q.stride(-1) != 1 or not q.is_contiguous():
            q = q.contiguous()
        if variant.quantized and k_scale is not None:
            q = _per_kv_head(q, k_scale, variant.num_kv_heads).to(q.dtype)
        kv = (cache.k, cache.v)
        args = (q, kv, sinks, variant.scale) if variant.sinks else (q, kv)
        v_scale = v_scale if variant.quantized else None
        return _run_rows(wrapper, args, out, lse, rows, v_scale, variant.num_kv_heads)

    def attend_ragged(self, call: RaggedArgs) -> torch.Tensor:
        """``BatchPrefillWithRaggedKVCacheWrapper``, planned once per plan and ragged variant
        from the host twins (its indptrs: no sync; ``key_start_loc`` is not read). Each live
        plan holds a wrapper of its own from a small pool (``planner._RAGGED_POOL``), so plans
        used in turn (one per prefix chunk, every layer) never run on another plan's
        schedule."""
        q, k, v, plan, layer = call.q, call.k, call.v, call.plan, call.layer
        out, lse = call.out, call.lse
        plan = _flashinfer_plan(plan)
        meta = plan.metadata
        rows = meta.num_tokens
        if meta.num_seqs == 0 or rows == 0:
            return out
        wrapper = self._planner.ragged(plan, RaggedVariant.of(layer, q.dtype))
        args = tuple(x if x.is_contiguous() else x.contiguous() for x in (q[:rows], k, v))
        return _run_rows(wrapper, args, out, lse, rows)


def _flashinfer_plan(plan: Plan) -> FlashInferPlan:
    if not isinstance(plan, FlashInferPlan):
        raise InvalidInputError(
            "plan", "a FlashInferPlan from this backend's plan()", type(plan).__name__
        )
    return plan


def _run_rows(
    wrapper: Any,
    args: tuple[Any, ...],
    out: torch.Tensor,
    lse: torch.Tensor | None,
    rows: int,
    v_scale: torch.Tensor | None = None,
    num_kv_heads: int = 1,
) -> torch.Tensor:
    """``wrapper.run(*args)`` into the first ``rows`` of ``out`` (through a contiguous buffer
    when that prefix is not), times ``v_scale`` (an fp8 cache's, per KV head) when given, and
    of ``lse``, scaled to the natural log; returns ``out``."""
    dest = out[:rows]
    o = dest if dest.is_contiguous() else torch.empty_like(dest)
    # A prefix of the caller's contiguous (T, Hq) buffer is contiguous: written in place.
    lse_rows = None if lse is None else lse[:rows]
    with_lse = {} if lse_rows is None else {"lse": lse_rows, "return_lse": True}
    wrapper.run(*args, out=o, **with_lse)
    if lse_rows is not None:
        lse_rows.mul_(_LN2)
    if v_scale is not None:
        o.copy_(_per_kv_head(o, v_scale, num_kv_heads))
    if o is not dest:
        dest.copy_(o)
    return out


def _per_kv_head(x: torch.Tensor, scale: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """x (T, Hq, D) times a (), (1,) or (Hkv,) scale, in fp32 (query head h uses KV head
    h // (Hq / Hkv))."""
    t, hq, d = x.shape
    s = scale.reshape(1, -1, 1, 1)
    return (x.float().view(t, num_kv_heads, hq // num_kv_heads, d) * s).view(t, hq, d)

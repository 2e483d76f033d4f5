"""``WrapperPlanner``: the ``flashinfer`` backend's FlashInfer wrappers and their ``plan()`` calls.

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

Chunked local attention (``LayerSpec.attention_chunk_size``): FlashInfer has no chunk mask, so a
chunked variant's wrapper is planned over the step's virtual batch (``attnsdk.features.chunked``: one
sequence per chunk a sequence's queries touch, made once per step and chunk size) with its
own CSR. The chunk size must be a multiple of the page size. CUDA graphs capture chunked
variants in decode graphs only, where the virtual batch keeps one row per sequence.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.backends.flashinfer.csr import build_csr, gather_indices
from attnsdk.backends.flashinfer.mla import mla_backend
from attnsdk.backends.flashinfer.plan import FlashInferGraphState, RaggedPlans, StepCSR
from attnsdk.features.chunked import check_capture, virtual_metadata

if TYPE_CHECKING:
    from attnsdk.backends.flashinfer.options import FlashInferOptions
    from attnsdk.backends.flashinfer.plan import FlashInferPlan, Kind, RaggedVariant, Variant
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = ["WrapperPlanner"]

_RAGGED_POOL = 8
"""Ragged wrappers per variant and device. A step may keep several ragged plans alive at once
and use them in turn (SGLang's chunked prefix: one per prefix chunk, every layer running chunk
0, 1, ...); each needs a wrapper of its own. Past this many live plans the least recently
planned wrapper is taken over and its plan re-plans on its next use: correct, one plan() more."""

_GRAPH_ARGS: dict[Kind, dict[str, str]] = {
    "mla": {
        "qo_indptr": "qo_indptr",
        "kv_indptr": "kv_indptr",
        "kv_indices": "indices",
        "kv_len_arr": "kv_len",
    },
    "decode": {
        "paged_kv_indptr_buffer": "kv_indptr",
        "paged_kv_indices_buffer": "indices",
        "paged_kv_last_page_len_buffer": "last_page_len",
    },
    "prefill": {
        "qo_indptr_buf": "qo_indptr",
        "paged_kv_indptr_buf": "kv_indptr",
        "paged_kv_indices_buf": "indices",
        "paged_kv_last_page_len_buf": "last_page_len",
    },
}
"""Each kind's wrapper argument -> the ``FlashInferGraphState.buffers`` entry a CUDA-graph
wrapper of that kind is built over."""


class WrapperPlanner:
    """The FlashInfer wrappers of one backend (one per kind and variant, CUDA-graph ones in the
    graph state, ragged ones in a small pool), the float workspace per device they share, and
    every FlashInfer ``plan()`` call, counted in ``plan_calls``."""

    def __init__(self, fi: Any, options: FlashInferOptions) -> None:
        self._fi = fi
        self._options = options
        self._workspaces: dict[torch.device, torch.Tensor] = {}
        self._wrappers: dict[tuple[Kind, Variant], Any] = {}
        self._ragged_pool: dict[tuple[RaggedVariant, torch.device], list[Any]] = {}
        """(variant, device) -> its ragged wrappers, least recently planned first."""
        self._ragged_owner: dict[int, weakref.ref[RaggedPlans]] = {}
        self._owner: dict[int, FlashInferPlan] = {}
        self._planned_copy: dict[int, torch.cuda.Event] = {}
        self.plan_calls = 0
        """FlashInfer ``plan()`` calls so far (each ~390 µs of host time)."""

    # -- paged variants ---------------------------------------------------------------------

    def current(self, plan: FlashInferPlan, variant: Variant) -> tuple[Any, Kind] | None:
        """The wrapper of ``variant`` planned for ``plan`` and its kind; None when it was not
        planned, or its wrapper was re-planned for another plan since."""
        planned = plan.wrappers.get(variant)
        if planned is None or self._owner.get(id(planned[0])) is not plan:
            return None
        return planned

    def plan_variant(self, plan: FlashInferPlan, variant: Variant) -> tuple[Any, Kind]:
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
        self._planned(wrapper, meta.device)
        self._owner[id(wrapper)] = plan
        plan.wrappers[variant] = (wrapper, kind)
        return wrapper, kind

    def _kind(self, plan: FlashInferPlan, variant: Variant) -> Kind:
        meta = plan.metadata
        if variant.mla:
            return "mla"
        if variant.head_dim != variant.v_dim:
            return "prefill"  # FlashInfer's decode wrappers need head_dim == v_head_dim
        if plan.graph is not None:
            return "decode" if meta.max_query_len <= 1 else "prefill"
        q = meta.query_start_loc_cpu
        return "decode" if q.shape[0] < 2 or int((q[1:] - q[:-1]).max()) <= 1 else "prefill"

    def _step_meta(self, plan: FlashInferPlan, v: Variant) -> AttentionMetadata:
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

    def _csr(self, plan: FlashInferPlan, per_token: bool, v: Variant) -> StepCSR:
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
        found = plan.csr[key] = StepCSR(host, indices)
        return found

    def _wrapper(self, plan: FlashInferPlan, kind: Kind, v: Variant) -> Any:
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
        v: Variant,
        meta: AttentionMetadata,
        bufs: dict[str, torch.Tensor] | None,
    ) -> Any:
        """A wrapper of ``kind`` for ``v``: eager, or a CUDA-graph one over ``bufs``."""
        fi = self._fi
        ws = self._workspace(meta.device)
        graph_kw: dict[str, Any] = {}
        if bufs is not None:
            graph_kw = {"use_cuda_graph": True}
            graph_kw |= {arg: bufs[name] for arg, name in _GRAPH_ARGS[kind].items()}
        if kind == "mla":
            backend = mla_backend(self._options.mla_backend, meta.device)
            return fi.BatchMLAPagedAttentionWrapper(ws, backend=backend, **graph_kw)
        sink_kw = {
            "q_data_type": v.dtype,
            "kv_data_type": v.kv_dtype,
            "head_dim_qk": v.head_dim,
            "head_dim_vo": v.v_dim,
            "window_left": v.window_left,
        }
        if kind == "decode":
            if v.sinks:
                return fi.BatchDecodeWithAttentionSinkWrapper(
                    ws, v.order, backend="fa2", **sink_kw, **graph_kw
                )
            return fi.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                v.order,
                use_tensor_cores=self._options.decode == "tensor_cores",
                backend="fa2",
                **graph_kw,
            )
        if v.sinks:
            return fi.BatchAttentionWithAttentionSinkWrapper(
                ws, v.order, backend="fa2", **sink_kw, **graph_kw
            )
        if bufs is not None:
            graph_kw["max_total_num_rows"] = meta.num_tokens
        # fa2's kernels take a bf16 / fp16 query with an fp8 cache; "auto" may pick fa3.
        backend = "fa2" if v.quantized else self._options.prefill_backend
        return fi.BatchPrefillWithPagedKVCacheWrapper(ws, v.order, backend=backend, **graph_kw)

    # -- ragged variants --------------------------------------------------------------------

    def ragged(self, plan: FlashInferPlan, variant: RaggedVariant) -> Any:
        """The ragged wrapper of ``variant`` planned for ``plan``, planned now (one FlashInfer
        plan()) unless this plan still owns the one it was planned on."""
        wrapper = plan.ragged.get(variant)
        if wrapper is None or self._ragged_plans_of(wrapper) is not plan.ragged:
            wrapper = plan.ragged[variant] = self._plan_ragged(plan, variant)
        return wrapper

    def _ragged_plans_of(self, wrapper: Any) -> RaggedPlans | None:
        """The live plan's wrappers ``wrapper`` was last planned for; None when that plan is
        gone (or it never was planned)."""
        owner = self._ragged_owner.get(id(wrapper))
        return None if owner is None else owner()

    def _plan_ragged(self, plan: FlashInferPlan, v: RaggedVariant) -> Any:
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
        self._planned(wrapper, meta.device)
        return wrapper

    # -- what every wrapper shares ----------------------------------------------------------

    def _wait_for_previous_plan(self, wrapper: Any, device: torch.device) -> None:
        """FlashInfer's plan() writes its schedule into the wrapper's pinned host buffer and
        queues an asynchronous copy to the device without waiting for the previous one. Before
        the buffer is rewritten, the previous copy must have run: a non-blocking event query,
        which only waits (a sync) when the host is a whole step ahead of the device."""
        done = self._planned_copy.get(id(wrapper))
        if done is not None and device.type == "cuda" and not done.query():
            done.synchronize()

    def _planned(self, wrapper: Any, device: torch.device) -> None:
        """Count a plan() of ``wrapper`` and, on CUDA, mark where its schedule copy was queued
        (what ``_wait_for_previous_plan`` waits for)."""
        if device.type == "cuda":
            done = self._planned_copy.get(id(wrapper))
            if done is None:
                done = self._planned_copy[id(wrapper)] = torch.cuda.Event()
            done.record(torch.cuda.current_stream(device))
        self.plan_calls += 1

    def _workspace(self, device: torch.device) -> torch.Tensor:
        ws = self._workspaces.get(device)
        if ws is None:
            size = self._options.workspace_mib * 1024 * 1024
            ws = self._workspaces[device] = torch.zeros(size, dtype=torch.uint8, device=device)
        return ws

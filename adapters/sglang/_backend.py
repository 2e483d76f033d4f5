"""``SGLangAttentionBackend``: SGLang's ``AttentionBackend`` interface over any attnsdk backend.

SGLang calls ``init_forward_metadata`` once per step (or the CUDA-graph hooks), then ``forward``
once per layer. This class keeps one ``Plan`` per step and one ``KVCache`` view per layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk import (
    AttentionConfig,
    Backend,
    InvalidInputError,
    KVCacheLayout,
    LayerSpec,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
    create_backend,
)
from attnsdk.adapters.sglang._adapter import SGLangAdapter, StepKind, draft_token_num, step_kind

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner

    from attnsdk import GraphBuffers, KVCache, Plan

__all__ = ["SEQ_LEN_FILL_VALUE", "SGLangAttentionBackend"]

SEQ_LEN_FILL_VALUE = 1
"""SGLang's seq_len of CUDA-graph padding rows; with req_to_token row 0 they read page 0."""


@dataclass(frozen=True, slots=True)
class _Layer:
    spec: LayerSpec
    cache: KVCache
    k_ptr: int
    """data_ptr of SGLang's K buffer when ``cache`` was wrapped; a change means re-wrap."""


@dataclass(frozen=True, slots=True)
class _GraphBatch:
    """The ForwardBatch fields the adapter reads, rebuilt from the replay hook's arguments."""

    forward_mode: Any
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    spec_info: Any


class SGLangAttentionBackend:
    """Drop-in SGLang attention backend: SGLang's method names, an attnsdk backend underneath.

    ``backend`` is a backend name, an ``AttentionConfig`` or a ``Backend`` instance. ``adapter``
    lets an integrator pass an ``SGLangAdapter`` subclass. Construction checks the model's head
    shape and KV dtype against the backend and raises ``UnsupportedConfigError`` with every reason.

    K/V writes: eagerly, new K/V go to ``Backend.forward`` with the step's slot mapping
    (``out_cache_loc``). Under CUDA graphs SGLang's replay hook never sees ``out_cache_loc`` (it
    lives in the graph runner's static buffer), so the captured forward writes through
    ``token_to_kv_pool.set_kv_buffer`` with that buffer, as SGLang's own backends do, and the
    attnsdk backend only attends.
    """

    def __init__(
        self,
        model_runner: ModelRunner,
        backend: str | AttentionConfig | Backend = "auto",
        *,
        adapter: SGLangAdapter | None = None,
    ) -> None:
        self.model_runner = model_runner
        self.device = torch.device(model_runner.device)
        self.page_size = int(model_runner.page_size)
        req_to_token = model_runner.req_to_token_pool.req_to_token
        self.adapter = adapter or SGLangAdapter(req_to_token=req_to_token, page_size=self.page_size)
        if self.adapter.page_size != self.page_size:
            raise InvalidInputError(
                "adapter.page_size",
                f"model_runner.page_size={self.page_size}",
                self.adapter.page_size,
            )
        if isinstance(backend, (str, AttentionConfig)):
            self.backend: Backend = create_backend(backend, device=self.device)
        elif isinstance(backend, Backend):
            self.backend = backend
        else:
            raise InvalidInputError(
                "backend", "a backend name, an AttentionConfig or a Backend", type(backend).__name__
            )
        self._check_model()
        self._plan: Plan | None = None
        self._layers: dict[tuple[int, bool], _Layer] = {}
        # Static buffers and an all "-1" slot tensor (the captured forward writes K/V itself).
        self._graph: tuple[GraphBuffers, torch.Tensor] | None = None
        self._graph_plans: dict[tuple[int, int], Plan] = {}

    # -- eager steps ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build and plan this step's metadata once; every layer's ``forward`` reuses it."""
        self._plan = self.backend.plan(self.adapter.build_metadata(forward_batch))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q ``[T, Hq*D]``, k/v ``[T, Hkv*D|Dv]`` (or None) → ``[T, Hq*Dv]`` in q's dtype."""
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, sinks=sinks)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Extend, mixed, verify and draft-extend steps; one attnsdk call serves them all."""
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        *,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode and idle steps."""
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks)

    # -- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static metadata buffers every captured batch size views."""
        max_pages = -(-self.adapter.req_to_token.shape[1] // self.page_size)
        state = self.backend.graph_state(
            max_bs, max_num_tokens, max_pages, page_size=self.page_size, device=self.device
        )
        if state.reserved_page != 0 or state.seq_len_fill != SEQ_LEN_FILL_VALUE:
            raise UnsupportedConfigError(
                f"backend {self.backend.name!r} graph buffers: expected reserved page 0 and "
                f"seq_len fill {SEQ_LEN_FILL_VALUE} (SGLang's), found page "
                f"{state.reserved_page} and fill {state.seq_len_fill}"
            )
        no_slots = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=self.device)
        self._graph = (state, no_slots)
        self._graph_plans.clear()

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None,
        forward_mode: ForwardMode,
        spec_info: Any,
    ) -> None:
        """Bind a plan of static-buffer views for a graph of ``bs`` rows, ``num_tokens`` tokens.

        ``req_pool_indices`` and ``seq_lens`` are SGLang's static inputs; their values are read at
        replay, so capture needs only the shape.
        """
        del req_pool_indices, seq_lens  # read at replay, from the same static buffers
        state, _ = self._require_graph_state()
        per_row = self._graph_tokens_per_row(forward_mode, spec_info, encoder_lens)
        if num_tokens != bs * per_row:
            raise InvalidInputError(
                "num_tokens", f"bs * tokens per row = {bs} * {per_row} = {bs * per_row}", num_tokens
            )
        plan = self.backend.plan_for_capture(state, bs, num_tokens, max_query_len=per_row)
        self._graph_plans[(bs, per_row)] = plan
        self._plan = plan

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        encoder_lens: torch.Tensor | None,
        forward_mode: ForwardMode,
        spec_info: Any,
        seq_lens_cpu: torch.Tensor | None,
    ) -> None:
        """Refresh the captured plan for ``bs`` in place (no allocation of static buffers).

        SGLang passes ``bs`` padded rows: padding rows have seq_len 1 (the fill value) and read
        through req_to_token row 0 (or a stale row), and write slot 0 of the padding page.
        """
        del seq_lens_sum  # the host lengths come from seq_lens_cpu
        _, no_slots = self._require_graph_state()
        per_row = self._graph_tokens_per_row(forward_mode, spec_info, encoder_lens)
        plan = self._graph_plans.get((bs, per_row))
        if plan is None:
            captured = sorted(b for b, n in self._graph_plans if n == per_row)
            raise InvalidInputError("bs", f"a captured batch size, one of {captured}", bs)
        if seq_lens_cpu is None:
            raise InvalidInputError(
                "seq_lens_cpu", "the host twin of seq_lens (attnsdk never syncs for it)", None
            )
        view = _GraphBatch(
            forward_mode=forward_mode,
            batch_size=bs,
            req_pool_indices=req_pool_indices[:bs],
            seq_lens=seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu[:bs],
            out_cache_loc=no_slots[: bs * per_row],
            spec_info=spec_info,
        )
        self.backend.plan_for_replay(plan, self.adapter.build_metadata(view))
        self._plan = plan

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """SGLang's seq_len for padding rows: 1 (a row of length 0 is not a valid kernel row)."""
        return SEQ_LEN_FILL_VALUE

    def get_verify_buffers_to_fill_after_draft(self) -> list[None]:
        """No tree-mask or position buffers: verify is a causal chain (topk 1)."""
        return [None, None]

    # -- internals --------------------------------------------------------------------------

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        plan = self._plan
        if plan is None:
            raise InvalidInputError(
                "init_forward_metadata", "called before forward in each step", "no step metadata"
            )
        st = self._layer(layer, fb, q.dtype, sinks is not None)
        spec, cache = st.spec, st.cache
        rows = q.shape[0]
        if plan.metadata.num_seqs == 0:
            # IDLE ranks (data-parallel attention) still run the layer; SGLang zeroes their output.
            return q.new_zeros(rows, spec.num_heads * spec.v_dim)
        k3 = v3 = None
        if save_kv_cache and k is not None and v is not None:
            k3 = k.reshape(rows, spec.num_kv_heads, spec.head_dim)
            v3 = v.reshape(rows, spec.num_kv_heads, spec.v_dim)
            if plan.graph is not None:
                fb.token_to_kv_pool.set_kv_buffer(
                    layer,
                    fb.out_cache_loc,
                    k3,
                    v3,
                    getattr(layer, "k_scale", None),
                    getattr(layer, "v_scale", None),
                )
                k3 = v3 = None  # written: the attnsdk backend only attends
        quantized = cache.layout.is_quantized
        out = self.backend.forward(
            q.reshape(rows, spec.num_heads, spec.head_dim),
            k3,
            v3,
            cache,
            plan,
            spec,
            sinks=sinks,
            k_scale=getattr(layer, "k_scale", None) if quantized else None,
            v_scale=getattr(layer, "v_scale", None) if quantized else None,
        )
        return out.reshape(rows, spec.num_heads * spec.v_dim)

    def _layer(
        self, layer: RadixAttention, fb: ForwardBatch, dtype: torch.dtype, sinks: bool
    ) -> _Layer:
        pool = fb.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        key = (int(layer.layer_id), sinks)
        st = self._layers.get(key)
        if st is not None and st.k_ptr == k_buf.data_ptr() and st.cache.layout.dtype == dtype:
            return st
        spec = self.adapter.layer_spec(layer, has_sinks=sinks)
        cache = self.adapter.kv_cache(k_buf, pool.get_value_buffer(layer.layer_id), dtype=dtype)
        reasons = self.backend.unsupported_reasons(spec, cache.layout, self.device)
        if reasons:
            raise UnsupportedConfigError(
                f"backend {self.backend.name!r} cannot serve layer {layer.layer_id}:", reasons
            )
        st = _Layer(spec, cache, k_buf.data_ptr())
        self._layers[key] = st
        return st

    def _check_model(self) -> None:
        """Fail at start-up, not at the first batch, when the model cannot run on the backend."""
        runner = self.model_runner
        cfg = runner.model_config
        arch = getattr(getattr(cfg, "attention_arch", None), "name", "MHA")
        if arch == "MLA":
            raise UnsupportedConfigError(
                "model_config.attention_arch: expected MHA, found MLA",
                [Reason(ReasonKind.CONFIGURATION, "attention_arch", "MLA KV is not mapped")],
            )
        tp = int(getattr(runner, "tp_size", 1))
        spec = LayerSpec(
            num_heads=int(cfg.num_attention_heads) // tp,
            num_kv_heads=int(cfg.get_num_kv_heads(tp)),
            head_dim=int(cfg.head_dim),
        )
        layout = KVCacheLayout(
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            page_size=self.page_size,
            dtype=runner.dtype,
            kv_dtype=runner.kv_cache_dtype,
        )
        reasons = self.backend.unsupported_reasons(spec, layout, self.device)
        if reasons:
            raise UnsupportedConfigError(
                f"backend {self.backend.name!r} cannot serve this model:", reasons
            )

    def _require_graph_state(self) -> tuple[GraphBuffers, torch.Tensor]:
        if self._graph is None:
            raise InvalidInputError(
                "init_cuda_graph_state", "called before capturing or replaying", "not called"
            )
        return self._graph

    def _graph_tokens_per_row(
        self, mode: ForwardMode, spec_info: Any, encoder_lens: torch.Tensor | None
    ) -> int:
        if encoder_lens is not None:
            raise UnsupportedConfigError(
                "encoder_lens: expected None, found a tensor (cross-attention is not mapped)"
            )
        kind = step_kind(mode)
        if kind is StepKind.TARGET_VERIFY:
            return draft_token_num(spec_info)
        if kind is StepKind.DECODE and not (spec_info is not None and mode.is_decode()):
            return 1
        raise UnsupportedConfigError(
            f"forward_mode under CUDA graphs: expected DECODE, IDLE or TARGET_VERIFY, found {mode!r}"
            + (" with spec_info (EAGLE draft decode)" if kind is StepKind.DECODE else ""),
        )

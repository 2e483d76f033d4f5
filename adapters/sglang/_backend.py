"""``SGLangAttentionBackend``: SGLang's ``AttentionBackend`` interface over any attnsdk backend.

SGLang calls ``init_forward_metadata`` once per eager step, then ``forward`` once per layer.
Under CUDA graphs it calls, depending on the release:

- 0.5.13 and later: ``init_forward_metadata_out_graph(fb, in_capture=True)`` before capturing,
  ``init_forward_metadata_out_graph(fb_view)`` before each replay (``fb_view`` holds the padded
  static inputs), ``init_forward_metadata_in_graph(fb)`` inside the graph;
- 0.5.12 and earlier: ``init_forward_metadata_capture_cuda_graph`` /
  ``init_forward_metadata_replay_cuda_graph``.

Both map onto the attnsdk backend's ``plan_for_capture`` / ``plan_for_replay``. When SGLang is
installed the class subclasses SGLang's own ``AttentionBackend`` (see ``sglang_backend_class``),
so every member a runner reads that attnsdk does not define keeps SGLang's default.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk import (
    AttentionConfig,
    Backend,
    InvalidInputError,
    KVCacheLayout,
    LayerSpec,
    UnsupportedConfigError,
)
from attnsdk.adapters._common import (
    EngineVersions,
    LayerEntry,
    LayerState,
    drop_in_class,
    refuse,
    resolve_backend,
)
from attnsdk.adapters.sglang._adapter import SGLangAdapter, StepKind, draft_token_num, step_kind

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner

    from attnsdk import GraphBuffers, Plan

__all__ = ["SEQ_LEN_FILL_VALUE", "SGLANG_VERSIONS", "SGLangAttentionBackendImpl"]

SEQ_LEN_FILL_VALUE = 1
"""SGLang's seq_len of CUDA-graph padding rows; with req_to_token row 0 they read page 0."""

SGLANG_VERSIONS = EngineVersions("sglang", ("0.5.12.post1", "0.5.23"))
"""The SGLang releases the engine tier (``make test-engines``) runs the drop-in in."""


@dataclass(frozen=True, slots=True)
class _GraphBatch:
    """The ForwardBatch fields the adapter reads, rebuilt from a replay hook's arguments."""

    forward_mode: Any
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    spec_info: Any


class SGLangAttentionBackendImpl:
    """Drop-in SGLang attention backend: SGLang's method names, an attnsdk backend underneath.

    Import it as ``attnsdk.adapters.sglang.SGLangAttentionBackend`` (this class with SGLang's
    ``AttentionBackend`` mixed in when SGLang is installed). ``backend`` is a backend name, an
    ``AttentionConfig`` or a ``Backend`` instance; ``adapter`` lets an integrator pass an
    ``SGLangAdapter`` subclass. Construction checks the model against the backend and raises
    ``UnsupportedConfigError`` with every reason.

    K/V writes: eagerly, new K/V go to ``Backend.forward`` with the step's slot mapping
    (``out_cache_loc``). In a captured graph the slots of a replayed step live only in the graph
    runner's static ``out_cache_loc``, so the captured forward writes through
    ``token_to_kv_pool.set_kv_buffer`` with that buffer, as SGLang's own backends do, and the
    attnsdk backend only attends.
    """

    needs_cpu_seq_lens = True
    """attnsdk plans from host lengths and never syncs for them: SGLang must publish them."""

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
        # SGLang 0.5.13+'s EAGLE verify sizes its tree mask from this when a batch carries no
        # seq_lens_sum (eagle_worker_common.build_eagle_verify_input), as with FA3.
        self.max_context_len = int(model_runner.model_config.context_len)
        # SGLang 0.5.13+ reads both pools off the attention backend (forward_context.py).
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        if adapter is not None and not isinstance(adapter, SGLangAdapter):
            raise InvalidInputError("adapter", "None or an SGLangAdapter", repr(adapter))
        self._fixed_adapter = adapter is not None
        self.adapter = adapter or self._default_adapter()
        if self.adapter.page_size != self.page_size:
            raise InvalidInputError(
                "adapter.page_size",
                f"model_runner.page_size={self.page_size}",
                self.adapter.page_size,
            )
        self.backend: Backend = resolve_backend(backend, self.device)
        self._check_model()
        self._plan: Plan | None = None
        self._layers = LayerState()
        # Static buffers and an all "-1" slot tensor (the captured forward writes K/V itself).
        self._graph: tuple[GraphBuffers, torch.Tensor] | None = None
        self._graph_plans: dict[tuple[int, int], Plan] = {}

    # -- eager steps ------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build and plan this step's metadata once; every layer's ``forward`` reuses it."""
        self._plan = self.backend.plan(self._adapter().build_metadata(forward_batch))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """q ``[T, Hq*D]``, k/v ``[T, Hkv*D|Dv]`` (or None) → ``[T, Hq*Dv]`` in q's dtype.

        IDLE batches return an empty output without attending, as SGLang's base class does
        (SGLang runs them without ``init_forward_metadata``).
        """
        if forward_batch.forward_mode.is_idle():
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Extend, mixed, verify and draft-extend steps; one attnsdk call serves them all."""
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Decode steps."""
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

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

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """SGLang 0.5.13+: bind a captured plan (``in_capture``) or refresh it for a replay.

        At capture ``forward_batch`` views the graph runner's static inputs; at replay it is
        the runner's view of them (``batch_size`` rows, padding included, in the captured
        ``forward_mode``), whose values are copied into the captured plan's buffers.
        """
        fb = forward_batch
        if in_capture:
            self._capture(fb.batch_size, fb.out_cache_loc.shape[0], fb.forward_mode, fb)
        else:
            self._replay(fb.batch_size, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu, fb)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """SGLang 0.5.13+: nothing to record in the graph (replay refreshed the buffers)."""

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
        """SGLang <= 0.5.12: bind a plan of static-buffer views for ``bs`` rows, ``num_tokens``
        tokens. The static ``req_pool_indices`` / ``seq_lens`` are read at replay."""
        del req_pool_indices, seq_lens  # read at replay, from the same static buffers
        step = _GraphStep(forward_mode, spec_info, encoder_lens)
        self._capture(bs, num_tokens, forward_mode, step)

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
        """SGLang <= 0.5.12: refresh the plan captured for ``bs`` in place.

        SGLang passes ``bs`` padded rows: padding rows have seq_len 1 (the fill value), read
        through req_to_token row 0 (or a stale row) and write slot 0 of the padding page.
        """
        del seq_lens_sum  # the host lengths come from seq_lens_cpu
        step = _GraphStep(forward_mode, spec_info, encoder_lens)
        self._replay(bs, req_pool_indices, seq_lens, seq_lens_cpu, step)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """SGLang's seq_len for padding rows: 1 (a row of length 0 is not a valid kernel row)."""
        return SEQ_LEN_FILL_VALUE

    def get_verify_buffers_to_fill_after_draft(self) -> list[None]:
        """No tree-mask or position buffers: verify is a causal chain (topk 1)."""
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info: Any, cuda_graph_bs: Any) -> None:
        """Nothing to refresh for a chain verify (it has no tree mask)."""

    # -- internals --------------------------------------------------------------------------

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        sinks = kwargs.pop("sinks", None)
        # SGLang's runners and models pass more keywords (return_lse, q_rope / k_rope, fp8
        # q/k/v descales, score_mod, rel_bias, ...): at None / False they ask for nothing;
        # anything else asks for what attnsdk does not serve yet, which is refused, not ignored.
        for name, value in kwargs.items():
            if value is not None and value is not False:
                refuse(
                    "SGLangAttentionBackend.forward", name, f"is not served (found {_short(value)})"
                )
        plan = self._plan
        if plan is None:
            raise InvalidInputError(
                "init_forward_metadata", "called before forward in each step", "no step metadata"
            )
        entry = self._layer(layer, q.dtype, sinks is not None)
        spec, cache = entry.spec, entry.cache
        rows = q.shape[0]
        q3 = _heads("q", q, spec.num_heads, spec.head_dim)
        k3 = v3 = None
        if (k is None) != (v is None):
            raise InvalidInputError("k/v", "both tensors or both None", "only one of them")
        if save_kv_cache and k is not None and v is not None:
            k3 = _heads("k", k, spec.num_kv_heads, spec.head_dim)
            v3 = _heads("v", v, spec.num_kv_heads, spec.v_dim)
            if plan.graph is not None:
                self.token_to_kv_pool.set_kv_buffer(
                    layer, fb.out_cache_loc, k3, v3, layer.k_scale, layer.v_scale
                )
                k3 = v3 = None  # written: the attnsdk backend only attends
        quantized = cache.layout.is_quantized
        out = self.backend.forward(
            q3,
            k3,
            v3,
            cache,
            plan,
            spec,
            sinks=sinks,
            k_scale=layer.k_scale if quantized else None,
            v_scale=layer.v_scale if quantized else None,
        )
        return out.reshape(rows, spec.num_heads * spec.v_dim)

    def _layer(self, layer: RadixAttention, dtype: torch.dtype, sinks: bool) -> LayerEntry:
        pool = self.token_to_kv_pool
        k_buf = pool.get_key_buffer(layer.layer_id)
        v_buf = pool.get_value_buffer(layer.layer_id)
        fingerprint = (
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            k_buf.shape,
            v_buf.shape,
            k_buf.dtype,
            dtype,
            sinks,
            layer.tp_q_head_num,
            layer.tp_k_head_num,
            layer.head_dim,
            layer.v_head_dim,
            layer.scaling,
            layer.sliding_window_size,
            layer.logit_cap,
            layer.attn_type,
        )

        def build() -> LayerEntry:
            spec = self.adapter.layer_spec(layer, has_sinks=sinks)
            cache = self.adapter.kv_cache(k_buf, v_buf, dtype=dtype)
            reasons = self.backend.unsupported_reasons(spec, cache.layout, self.device)
            if reasons:
                raise UnsupportedConfigError(
                    f"backend {self.backend.name!r} cannot serve layer {layer.layer_id}:", reasons
                )
            return LayerEntry(spec, cache)

        return self._layers.get(layer.layer_id, fingerprint, build)

    def _default_adapter(self) -> SGLangAdapter:
        return SGLangAdapter(
            req_to_token=self.req_to_token_pool.req_to_token, page_size=self.page_size
        )

    def _adapter(self) -> SGLangAdapter:
        """The adapter for this step: rebuilt if SGLang swapped the request pool (frozen-KV MTP
        swaps the pools on the backend), unless the integrator supplied one."""
        if (
            not self._fixed_adapter
            and self.req_to_token_pool.req_to_token is not self.adapter.req_to_token
        ):
            self.adapter = self._default_adapter()
        return self.adapter

    def _check_model(self) -> None:
        """Fail at start-up, not at the first batch, when the model cannot run on the backend."""
        runner = self.model_runner
        cfg = runner.model_config
        what = "SGLangAttentionBackend"
        arch = getattr(getattr(cfg, "attention_arch", None), "name", "MHA")
        if arch == "MLA":
            refuse(what, "model_config.attention_arch", "MLA: latent KV is not mapped yet")
        translator = getattr(runner, "kv_index_translator", None)
        if getattr(translator, "is_translating", False):
            refuse(what, "kv_index_translator", "req_to_token holds virtual ids (unified memory)")
        if getattr(self.token_to_kv_pool, "swa_layer_nums", 0):
            refuse(what, "token_to_kv_pool", "hybrid sliding-window pools are not mapped")
        server_args = getattr(runner, "server_args", None)
        algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
        topk = getattr(server_args, "speculative_eagle_topk", None)
        if algorithm == "NGRAM" or (isinstance(topk, int) and topk > 1):
            refuse(
                what,
                "speculative_eagle_topk",
                f"tree speculative decoding ({algorithm or 'EAGLE'}, topk {topk}) needs a tree "
                "mask; attnsdk serves draft chains (topk 1) only",
            )
        total_kv = cfg.get_total_num_kv_heads() if hasattr(cfg, "get_total_num_kv_heads") else None
        num_kv = int(total_kv or cfg.num_key_value_heads)
        # Total heads: what the capabilities depend on (ratios and dims) is the same per rank.
        spec = LayerSpec(
            num_heads=int(cfg.num_attention_heads),
            num_kv_heads=num_kv,
            head_dim=int(cfg.head_dim),
        )
        layout = KVCacheLayout(
            num_kv_heads=num_kv,
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

    def _capture(self, bs: int, num_tokens: int, mode: ForwardMode, step: Any) -> None:
        state, _ = self._require_graph_state()
        per_row = _graph_tokens_per_row(mode, step.spec_info, getattr(step, "encoder_lens", None))
        if num_tokens != bs * per_row:
            raise InvalidInputError(
                "num_tokens", f"bs * tokens per row = {bs} * {per_row} = {bs * per_row}", num_tokens
            )
        plan = self.backend.plan_for_capture(state, bs, num_tokens, max_query_len=per_row)
        self._graph_plans[(bs, per_row)] = plan
        self._plan = plan

    def _replay(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        step: Any,
    ) -> None:
        _, no_slots = self._require_graph_state()
        mode = step.forward_mode
        per_row = _graph_tokens_per_row(mode, step.spec_info, getattr(step, "encoder_lens", None))
        plan = self._graph_plans.get((bs, per_row))
        if plan is None:
            captured = sorted(b for b, n in self._graph_plans if n == per_row)
            raise InvalidInputError("bs", f"a captured batch size, one of {captured}", bs)
        if seq_lens_cpu is None:
            raise InvalidInputError(
                "seq_lens_cpu", "the host twin of seq_lens (attnsdk never syncs for it)", None
            )
        view = _GraphBatch(
            forward_mode=mode,
            batch_size=bs,
            req_pool_indices=req_pool_indices[:bs],
            seq_lens=seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu[:bs],
            out_cache_loc=no_slots[: bs * per_row],
            spec_info=step.spec_info,
        )
        self.backend.plan_for_replay(plan, self._adapter().build_metadata(view))
        self._plan = plan


@dataclass(frozen=True, slots=True)
class _GraphStep:
    """What the legacy (<= 0.5.12) graph hooks pass, under the names the new hooks' batch has."""

    forward_mode: Any
    spec_info: Any
    encoder_lens: torch.Tensor | None


def _graph_tokens_per_row(mode: ForwardMode, spec_info: Any, encoder_lens: Any) -> int:
    if encoder_lens is not None:
        refuse("CUDA graph", "encoder_lens", "cross-attention is not mapped")
    kind = step_kind(mode)
    if kind is StepKind.TARGET_VERIFY:
        return draft_token_num(spec_info)
    if kind is StepKind.DECODE and not (spec_info is not None and mode.is_decode()):
        return 1
    raise UnsupportedConfigError(
        f"forward_mode under CUDA graphs: expected DECODE, IDLE or TARGET_VERIFY, found {mode!r}"
        + (" with spec_info (EAGLE draft decode)" if kind is StepKind.DECODE else ""),
    )


def _heads(name: str, t: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """``t`` ([T, H*D] or [T, H, D]) as a (T, H, D) view; a wrong width is a typed error."""
    if t.dim() in (2, 3) and t.shape[1:].numel() == heads * dim:
        return t.reshape(t.shape[0], heads, dim)
    raise InvalidInputError(
        f"{name}.shape", f"(T, {heads} * {dim}) or (T, {heads}, {dim})", tuple(t.shape)
    )


def _short(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return repr(value)[:60]


@functools.cache
def sglang_backend_class() -> type[SGLangAttentionBackendImpl]:
    """The public ``SGLangAttentionBackend``: built on first use, with SGLang's
    ``AttentionBackend`` as a base when SGLang is installed (and its version checked)."""
    SGLANG_VERSIONS.check()
    return drop_in_class(
        SGLangAttentionBackendImpl,
        "SGLangAttentionBackend",
        "attnsdk.adapters.sglang",
        ("sglang.srt.layers.attention.base_attn_backend", "AttentionBackend"),
    )

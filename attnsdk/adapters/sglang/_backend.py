"""``SGLangAttentionBackend``: SGLang's ``AttentionBackend`` interface over any attnsdk backend.

SGLang calls ``init_forward_metadata`` once per eager step, then ``forward`` once per layer; its
CUDA-graph hooks (both generations) are in ``_graphs.SGLangGraphHooks``, mixed in. When SGLang is
installed the class subclasses SGLang's own ``AttentionBackend`` (see ``sglang_backend_class``),
so every member a runner reads that attnsdk does not define keeps SGLang's default.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.adapters._common import (
    EngineVersions,
    LayerEntry,
    LayerState,
    drop_in_class,
    engine_attr,
    refuse,
    resolve_backend,
)
from attnsdk.adapters.sglang._adapter import SGLangAdapter
from attnsdk.adapters.sglang._graphs import SEQ_LEN_FILL_VALUE, SGLangGraphHooks
from attnsdk.contract.capabilities import Feature
from attnsdk.contract.errors import InvalidInputError, UnsupportedConfigError
from attnsdk.contract.kv import KVCacheLayout
from attnsdk.contract.layer import LayerSpec

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from attnsdk.contract.backend import Backend
    from attnsdk.contract.plan import Plan
    from attnsdk.selection.config import AttentionConfig

__all__ = ["SEQ_LEN_FILL_VALUE", "SGLANG_VERSIONS", "SGLangAttentionBackendImpl"]

SGLANG_VERSIONS = EngineVersions("sglang", ("0.5.12.post1", "0.5.23"))
"""The SGLang releases the engine tier (``make test-engines``) runs the drop-in in."""


class SGLangAttentionBackendImpl(SGLangGraphHooks):
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

    MLA models (``attention_arch`` MLA: DeepSeek V2/V3, Kimi K2): the absorbed layer
    (``attn_mqa``, head_dim kv_lora_rank + rope) runs as an attnsdk MLA layer over the
    ``MLATokenToKVPool`` buffer, in both of SGLang's call forms: q ``[T, H*(rank+rope)]`` with
    k the whole latent row, or q ``[T, H*rank]`` and k ``[T, 1, rank]`` with ``q_rope`` /
    ``k_rope`` keywords (DeepSeek's ``forward_absorb``). Captured steps write the latent
    through the pool's ``set_mla_kv_buffer`` (``set_kv_buffer`` for whole rows). The latent
    is stored without a scale, as SGLang's pool does. DeepSeek's expanded prefill layer
    (``attn_mha``: q / k of qk_nope + rope dims and v of its own, which never touch the cache)
    runs as ``Backend.forward_ragged`` over the keys ``SGLangAdapter.mha_metadata`` reads off
    the batch (the new tokens, every key in one shot, or one prefix chunk with its
    log-sum-exp), and returns ``[T, H, Dv]`` as SGLang's FA3 backend does; a backend without
    ragged attention refuses it with its reasons.
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
        self.device = torch.device(engine_attr(model_runner, "model_runner", "device"))
        self.page_size = int(engine_attr(model_runner, "model_runner", "page_size"))
        # SGLang 0.5.13+'s EAGLE verify sizes its tree mask from this when a batch carries no
        # seq_lens_sum (eagle_worker_common.build_eagle_verify_input), as with FA3.
        config = engine_attr(model_runner, "model_runner", "model_config")
        self.max_context_len = int(engine_attr(config, "model_config", "context_len"))
        self.attention_chunk_size = _chunk_size(model_runner)
        """The model's chunked local attention (Llama 4), for its layers with ``use_irope``."""
        self.kv_lora_rank = _kv_lora_rank(model_runner)
        """An MLA model's latent dims (DeepSeek: 512), whose pool is ``MLATokenToKVPool``;
        None for other models."""
        # SGLang 0.5.13+ reads both pools off the attention backend (forward_context.py).
        self.req_to_token_pool = engine_attr(model_runner, "model_runner", "req_to_token_pool")
        self.token_to_kv_pool = engine_attr(model_runner, "model_runner", "token_to_kv_pool")
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
        self._ragged: tuple[Plan | None, dict[tuple[object, ...], Plan]] = (None, {})
        """The step plan the ragged plans below belong to, and those plans by kind of call."""
        self._layers = LayerState()
        self._mha_specs: dict[tuple[object, ...], LayerSpec] = {}
        """The expanded-prefill layers' specs by ``_shape``, sinks and prefix-chunk flag."""
        self._graph = None
        self._graph_plans = {}

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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[T, Hq*D]``, k/v ``[T, Hkv*D|Dv]`` (or None) → ``[T, Hq*Dv]`` in q's dtype; with
        ``return_lse=True`` (or ``forward_batch.mha_return_lse``) ``(output, lse)`` as SGLang's
        FA3 backend returns them, lse ``[T, Hq]`` fp32 (natural log, ``forward(lse=)``).

        IDLE batches return an empty output without attending, as SGLang's base class does
        (SGLang runs them without ``init_forward_metadata``).
        """
        if engine_attr(forward_batch, "forward_batch", "forward_mode").is_idle():
            heads = engine_attr(layer, "layer", "tp_q_head_num")
            out = q.new_empty(q.shape[0], heads * engine_attr(layer, "layer", "v_head_dim"))
            if _wants_lse(forward_batch, kwargs):
                return out, q.new_empty(q.shape[0], heads, dtype=torch.float32)
            return out
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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode steps."""
        return self._attend(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

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
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        sinks = kwargs.pop("sinks", None)
        want_lse = _wants_lse(fb, kwargs)
        kwargs.pop("return_lse", None)
        q_rope = k_rope = None
        if self.kv_lora_rank is not None:
            q_rope, k_rope = kwargs.pop("q_rope", None), kwargs.pop("k_rope", None)
        # SGLang's runners and models pass more keywords (q_rope / k_rope, fp8 q/k/v descales,
        # score_mod, rel_bias, ...): at None / False they ask for nothing; anything else asks
        # for what this drop-in does not serve yet, which is refused, not ignored.
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
        if self.kv_lora_rank is not None and self._expanded(layer):
            return self._attend_mha(q, k, v, layer, fb, save_kv_cache, plan, sinks, want_lse)
        entry = self._layer(layer, q.dtype, sinks is not None)
        spec, cache = entry.spec, entry.cache
        rows = q.shape[0]
        if spec.mla:
            return self._attend_mla(
                q, k, q_rope, k_rope, layer, fb, save_kv_cache, entry, plan, want_lse
            )
        q3 = _heads("q", q, spec.num_heads, spec.head_dim)
        k3 = v3 = None
        if (k is None) != (v is None):
            raise InvalidInputError("k/v", "both tensors or both None", "only one of them")
        if save_kv_cache and k is not None and v is not None:
            k3 = _heads("k", k, spec.num_kv_heads, spec.head_dim)
            v3 = _heads("v", v, spec.num_kv_heads, spec.v_dim)
            if plan.graph is not None:
                k_scale, v_scale = _scales(layer)
                loc = engine_attr(fb, "forward_batch", "out_cache_loc")
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k3, v3, k_scale, v_scale)
                k3 = v3 = None  # written: the attnsdk backend only attends
        k_scale, v_scale = _scales(layer) if cache.layout.is_quantized else (None, None)
        lse = (
            torch.empty(rows, spec.num_heads, dtype=torch.float32, device=q.device)
            if want_lse
            else None
        )
        out = self.backend.forward(
            q3,
            k3,
            v3,
            cache,
            plan,
            spec,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
            lse=lse,
        )
        out = out.reshape(rows, spec.num_heads * spec.v_dim)
        return (out, lse) if lse is not None else out

    def _attend_mla(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        q_rope: torch.Tensor | None,
        k_rope: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
        entry: LayerEntry,
        plan: Plan,
        want_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The absorbed MLA layer: q and the new latent rows as (T, H, rank + rope) and
        (T, 1, rank + rope), from either of SGLang's call forms (see the class docstring)."""
        spec, cache = entry.spec, entry.cache
        rank, heads, rows = spec.v_dim, spec.num_heads, q.shape[0]
        rope = spec.head_dim - rank
        if q_rope is not None:
            q3 = torch.cat(
                [_heads("q", q, heads, rank), _heads("q_rope", q_rope, heads, rope)], dim=-1
            )
        else:
            q3 = _heads("q", q, heads, spec.head_dim)
        k3 = None
        if save_kv_cache and k is not None:
            if k_rope is not None:
                k3 = torch.cat([_heads("k", k, 1, rank), _heads("k_rope", k_rope, 1, rope)], -1)
            else:
                k3 = _heads("k", k, 1, spec.head_dim)
            if plan.graph is not None:
                # A replayed step's slots live in the graph runner's out_cache_loc only; the
                # pool's MLA door for split latent and rope (its combined-row one has no
                # decode-context-parallel write path).
                pool, loc = self.token_to_kv_pool, engine_attr(fb, "forward_batch", "out_cache_loc")
                if k_rope is not None:
                    pool.set_mla_kv_buffer(layer, loc, k3[..., :rank], k3[..., rank:])
                else:
                    pool.set_kv_buffer(layer, loc, k3, k3[..., :rank])
                k3 = None
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device) if want_lse else None
        # SGLang's MLA pool casts the latent to fp8 without a scale, and reads it back so.
        out = self.backend.forward(q3, k3, None, cache, plan, spec, lse=lse)
        out = out.reshape(rows, heads * rank)
        return (out, lse) if lse is not None else out

    def _expanded(self, layer: RadixAttention) -> bool:
        """Whether ``layer`` is an MLA model's expanded prefill layer: its head dims are not
        the latent pool's row."""
        layer_id = _shape(layer)[0]
        pool = self.token_to_kv_pool
        k_buf = engine_attr(pool, "token_to_kv_pool", "get_key_buffer")(layer_id)
        return int(layer.head_dim) != k_buf.shape[-1]

    def _attend_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
        plan: Plan,
        sinks: torch.Tensor | None,
        want_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's ``attn_mha`` (see the class docstring): ragged attention, no cache."""
        where = f"layer {_shape(layer)[0]} (an MLA model's expanded prefill, attn_mha)"
        if k is None or v is None:
            refuse(where, "k/v", "are required: this layer's keys come with the call")
        if save_kv_cache:
            refuse(
                where,
                "save_kv_cache",
                "must be False: the cache holds the latent, written through set_mla_kv_buffer",
            )
        owner, plans = self._ragged
        if owner is not plan:
            owner, plans = plan, {}
            self._ragged = (owner, plans)
        attend = getattr(fb, "attn_attend_prefix_cache", None)
        kind = (attend, getattr(fb, "prefix_chunk_idx", None) if attend else None,
                bool(getattr(fb, "mha_one_shot", False)))  # fmt: skip
        ragged = plans.get(kind)
        if ragged is None:
            meta = self._adapter().mha_metadata(fb, plan.metadata)
            ragged = plans[kind] = self.backend.plan(meta)
        cross = ragged.metadata.cross_attention
        key = (*_shape(layer), sinks is not None, cross)
        spec = self._mha_specs.get(key)
        if spec is None:  # built once per layer shape, not per call (it validates)
            spec = self.adapter.layer_spec(layer, has_sinks=sinks is not None)
            if cross:  # a prefix chunk: every key is before the queries
                spec = dataclasses.replace(spec, causal=False)
            self._mha_specs[key] = spec
        forward_ragged = getattr(self.backend, "forward_ragged", None)
        if forward_ragged is None:
            refuse(where, "backend", f"{self.backend.name!r} has no forward_ragged")
        heads, rows = spec.num_heads, q.shape[0]
        q3 = _heads("q", q, heads, spec.head_dim)
        k3 = _heads("k", k, spec.num_kv_heads, spec.head_dim).to(q.dtype)
        v3 = _heads("v", v, spec.num_kv_heads, spec.v_dim).to(q.dtype)
        lse = torch.empty(rows, heads, dtype=torch.float32, device=q.device) if want_lse else None
        try:
            out = forward_ragged(q3, k3, v3, ragged, spec, sinks=sinks, lse=lse)
        except UnsupportedConfigError as err:
            raise UnsupportedConfigError(
                f"{where}: {str(err).splitlines()[0]} (or pin DeepSeek's dispatch to the "
                "absorbed layer: docs/adapters/sglang.md, MLA)",
                err.reasons,
            ) from err
        return (out, lse) if lse is not None else out

    def _layer(self, layer: RadixAttention, dtype: torch.dtype, sinks: bool) -> LayerEntry:
        shape = _shape(layer)
        layer_id = shape[0]
        pool = self.token_to_kv_pool
        k_buf = engine_attr(pool, "token_to_kv_pool", "get_key_buffer")(layer_id)
        v_buf = engine_attr(pool, "token_to_kv_pool", "get_value_buffer")(layer_id)
        fingerprint = (
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            k_buf.shape,
            v_buf.shape,
            k_buf.dtype,
            dtype,
            sinks,
            *shape,
        )

        def build() -> LayerEntry:
            rank = self.kv_lora_rank
            spec = self.adapter.layer_spec(
                layer,
                has_sinks=sinks,
                attention_chunk_size=self.attention_chunk_size,
                mla=rank is not None,
            )
            cache = self.adapter.kv_cache(
                k_buf, None if rank is not None else v_buf, dtype=dtype, kv_lora_rank=rank
            )
            reasons = self.backend.unsupported_reasons(spec, cache.layout, self.device)
            if reasons:
                raise UnsupportedConfigError(
                    f"backend {self.backend.name!r} cannot serve layer {layer_id}:", reasons
                )
            return LayerEntry(spec, cache)

        return self._layers.get(layer_id, fingerprint, build)

    def _default_adapter(self) -> SGLangAdapter:
        return SGLangAdapter(req_to_token=self._req_to_token(), page_size=self.page_size)

    def _req_to_token(self) -> Any:
        return engine_attr(self.req_to_token_pool, "req_to_token_pool", "req_to_token")

    def _adapter(self) -> SGLangAdapter:
        """The adapter for this step: rebuilt if SGLang swapped the request pool (frozen-KV MTP
        swaps the pools on the backend), unless the integrator supplied one."""
        if not self._fixed_adapter and self._req_to_token() is not self.adapter.req_to_token:
            self.adapter = self._default_adapter()
        return self.adapter

    def _model_shape(self) -> tuple[LayerSpec, KVCacheLayout]:
        """The model's layer and cache, from its config (total heads: what the capabilities
        depend on, ratios and dims, is the same per rank)."""
        runner = self.model_runner
        cfg = engine_attr(runner, "model_runner", "model_config")
        dtype = engine_attr(runner, "model_runner", "dtype")
        kv_dtype = engine_attr(runner, "model_runner", "kv_cache_dtype")
        heads = int(engine_attr(cfg, "model_config", "num_attention_heads"))
        if self.kv_lora_rank is not None:
            rank, rope = self.kv_lora_rank, int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
            return (
                LayerSpec.for_mla(heads, kv_lora_rank=rank, rope_dim=rope),
                KVCacheLayout.for_mla(
                    self.page_size, kv_lora_rank=rank, rope_dim=rope, dtype=dtype, kv_dtype=kv_dtype
                ),
            )
        total_kv = cfg.get_total_num_kv_heads() if hasattr(cfg, "get_total_num_kv_heads") else None
        num_kv = int(total_kv or engine_attr(cfg, "model_config", "num_key_value_heads"))
        head_dim = int(engine_attr(cfg, "model_config", "head_dim"))
        spec = LayerSpec(num_heads=heads, num_kv_heads=num_kv, head_dim=head_dim)
        return spec, KVCacheLayout(
            num_kv, spec.head_dim, self.page_size, dtype=dtype, kv_dtype=kv_dtype
        )

    def _check_model(self) -> None:
        """Fail at start-up, not at the first batch, when the model cannot run on the backend."""
        runner = self.model_runner
        what = "SGLangAttentionBackend"
        translator = getattr(runner, "kv_index_translator", None)
        if getattr(translator, "is_translating", False):
            refuse(what, "kv_index_translator", "req_to_token holds virtual ids (unified memory)")
        if getattr(self.token_to_kv_pool, "swa_layer_nums", 0):
            refuse(what, "token_to_kv_pool", "hybrid sliding-window pools are not mapped")
        server_args = getattr(runner, "server_args", None)
        algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
        topk = getattr(server_args, "speculative_eagle_topk", None)
        if algorithm == "NGRAM" or (isinstance(topk, int) and topk > 1):
            tree = f"tree speculative decoding ({algorithm or 'EAGLE'}, topk {topk})"
            if Feature.TREE_MASK not in self.backend.capabilities.features:
                refuse(
                    what,
                    "speculative_eagle_topk",
                    f"{tree} needs a backend with tree masks (reference, flex, fa3); "
                    f"{self.backend.name!r} has none",
                )
        spec, layout = self._model_shape()
        reasons = self.backend.unsupported_reasons(spec, layout, self.device)
        if self.attention_chunk_size is not None:
            chunked = dataclasses.replace(spec, attention_chunk_size=self.attention_chunk_size)
            reasons += self.backend.unsupported_reasons(chunked, layout, self.device)
        if reasons:
            raise UnsupportedConfigError(
                f"backend {self.backend.name!r} cannot serve this model:", sorted(set(reasons))
            )


def _kv_lora_rank(model_runner: ModelRunner) -> int | None:
    """An MLA model's ``kv_lora_rank`` (``model_config.attention_arch`` is MLA), else None."""
    cfg = engine_attr(model_runner, "model_runner", "model_config")
    if getattr(getattr(cfg, "attention_arch", None), "name", "MHA") != "MLA":
        return None
    rank = getattr(cfg, "kv_lora_rank", None)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidInputError(
            "model_config.kv_lora_rank", "an int >= 1 for an MLA model", repr(rank)
        )
    return rank


def _chunk_size(model_runner: ModelRunner) -> int | None:
    """``model_runner.attention_chunk_size`` (from the model's config; absent or None: no
    chunked layers), checked."""
    value = getattr(model_runner, "attention_chunk_size", None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInputError(
            "model_runner.attention_chunk_size", "None or an int >= 1", repr(value)
        )
    return value


def _wants_lse(fb: ForwardBatch, kwargs: dict[str, Any]) -> bool:
    """SGLang asks for the log-sum-exp per call (``return_lse=True``, 0.5.13+) or per batch
    (``ForwardBatch.mha_return_lse``, set for MHA chunked prefill); its callers then unpack
    ``(output, lse)``."""
    return bool(kwargs.get("return_lse") or getattr(fb, "mha_return_lse", False))


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


_SHAPE_FIELDS = (
    "layer_id",
    "tp_q_head_num",
    "tp_k_head_num",
    "head_dim",
    "v_head_dim",
    "scaling",
    "sliding_window_size",
    "logit_cap",
    "attn_type",
)
_shape_fields = operator.attrgetter(*_SHAPE_FIELDS)


def _shape(layer: RadixAttention) -> tuple[object, ...]:
    """What a ``LayerSpec`` is derived from, of a SGLang layer (with ``layer_id`` first: an id
    reused by a draft model's layer of another shape is another key). Read on every forward,
    so in one ``attrgetter``; only a missing attribute pays for finding which, to name it."""
    try:
        fields = _shape_fields(layer)
    except AttributeError:
        for name in _SHAPE_FIELDS:
            engine_attr(layer, "layer", name)
        raise
    return (*fields, getattr(layer, "use_irope", False))


def _scales(layer: RadixAttention) -> tuple[Any, Any]:
    """The layer's ``k_scale`` / ``v_scale`` (SGLang hands them to the pool and the kernel)."""
    return engine_attr(layer, "layer", "k_scale"), engine_attr(layer, "layer", "v_scale")

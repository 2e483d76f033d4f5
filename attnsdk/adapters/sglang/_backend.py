"""``SGLangAttentionBackend``: SGLang's ``AttentionBackend`` interface over any attnsdk backend.

SGLang calls ``init_forward_metadata`` once per eager step, then ``forward`` once per layer. The
other halves are mixed in: the start-up declaration of the model (``_startup.SGLangStartup``),
MLA models' layers (``_mla.SGLangMLALayers``) and the CUDA-graph hooks of both generations
(``_graphs.SGLangGraphHooks``). When SGLang is installed the class subclasses SGLang's own
``AttentionBackend`` (see ``sglang_backend_class``), so every member a runner reads that attnsdk
does not define keeps SGLang's default.
"""

from __future__ import annotations

import functools
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
from attnsdk.adapters.sglang._layer import as_heads, kv_scales, layer_fingerprint, layer_shape
from attnsdk.adapters.sglang._mla import SGLangMLALayers
from attnsdk.adapters.sglang._startup import SGLangStartup, read_chunk_size, read_kv_lora_rank
from attnsdk.contract.errors import InvalidInputError, UnsupportedConfigError

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


class SGLangAttentionBackendImpl(SGLangStartup, SGLangMLALayers, SGLangGraphHooks):
    """Drop-in SGLang attention backend: SGLang's method names, an attnsdk backend underneath.

    Import it as ``attnsdk.adapters.sglang.SGLangAttentionBackend`` (this class with SGLang's
    ``AttentionBackend`` mixed in when SGLang is installed). ``backend`` is a backend name, an
    ``AttentionConfig`` or a ``Backend`` instance; ``adapter`` lets an integrator pass an
    ``SGLangAdapter`` subclass.

    Start-up: construction declares the model to the backend once (``Backend.prepare``): every
    ``RadixAttention`` layer of ``model_runner.model``, with the KV layout of its pool buffers,
    so the backend plans every layer shape from the first step on. A model it cannot serve
    raises ``UnsupportedConfigError`` with every reason, each naming its layers
    (``layers[3].softcap``). What SGLang hands only to ``forward`` is prepared there: ``sinks=``
    (a model passes its sink logits per call) and a compute dtype other than the runner's. A
    runner without model layers (SGLang's attention test kit) is checked from its config.

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
        self.attention_chunk_size = read_chunk_size(model_runner)
        """The model's chunked local attention (Llama 4), for its layers with ``use_irope``."""
        self.kv_lora_rank = read_kv_lora_rank(model_runner)
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
        self._plan: Plan | None = None
        self._ragged = (None, {})
        self._layers = LayerState()
        self._mha_specs = {}
        self._graph = None
        self._graph_plans = {}
        self._check_model()

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
        (SGLang runs them without ``init_forward_metadata``). One attnsdk call serves every
        other mode, so ``forward_extend`` and ``forward_decode`` are this method.
        """
        fb = forward_batch
        if engine_attr(fb, "forward_batch", "forward_mode").is_idle():
            heads = engine_attr(layer, "layer", "tp_q_head_num")
            out = q.new_empty(q.shape[0], heads * engine_attr(layer, "layer", "v_head_dim"))
            if _wants_lse(fb, kwargs):
                return out, q.new_empty(q.shape[0], heads, dtype=torch.float32)
            return out
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
        if entry.spec.mla:
            return self._attend_mla(
                q, k, q_rope, k_rope, layer, fb, save_kv_cache, entry, plan, want_lse
            )
        return self._attend(q, k, v, layer, fb, save_kv_cache, entry, plan, sinks, want_lse)

    # SGLang's base ``forward`` dispatches to these by mode; this one serves every mode.
    forward_extend = forward_decode = forward

    # -- internals --------------------------------------------------------------------------

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        fb: ForwardBatch,
        save_kv_cache: bool,
        entry: LayerEntry,
        plan: Plan,
        sinks: torch.Tensor | None,
        want_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """A layer over the paged K/V pool: q ``[T, Hq*D]``, new K/V written at the step's
        slots (eagerly by ``Backend.forward``, in a captured graph through the pool)."""
        spec, cache = entry.spec, entry.cache
        rows = q.shape[0]
        q3 = as_heads("q", q, spec.num_heads, spec.head_dim)
        k3 = v3 = None
        if (k is None) != (v is None):
            raise InvalidInputError("k/v", "both tensors or both None", "only one of them")
        if save_kv_cache and k is not None and v is not None:
            k3 = as_heads("k", k, spec.num_kv_heads, spec.head_dim)
            v3 = as_heads("v", v, spec.num_kv_heads, spec.v_dim)
            if plan.graph is not None:
                k_scale, v_scale = kv_scales(layer)
                loc = engine_attr(fb, "forward_batch", "out_cache_loc")
                self.token_to_kv_pool.set_kv_buffer(layer, loc, k3, v3, k_scale, v_scale)
                k3 = v3 = None  # written: the attnsdk backend only attends
        k_scale, v_scale = kv_scales(layer) if cache.layout.is_quantized else (None, None)
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

    def _layer(self, layer: RadixAttention, dtype: torch.dtype, sinks: bool) -> LayerEntry:
        shape = layer_shape(layer)
        layer_id = shape[0]
        k_buf, v_buf = self._buffers(layer_id)

        def build() -> LayerEntry:
            entry = self._entry(layer, k_buf, v_buf, dtype, sinks)
            reasons = self.backend.unsupported_reasons(entry.spec, entry.cache.layout, self.device)
            if reasons:
                raise UnsupportedConfigError(
                    f"backend {self.backend.name!r} cannot serve layer {layer_id}:", reasons
                )
            return entry

        return self._layers.get(
            layer_id, layer_fingerprint(shape, k_buf, v_buf, dtype, sinks), build
        )

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


def _wants_lse(fb: ForwardBatch, kwargs: dict[str, Any]) -> bool:
    """SGLang asks for the log-sum-exp per call (``return_lse=True``, 0.5.13+) or per batch
    (``ForwardBatch.mha_return_lse``, set for MHA chunked prefill); its callers then unpack
    ``(output, lse)``."""
    return bool(kwargs.get("return_lse") or getattr(fb, "mha_return_lse", False))


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

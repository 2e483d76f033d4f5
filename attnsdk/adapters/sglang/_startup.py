"""The start-up half of the SGLang drop-in: the model is declared to the backend once.

SGLang builds the attention backend after it has loaded the model and allocated the KV pool,
so the drop-in's constructor can declare every ``RadixAttention`` layer, with the KV layout of
its pool buffers, to the attnsdk backend (``Backend.prepare``, through ``declare_model``), and
fail there, with every reason of every layer, when the model cannot run on it. A runner without
model layers (SGLang's attention test kit) is checked from its config.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from attnsdk.adapters._common import LayerEntry, ModelLayer, declare_model, engine_attr, refuse
from attnsdk.adapters.sglang._layer import is_radix_attention, layer_fingerprint, layer_shape
from attnsdk.contract.capabilities import Feature
from attnsdk.contract.errors import InvalidInputError, Reason, UnsupportedConfigError
from attnsdk.contract.kv import KVCacheLayout
from attnsdk.contract.layer import LayerSpec

if TYPE_CHECKING:
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner import ModelRunner

    from attnsdk.adapters._common import LayerState
    from attnsdk.adapters.sglang._adapter import SGLangAdapter
    from attnsdk.contract.backend import Backend

__all__ = ["SGLangStartup", "read_chunk_size", "read_kv_lora_rank"]


class SGLangStartup:
    """The drop-in's start-up check (``SGLangAttentionBackendImpl`` mixes it in and calls
    ``_check_model`` at the end of its constructor), and how a layer's spec and cache are built
    (``_entry``: here at start-up, by the drop-in at a layer's first forward otherwise).

    Reads the drop-in's runner, pools, adapter, backend and model dims; fills its ``_layers``
    with each declared layer's spec and cache, which the layer's first forward reuses.
    """

    model_runner: ModelRunner
    device: torch.device
    page_size: int
    backend: Backend
    adapter: SGLangAdapter
    token_to_kv_pool: Any
    attention_chunk_size: int | None
    kv_lora_rank: int | None
    _layers: LayerState

    if TYPE_CHECKING:

        def _expanded(self, layer: RadixAttention) -> bool: ...

    # -- each layer's spec and cache ------------------------------------------------------

    def _buffers(self, layer_id: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers in the runner's pool."""
        pool = self.token_to_kv_pool
        k_buf = engine_attr(pool, "token_to_kv_pool", "get_key_buffer")(layer_id)
        v_buf = engine_attr(pool, "token_to_kv_pool", "get_value_buffer")(layer_id)
        return k_buf, v_buf

    def _entry(
        self,
        layer: RadixAttention,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        dtype: torch.dtype,
        sinks: bool,
    ) -> LayerEntry:
        """The layer's ``LayerSpec`` and its pool buffers as a ``KVCache`` (not checked)."""
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
        return LayerEntry(spec, cache)

    # -- the model -----------------------------------------------------------------------

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

    def _declare_model(self) -> bool:
        """Declare every attention layer of the runner's model to the backend (``prepare``,
        through ``declare_model``) and keep each one's spec and cache for its first forward.
        False when the runner has no model layers to read.

        A ``RadixAttention`` is known by its attributes (SGLang is not imported). An MLA
        model's expanded prefill layer (``attn_mha``: no cache, ``forward_ragged``) is left
        out: DeepSeek's dispatch may never call it (docs/adapters/sglang.md, MLA), so it is
        checked at its first call. A layer attnsdk cannot map (cross-attention, another logit
        capping) is refused here, named, beside the backend's reasons for the others."""
        model = getattr(self.model_runner, "model", None)
        modules = getattr(model, "modules", None)
        if not callable(modules):
            return False
        layers = [m for m in modules() if is_radix_attention(m)]
        if not layers:
            return False
        dtype = engine_attr(self.model_runner, "model_runner", "dtype")
        declared: list[ModelLayer] = []
        refused: list[Reason] = []
        for layer in layers:
            if self.kv_lora_rank is not None and self._expanded(layer):
                continue
            shape = layer_shape(layer)
            name = f"layers[{shape[0]}]"
            try:
                k_buf, v_buf = self._buffers(shape[0])
            except (IndexError, KeyError):
                raise InvalidInputError(
                    f"{name}.layer_id",
                    "a layer of the runner's KV pool (token_to_kv_pool.get_key_buffer)",
                    shape[0],
                ) from None
            try:
                entry = self._entry(layer, k_buf, v_buf, dtype, False)
            except UnsupportedConfigError as err:
                refused += [Reason(r.kind, f"{name}.{r.field}", r.message) for r in err.reasons]
                continue
            fingerprint = layer_fingerprint(shape, k_buf, v_buf, dtype, False)
            self._layers.put(shape[0], fingerprint, entry)
            declared.append(ModelLayer(name, entry.spec, entry.cache.layout))
        declare_model(
            self.backend, declared, self.device, "SGLangAttentionBackend", refused=refused
        )
        return True

    def _check_model(self) -> None:
        """Fail at start-up, not at the first batch, when the model cannot run on the backend:
        declare its layers (``_declare_model``), or check the shape its config gives."""
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
        if self._declare_model():
            return
        spec, layout = self._model_shape()
        reasons = self.backend.unsupported_reasons(spec, layout, self.device)
        if self.attention_chunk_size is not None:
            chunked = dataclasses.replace(spec, attention_chunk_size=self.attention_chunk_size)
            reasons += self.backend.unsupported_reasons(chunked, layout, self.device)
        if reasons:
            raise UnsupportedConfigError(
                f"backend {self.backend.name!r} cannot serve this model:", sorted(set(reasons))
            )


def read_kv_lora_rank(model_runner: ModelRunner) -> int | None:
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


def read_chunk_size(model_runner: ModelRunner) -> int | None:
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

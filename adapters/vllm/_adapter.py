"""``VLLMAdapter``: vLLM's ``CommonAttentionMetadata`` and KV tensors → attnsdk types.

vLLM is never imported: its objects are read by attribute name (duck typing). Field mapping
(docs/adapters/vllm.md has the table)::

    query_start_loc[: num_reqs + 1]      -> query_start_loc        (device, int32)
    query_start_loc_cpu[: num_reqs + 1]  -> query_start_loc_cpu    (host)
    seq_lens[: num_reqs]                 -> seq_lens               (device, exact)
    host copy of seq_lens (see below)    -> seq_lens_cpu           (host)
    block_table_tensor[: num_reqs]       -> page_table             (block ids, as they are)
    slot_mapping[: num_actual_tokens]    -> slot_mapping           (-1 = padding: not written)
    max_query_len / max_seq_len          -> max_query_len / max_seq_len
    causal                               -> LayerSpec.causal (per step; see ``causal``)

vLLM pads CUDA-graph batches with requests of query length 0 (repeated ``query_start_loc``),
``seq_len`` 0 and a block-table row of null block 0; they pass through unchanged and no
backend reads or writes anything for them.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from attnsdk import AttentionMetadata, InvalidInputError, InvalidMetadataError, LayerSpec
from attnsdk.adapters.vllm._layout import VLLMKVLayout, wrap_kv_cache

if TYPE_CHECKING:
    from attnsdk import KVCache

__all__ = ["ENCODER_ONLY", "VLLMAdapter"]

ENCODER_ONLY = "encoder_only"
"""``AttentionType.ENCODER_ONLY.value``: bidirectional attention (BERT-style), no causal mask."""
NON_CAUSAL_TYPES = frozenset({"encoder", "encoder_only"})
"""vLLM attention types that attend bidirectionally and keep no KV cache of their own."""


class VLLMAdapter:
    """Turns vLLM's per-step and per-layer objects into attnsdk's. Subclass to adapt a fork.

    Each field is read by one small method, so a fork that renames or moves a field overrides
    just that method: ``host_seq_lens``, ``page_table``, ``slot_mapping``, ``causal``.

    >>> from attnsdk.adapters.vllm.testing import mock_common_attn_metadata
    >>> from attnsdk.testing import BatchSpec
    >>> cm = mock_common_attn_metadata(BatchSpec((1, 3), (5, 3)), block_size=16)
    >>> meta = VLLMAdapter().build_metadata(cm)
    >>> meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist(), meta.num_tokens
    ([0, 1, 4], [5, 3], 4)
    """

    def build_metadata(self, common_attn_metadata: Any) -> AttentionMetadata:
        """``AttentionMetadata`` from a ``CommonAttentionMetadata`` without a device sync.

        The tensors are adopted as they are (no copy when dtypes match, as they do in vLLM).
        """
        cm = common_attn_metadata
        num_reqs = _int_field(cm, "num_reqs")
        qsl_cpu = _tensor_field(cm, "query_start_loc_cpu")[: num_reqs + 1]
        if qsl_cpu.device.type != "cpu":
            raise InvalidMetadataError("query_start_loc_cpu.device", "cpu", qsl_cpu.device)
        if qsl_cpu.shape[0] != num_reqs + 1:
            raise InvalidMetadataError(
                "query_start_loc_cpu", f"num_reqs + 1 = {num_reqs + 1} entries", qsl_cpu.shape[0]
            )
        seq_lens = _tensor_field(cm, "seq_lens")[:num_reqs]
        if seq_lens.shape[0] != num_reqs:
            raise InvalidMetadataError(
                "seq_lens", f"num_reqs = {num_reqs} entries", seq_lens.shape[0]
            )
        return AttentionMetadata.from_tensors(
            query_start_loc=_tensor_field(cm, "query_start_loc")[: num_reqs + 1],
            seq_lens=seq_lens,
            page_table=self.page_table(cm, num_reqs),
            slot_mapping=self.slot_mapping(cm),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=self.host_seq_lens(cm, num_reqs, qsl_cpu),
            max_query_len=_int_field(cm, "max_query_len"),
            max_seq_len=_int_field(cm, "max_seq_len"),
        )

    # Hooks: one per vLLM field that has moved or changed meaning across versions.

    def page_table(self, cm: Any, num_reqs: int) -> torch.Tensor:
        """(B, W) block ids: vLLM's block table rows are pages as they are (block 0 is null)."""
        table = _tensor_field(cm, "block_table_tensor")
        if table.dim() != 2:
            raise InvalidMetadataError(
                "block_table_tensor", "2 dims (num_reqs, W)", tuple(table.shape)
            )
        return table[:num_reqs]

    def slot_mapping(self, cm: Any) -> torch.Tensor:
        """(T,) slots of the new tokens; rows past ``num_actual_tokens`` are graph padding."""
        slots = _tensor_field(cm, "slot_mapping")
        return slots[: _int_field(cm, "num_actual_tokens")]

    def host_seq_lens(
        self, cm: Any, num_reqs: int, query_start_loc_cpu: torch.Tensor
    ) -> torch.Tensor:
        """(B,) host copy of ``seq_lens`` without a device sync, from the first source present.

        1. ``seq_lens`` itself when it lives on the CPU (free and exact);
        2. ``seq_lens_cpu`` when it is a plain attribute (vLLM <= 0.11: a dataclass field);
        3. ``_seq_lens_cpu`` (recent vLLM's cached exact copy, when it was filled);
        4. ``seq_lens_cpu_upper_bound`` (recent vLLM). It is exact except for async speculative
           decoding rows, where it assumes every draft was accepted: device ``seq_lens`` stay
           exact, so kernels that take device lengths (fa3) are right, but a backend that loops
           over host lengths (reference) would read too far. Override this hook to sync then.
        5. ``num_computed_tokens_cpu`` / ``_num_computed_tokens_cpu`` + host query lengths.

        Recent vLLM's ``seq_lens_cpu`` property is never touched: it syncs and warns.
        """
        seq_lens = _tensor_field(cm, "seq_lens")
        if seq_lens.device.type == "cpu":
            return seq_lens[:num_reqs]
        candidates = []
        if not isinstance(inspect.getattr_static(cm, "seq_lens_cpu", None), property):
            candidates.append("seq_lens_cpu")
        candidates += ["_seq_lens_cpu", "seq_lens_cpu_upper_bound"]
        for name in candidates:
            value = getattr(cm, name, None)
            if value is not None:
                return _host_tensor(name, value)[:num_reqs]
        for name in ("num_computed_tokens_cpu", "_num_computed_tokens_cpu"):
            if isinstance(inspect.getattr_static(cm, name, None), property):
                continue
            value = getattr(cm, name, None)
            if value is not None:
                computed = _host_tensor(name, value)[:num_reqs]
                return computed + (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1])
        raise InvalidMetadataError(
            "seq_lens_cpu_upper_bound",
            "a host copy of seq_lens (seq_lens_cpu_upper_bound, seq_lens_cpu, _seq_lens_cpu or "
            "num_computed_tokens_cpu)",
            "none of them",
            "the adapter never syncs the device; override VLLMAdapter.host_seq_lens to supply one",
        )

    def causal(self, cm: Any) -> bool:
        """The step's ``causal`` flag (a bool, or a host bool tensor that must be uniform)."""
        value = getattr(cm, "causal", True)
        if isinstance(value, torch.Tensor):
            if value.device.type != "cpu":
                raise InvalidMetadataError(
                    "causal",
                    "a bool or a host tensor (reading a device tensor would sync)",
                    value.device,
                )
            if value.numel() and bool((value != value.reshape(-1)[0]).any()):
                raise InvalidMetadataError(
                    "causal",
                    "the same value for every request (per-request masks are not supported)",
                    value.tolist(),
                )
            return bool(value.reshape(-1)[0]) if value.numel() else True
        return bool(value)

    # Per-layer objects.

    def kv_cache(
        self,
        kv_cache_tensor: torch.Tensor,
        num_kv_heads: int,
        head_size: int,
        *,
        dtype: torch.dtype | None = None,
        kv_cache_dtype: str | torch.dtype | None = None,
        layout: VLLMKVLayout | str | None = None,
    ) -> KVCache:
        """Zero-copy K/V views of one layer's vLLM cache, the layout read from the tensor.

        Accepts ``[2, N, P, Hkv, D]``, ``[N, 2, P, Hkv, D]`` and ``[N, Hkv, P, 2D]`` over any
        stride order. ``kv_cache_dtype`` is vLLM's string ("auto", "fp8", "fp8_e4m3",
        "fp8_e5m2"): fp8 caches come as uint8 and need the compute ``dtype``. ``layout``
        settles a 5-D tensor with N == 2, which reads as both stacked layouts. New K/V written
        through the returned cache land in ``kv_cache_tensor`` itself.
        """
        return wrap_kv_cache(
            kv_cache_tensor,
            num_kv_heads,
            head_size,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            layout=layout,
        )

    def layer_spec(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attn_type: str = "decoder",
        has_sinks: bool = False,
        causal: bool = True,
    ) -> LayerSpec:
        """``LayerSpec`` from ``AttentionImpl.__init__``'s arguments, in vLLM's conventions.

        vLLM passes the window as W (tokens seen, itself included), as attnsdk does; FA gets
        (W-1, 0), or (W-1, W-1) for encoder-only layers, which ``causal=False`` reproduces. A
        soft cap of 0 means none. Encoder(-only) layers are never causal.
        """
        kind = getattr(attn_type, "value", attn_type)
        if not isinstance(kind, str):
            raise InvalidInputError(
                "attn_type", "a vLLM AttentionType or its value", repr(attn_type)
            )
        return LayerSpec(
            num_heads=num_heads,
            num_kv_heads=num_heads if num_kv_heads is None else num_kv_heads,
            head_dim=head_size,
            scale=float(scale),
            causal=causal and kind not in NON_CAUSAL_TYPES,
            sliding_window=sliding_window,
            softcap=logits_soft_cap or None,
            has_sinks=has_sinks,
        )


def _tensor_field(obj: Any, name: str) -> torch.Tensor:
    value = getattr(obj, name, None)
    if not isinstance(value, torch.Tensor):
        raise InvalidMetadataError(
            name, "a torch.Tensor (CommonAttentionMetadata field)", type(value).__name__
        )
    return value


def _int_field(obj: Any, name: str) -> int:
    value = getattr(obj, name, None)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu":
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidMetadataError(
            name, "a host int >= 0 (CommonAttentionMetadata field)", repr(value)
        )
    return value


def _host_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)  # numpy arrays in some versions
    if value.device.type != "cpu":
        raise InvalidMetadataError(f"{name}.device", "cpu", value.device)
    return value

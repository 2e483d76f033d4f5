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

import contextlib
import dataclasses
import numbers
import sys
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.adapters._common import AttnKind
from attnsdk.adapters.vllm._layout import VLLMKVLayout, wrap_kv_cache
from attnsdk.contract.checks import check_positive_float, is_int_tensor
from attnsdk.contract.errors import InvalidInputError, InvalidMetadataError
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from attnsdk.contract.kv import KVCache

__all__ = ["VLLMAdapter", "vllm_attn_kind"]

_ATTN_KINDS = {
    "decoder": AttnKind.DECODER,
    "encoder": AttnKind.ENCODER,
    "encoder_only": AttnKind.ENCODER,
    "encoder_decoder": AttnKind.CROSS,
}
"""vLLM's ``AttentionType`` values attnsdk serves. ENCODER and ENCODER_ONLY attend
bidirectionally over this step's K/V and keep no cache; ENCODER_DECODER is cross-attention over
the encoder's cache (vLLM's ``CrossAttentionBuilder`` subclasses our builder)."""


def vllm_attn_kind(attn_type: object) -> AttnKind | None:
    """What a vLLM ``AttentionType`` (or its value) means for attnsdk; None = not served."""
    return _ATTN_KINDS.get(str(getattr(attn_type, "value", attn_type)))


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
        owned = int(qsl_cpu[-1])
        if _int_field(cm, "num_actual_tokens") < owned:
            raise InvalidMetadataError(
                "num_actual_tokens",
                f">= query_start_loc_cpu[num_reqs] = {owned} (the requests' tokens)",
                cm.num_actual_tokens,
            )
        return AttentionMetadata.from_tensors(
            query_start_loc=_tensor_field(cm, "query_start_loc")[: num_reqs + 1],
            seq_lens=seq_lens,
            page_table=self.page_table(cm, num_reqs),
            slot_mapping=self.slot_mapping(cm),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=self.host_seq_lens(cm, num_reqs),
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
        if not is_int_tensor(table):
            raise InvalidMetadataError("block_table_tensor", "integer block ids", table.dtype)
        if table.shape[0] < num_reqs:
            raise InvalidMetadataError(
                "block_table_tensor", f"at least num_reqs = {num_reqs} rows", table.shape[0]
            )
        return table[:num_reqs]

    def slot_mapping(self, cm: Any) -> torch.Tensor:
        """(T,) slots of the new tokens; rows past ``num_actual_tokens`` are graph padding."""
        slots = _tensor_field(cm, "slot_mapping")
        n = _int_field(cm, "num_actual_tokens")
        if n > slots.shape[0]:
            raise InvalidMetadataError(
                "num_actual_tokens", f"<= {slots.shape[0]} (slot_mapping's entries)", n
            )
        return slots[:n]

    def host_seq_lens(self, cm: Any, num_reqs: int) -> torch.Tensor:
        """(B,) host copy of ``seq_lens`` without a device sync.

        ``seq_lens`` itself when it lives on the CPU, else ``seq_lens_cpu_upper_bound`` (the
        only host copy vLLM 0.33+ keeps). It is exact except for async speculative-decoding
        rows, where vLLM assumes every draft was accepted: the builders then replace it with
        ``with_exact_seq_lens``. Two vLLM paths leave it unset (DFlash graph capture and one
        model path): they raise.
        """
        seq_lens = _tensor_field(cm, "seq_lens")
        if seq_lens.device.type == "cpu":
            return seq_lens[:num_reqs]
        value = getattr(cm, "seq_lens_cpu_upper_bound", None)
        if value is None:
            raise InvalidMetadataError(
                "seq_lens_cpu_upper_bound",
                "a host copy of seq_lens",
                None,
                "the adapter never syncs the device; override VLLMAdapter.host_seq_lens to "
                "supply one (e.g. cm.seq_lens.cpu(), which syncs)",
            )
        host = _host_tensor("seq_lens_cpu_upper_bound", value)
        if host.dim() != 1 or host.shape[0] < num_reqs:
            raise InvalidMetadataError(
                "seq_lens_cpu_upper_bound",
                f"at least num_reqs = {num_reqs} entries",
                tuple(host.shape),
            )
        return host[:num_reqs]

    def with_exact_seq_lens(self, meta: AttentionMetadata) -> AttentionMetadata:
        """``meta`` with its host ``seq_lens`` copied from the device (one sync; vLLM's sync
        check is told it is expected). The builders call it under speculative decoding, where
        ``seq_lens_cpu_upper_bound`` takes every draft as accepted and backends that plan from
        host lengths (flashinfer's page index, chunked virtual batches, the reference) would
        read past the accepted tokens, as vLLM's own FlashInfer backend does."""
        with _sync_allowed():
            exact = meta.seq_lens.to("cpu", torch.int32)
        return dataclasses.replace(
            meta, seq_lens_cpu=exact, max_seq_len=int(exact.max()) if exact.numel() else 0
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
        if not isinstance(value, bool):
            raise InvalidMetadataError("causal", "a bool or a host tensor of bools", repr(value))
        return value

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
            scale=check_positive_float("scale", scale),
            causal=causal and (vllm_attn_kind(kind) or AttnKind.DECODER).causal,
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
    # vLLM's chunked-local virtual batch sets max_query_len to a numpy int.
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
        raise InvalidMetadataError(
            name, "a host int >= 0 (CommonAttentionMetadata field)", repr(value)
        )
    return int(value)


def _host_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.as_tensor(value)  # numpy arrays in some versions
        except (TypeError, ValueError, RuntimeError):
            raise InvalidMetadataError(
                name, "host ints (a tensor or an array)", repr(value)
            ) from None
    if value.device.type != "cpu":
        raise InvalidMetadataError(f"{name}.device", "cpu", value.device)
    if not is_int_tensor(value):
        raise InvalidMetadataError(name, "integers", value.dtype)
    return value


def _sync_allowed() -> contextlib.AbstractContextManager[Any]:
    """vLLM's ``gpu_sync_allowed()`` (its GPU-sync debug check) where it exists, else nothing."""
    module = sys.modules.get("vllm.utils.gpu_sync_debug")
    allowed = getattr(module, "gpu_sync_allowed", None)
    return allowed() if allowed is not None else contextlib.nullcontext()

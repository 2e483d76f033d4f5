"""``SGLangAdapter``: SGLang's ``ForwardBatch`` → ``AttentionMetadata``, its KV buffers → ``KVCache``.

SGLang's conventions, which every method here relies on (docs/adapters/sglang.md has the table):

- ``req_to_token[row, pos]`` is the KV slot of token ``pos`` of the request in pool row ``row``.
  SGLang writes the slots of this step's new tokens there *before* the forward. Row 0 is a dummy
  row (all zeros) that CUDA-graph padding rows point at.
- slot = page * P + offset. Slots 0..P-1 (page 0) are the padding page: padded tokens write there.
- The paged allocator hands out whole pages: the P slots of one page are contiguous and belong to
  one request, so ``req_to_token[row, i*P + j] == req_to_token[row, i*P] + j`` and the page table
  is ``req_to_token[rows, ::P] // P``. ``validate`` checks this for every position it uses.
- ``seq_lens`` count the request's tokens after this step, except in TARGET_VERIFY, where they
  exclude the ``spec_info.draft_token_num`` draft tokens (the query tokens, appended after them).
- A TARGET_VERIFY tree (EAGLE ``topk > 1``, NGRAM) carries ``spec_info.custom_mask``: per row b,
  D x (seq_lens[b] + D) booleans, row-major, rows after one another (SGLang's FA3 and
  FlashInfer backends read it so); ``tree_mask`` takes the drafts' columns.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.adapters._common import engine_attr
from attnsdk.adapters.sglang._layer import radix_layer_spec
from attnsdk.adapters.sglang._modes import StepKind, draft_token_num, is_tree, step_kind
from attnsdk.contract.checks import is_int_tensor
from attnsdk.contract.errors import (
    InvalidInputError,
    InvalidMetadataError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.kv import COMPUTE_DTYPES, KVCache, KVCacheLayout
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from attnsdk.contract.layer import LayerSpec

__all__ = ["Lengths", "SGLangAdapter"]


@dataclass(frozen=True, slots=True)
class Lengths:
    """Per-sequence lengths and their host twin, so building metadata never syncs the device."""

    device: torch.Tensor
    """(B,) int32, on the device."""
    host: torch.Tensor
    """(B,) int32, on the CPU."""


class SGLangAdapter:
    """Turns SGLang batch objects into attnsdk metadata; subclass it and override a hook.

    Hooks (each reads one thing from the ``ForwardBatch``): ``query_lens``, ``seq_lens``,
    ``page_table`` (from the batch's request rows, so a CUDA-graph replay uses it too),
    ``slot_mapping``, ``tree_mask`` and ``layer_spec``. ``build_metadata`` composes them.

    >>> import torch
    >>> req_to_token = torch.zeros(4, 64, dtype=torch.int32)
    >>> adapter = SGLangAdapter(req_to_token=req_to_token, page_size=16)
    >>> cache = adapter.kv_cache(torch.zeros(64, 2, 8), torch.zeros(64, 2, 8))
    >>> tuple(cache.k.shape), cache.k.data_ptr() != 0
    ((4, 16, 2, 8), True)
    """

    def __init__(self, *, req_to_token: torch.Tensor, page_size: int) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidInputError("page_size", "a positive int", repr(page_size))
        if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2:
            found = tuple(req_to_token.shape) if isinstance(req_to_token, torch.Tensor) else None
            raise InvalidInputError("req_to_token", "a 2-D tensor [rows, max_context_len]", found)
        if not is_int_tensor(req_to_token):
            raise InvalidInputError("req_to_token.dtype", "an integer dtype", req_to_token.dtype)
        self.req_to_token = req_to_token
        self.page_size = page_size
        # The first slot of every page of every row: a view, so later writes show through.
        self._page_starts = req_to_token[:, ::page_size]

    # -- hooks ------------------------------------------------------------------------------

    def query_lens(self, fb: ForwardBatch) -> Lengths:
        """New tokens per row: 1 (decode), ``extend_seq_lens`` or ``spec_info.draft_token_num``."""
        mode = _fb(fb, "forward_mode")
        kind = step_kind(mode)
        b = _batch_size(fb)
        seq_lens = _fb(fb, "seq_lens")
        if not isinstance(seq_lens, torch.Tensor):
            raise InvalidMetadataError("forward_batch.seq_lens", "a tensor", seq_lens)
        device = seq_lens.device
        if kind is StepKind.EXTEND:
            host = _host_ints(
                "forward_batch.extend_seq_lens_cpu", _fb(fb, "extend_seq_lens_cpu"), b
            )
            dev = _device_ints("forward_batch.extend_seq_lens", _fb(fb, "extend_seq_lens"), b)
            return Lengths(dev, host)
        spec_info = _fb(fb, "spec_info")
        if kind is StepKind.DECODE and spec_info is not None and mode.is_decode():
            raise UnsupportedConfigError(
                "forward_batch.spec_info: expected None in DECODE, found "
                f"{type(spec_info).__name__} (EAGLE draft decode is not mapped)",
                [Reason(ReasonKind.BATCH, "spec_info", "draft decode needs per-step offsets")],
            )
        n = draft_token_num(spec_info) if kind is StepKind.TARGET_VERIFY else 1
        return Lengths(
            torch.full((b,), n, dtype=torch.int32, device=device),
            torch.full((b,), n, dtype=torch.int32),
        )

    def seq_lens(self, fb: ForwardBatch) -> Lengths:
        """KV length after this step: ``seq_lens`` (+ the drafts in TARGET_VERIFY)."""
        b = _batch_size(fb)
        host = _host_ints("forward_batch.seq_lens_cpu", _fb(fb, "seq_lens_cpu"), b)
        dev = _device_ints("forward_batch.seq_lens", _fb(fb, "seq_lens"), b)
        if step_kind(_fb(fb, "forward_mode")) is StepKind.TARGET_VERIFY:
            n = draft_token_num(_fb(fb, "spec_info"))
            return Lengths(dev + n, host + n)
        return Lengths(dev, host)

    def page_table(self, req_pool_indices: torch.Tensor, width: int) -> torch.Tensor:
        """(B, width) int32: ``req_to_token[req_pool_indices, ::P][:, :width] // P``.

        ``req_pool_indices`` (B,) are the batch's request rows (``ForwardBatch.
        req_pool_indices``, or a graph replay's static copy of them)."""
        starts = self._page_starts
        if width > starts.shape[1]:
            raise InvalidMetadataError(
                "page_table",
                f"at most {starts.shape[1]} pages per row (req_to_token has "
                f"{self.req_to_token.shape[1]} columns at page_size {self.page_size})",
                width,
            )
        rows = starts[:, :width].index_select(0, req_pool_indices)
        if self.page_size > 1:
            rows = rows // self.page_size
        return rows.to(torch.int32)

    def slot_mapping(self, fb: ForwardBatch) -> torch.Tensor:
        """(T,) int64: ``out_cache_loc``, the slot SGLang allocated for each new token."""
        loc = _fb(fb, "out_cache_loc")
        if not is_int_tensor(loc) or loc.dim() != 1:
            found = (loc.dtype, tuple(loc.shape)) if isinstance(loc, torch.Tensor) else loc
            raise InvalidMetadataError(
                "forward_batch.out_cache_loc", "a 1-D integer tensor of slots", found
            )
        return loc.to(torch.int64)

    def tree_mask(self, fb: ForwardBatch) -> torch.Tensor | None:
        """(B * D, D) bool: a tree verify's mask among its D drafts per row, gathered on the
        device from ``spec_info.custom_mask``; None for draft chains and other steps.

        SGLang lays the mask out per row b as D x (seq_lens[b] + D) booleans, row-major (each
        draft's view of the prefix, then of the drafts), rows after one another; the prefix
        part is all true and the draft part is what attnsdk's ``tree_mask`` holds.
        """
        if step_kind(_fb(fb, "forward_mode")) is not StepKind.TARGET_VERIFY:
            return None
        spec_info = _fb(fb, "spec_info")
        if not is_tree(spec_info):
            return None
        d = draft_token_num(spec_info)
        b = _batch_size(fb)
        mask = getattr(spec_info, "custom_mask", None)
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
            found = (mask.dtype, tuple(mask.shape)) if isinstance(mask, torch.Tensor) else mask
            raise InvalidMetadataError(
                "forward_batch.spec_info.custom_mask", "a 1-D torch.bool tensor (the tree)", found
            )
        host = _host_ints("forward_batch.seq_lens_cpu", _fb(fb, "seq_lens_cpu"), b).long()
        need = int(((host + d) * d).sum())
        if mask.numel() < need:
            raise InvalidMetadataError(
                "forward_batch.spec_info.custom_mask",
                f"at least {need} entries (draft_token_num x (seq_lens + draft_token_num) per row)",
                mask.numel(),
            )
        prefix = _device_ints("forward_batch.seq_lens", _fb(fb, "seq_lens"), b).long()
        row_len = prefix + d
        start = torch.cumsum(row_len * d, 0) - row_len * d  # where each row's block begins
        ramp = torch.arange(d, device=prefix.device)
        index = (
            (start + prefix)[:, None, None]
            + ramp[None, :, None] * row_len[:, None, None]
            + ramp[None, None, :]
        )
        return mask[index.reshape(-1)].view(b * d, d)

    def layer_spec(
        self,
        layer: RadixAttention,
        *,
        has_sinks: bool = False,
        attention_chunk_size: int | None = None,
        mla: bool = False,
    ) -> LayerSpec:
        """A ``LayerSpec`` from a RadixAttention-like layer (SGLang's window is W - 1; the
        model's ``attention_chunk_size`` applies to layers with ``use_irope``; ``mla``: a
        layer over the model's latent pool)."""
        return radix_layer_spec(
            layer, has_sinks=has_sinks, attention_chunk_size=attention_chunk_size, mla=mla
        )

    # -- composition ------------------------------------------------------------------------

    def build_metadata(self, fb: ForwardBatch) -> AttentionMetadata:
        """The step's ``AttentionMetadata``; host-only checks, no device sync."""
        q = self.query_lens(fb)
        s = self.seq_lens(fb)
        bad = q.host > s.host
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise InvalidMetadataError(
                f"forward_batch.seq_lens[{b}]",
                f">= its {int(q.host[b])} new tokens (seq_lens count cached + new tokens)",
                int(s.host[b]),
            )
        self._check_prefix(fb, q, s)
        self._check_rows(fb)
        max_seq = int(s.host.max()) if s.host.numel() else 0
        width = -(-max_seq // self.page_size)
        slots = self.slot_mapping(fb)
        num_tokens = int(q.host.sum())
        if slots.shape[0] < num_tokens:
            raise InvalidMetadataError(
                "forward_batch.out_cache_loc",
                f"one slot per new token ({num_tokens})",
                f"{slots.shape[0]} slots",
            )
        # Data-parallel attention pads an EXTEND batch with extra tokens (ForwardBatch.
        # _pad_inputs_to_size): they belong to no sequence and are neither written nor read.
        slots = slots[:num_tokens]
        b = q.host.shape[0]
        qsl = torch.zeros(b + 1, dtype=torch.int32, device=q.device.device)
        torch.cumsum(q.device, 0, dtype=torch.int32, out=qsl[1:])
        qsl_cpu = torch.zeros(b + 1, dtype=torch.int32)
        torch.cumsum(q.host, 0, dtype=torch.int32, out=qsl_cpu[1:])
        return AttentionMetadata.from_tensors(
            query_start_loc=qsl,
            seq_lens=s.device,
            page_table=self.page_table(_fb(fb, "req_pool_indices"), width),
            slot_mapping=slots,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=s.host,
            max_seq_len=max_seq,
            page_size=self.page_size,
            tree_mask=self.tree_mask(fb),
        )

    def mha_metadata(self, fb: ForwardBatch, meta: AttentionMetadata) -> AttentionMetadata:
        """The ragged metadata (``forward_ragged``) of an MLA model's expanded-prefill call
        (DeepSeek's ``attn_mha``: per-head K/V the model expands, never the cache) in the step
        ``meta`` describes: its query rows, and keys as ``forward_batch`` says, the way
        SGLang's FA3 backend reads it:

        - ``attn_attend_prefix_cache`` True: chunk ``prefix_chunk_idx`` of the cached prefix
          (``prefix_chunk_cu_seq_lens``), every query row seeing all of it (a cross-attention
          step: the layer runs non-causal);
        - False with ``mha_one_shot``: every key of the sequence (``seq_lens``), causally;
        - False, or None in a step without a cached prefix: the new tokens, causally.
        """
        q = meta.query_lens_cpu
        b, dev = meta.num_seqs, meta.device
        attend = getattr(fb, "attn_attend_prefix_cache", None)
        cross = bool(attend)
        if attend:
            i = getattr(fb, "prefix_chunk_idx", None)
            starts = getattr(fb, "prefix_chunk_cu_seq_lens", None)
            if isinstance(i, bool) or not isinstance(i, int) or i < 0 or starts is None:
                raise InvalidMetadataError(
                    "forward_batch.prefix_chunk_idx",
                    "a chunk index >= 0 with prefix_chunk_cu_seq_lens set "
                    "(ForwardBatch.prepare_chunked_prefix_cache_info)",
                    repr(i),
                )
            host = _chunk_lens_cpu(fb, i, b)
            key_starts = starts[i].to(torch.int32)
            keys = (key_starts[1:] - key_starts[:-1]).to(torch.int32)
        elif attend is None and bool((meta.seq_lens_cpu != q).any()):
            raise InvalidMetadataError(
                "forward_batch.attn_attend_prefix_cache",
                "True or False in a step with a cached prefix (which keys does attn_mha see?)",
                None,
            )
        elif getattr(fb, "mha_one_shot", False):
            host, keys = meta.seq_lens_cpu, meta.seq_lens
            key_starts = torch.zeros(b + 1, dtype=torch.int32, device=dev)
            torch.cumsum(keys, 0, dtype=torch.int32, out=key_starts[1:])
        else:
            host, key_starts = q, meta.query_start_loc
            keys = (key_starts[1:] - key_starts[:-1]).to(torch.int32)
        return AttentionMetadata.from_tensors(
            query_start_loc=meta.query_start_loc,
            seq_lens=keys,
            page_table=torch.zeros(b, 0, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((meta.num_tokens,), -1, dtype=torch.int64, device=dev),
            query_start_loc_cpu=meta.query_start_loc_cpu,
            seq_lens_cpu=host,
            cross_attention=cross,
            key_start_loc=key_starts,
        )

    def kv_cache(
        self,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor | None,
        *,
        dtype: torch.dtype | None = None,
        kv_lora_rank: int | None = None,
    ) -> KVCache:
        """One layer's SGLang buffers ``[slots, Hkv, D|Dv]`` as ``[slots/P, P, Hkv, D|Dv]`` views.

        No copy: K/V written through the returned cache land in SGLang's buffers. ``dtype`` is
        the compute dtype (q/k/v); it defaults to the buffers' dtype and is required for fp8.
        ``kv_lora_rank``: ``k_buffer`` is an ``MLATokenToKVPool`` layer ``[slots, 1, rank +
        rope]`` (``v_buffer`` None or its latent view): an MLA cache whose V is that view.
        """
        for name, buf in (("k_buffer", k_buffer), ("v_buffer", v_buffer)):
            if buf is None and name == "v_buffer" and kv_lora_rank is not None:
                continue
            if not isinstance(buf, torch.Tensor) or buf.dim() != 3:
                found = tuple(buf.shape) if isinstance(buf, torch.Tensor) else type(buf).__name__
                raise InvalidInputError(f"{name}.shape", "(slots, Hkv, head_dim)", found)
            if buf.shape[0] % self.page_size:
                raise InvalidInputError(
                    f"{name}.shape[0]",
                    f"a multiple of page_size={self.page_size} (SGLang allocates whole pages)",
                    buf.shape[0],
                )
        if dtype is None:
            if k_buffer.dtype not in COMPUTE_DTYPES:
                raise InvalidInputError(
                    "dtype", f"the compute dtype for a {k_buffer.dtype} cache", None
                )
            dtype = k_buffer.dtype
        pages = k_buffer.shape[0] // self.page_size
        # unflatten of one dim is always a view, whatever the buffer's strides.
        k_pages = k_buffer.unflatten(0, (pages, self.page_size))
        if kv_lora_rank is not None:
            layout = KVCacheLayout.for_mla(
                self.page_size,
                kv_lora_rank=kv_lora_rank,
                rope_dim=k_buffer.shape[2] - kv_lora_rank,
                dtype=dtype,
                kv_dtype=k_buffer.dtype,
            )
            latent = None if v_buffer is None else v_buffer.unflatten(0, (pages, self.page_size))
            return layout.wrap(k_pages, latent)
        if v_buffer is None:
            raise InvalidInputError(
                "v_buffer", "(slots, Hkv, Dv): only an MLA pool (kv_lora_rank) has none", None
            )
        layout = KVCacheLayout(
            num_kv_heads=k_buffer.shape[1],
            head_dim=k_buffer.shape[2],
            page_size=self.page_size,
            dtype=dtype,
            v_head_dim=v_buffer.shape[2],
            kv_dtype=k_buffer.dtype,
        )
        return layout.wrap(
            k_pages, v_buffer.unflatten(0, (v_buffer.shape[0] // self.page_size, self.page_size))
        )

    def validate(self, fb: ForwardBatch, cache: KVCache) -> AttentionMetadata:
        """``build_metadata`` plus every check that may sync; raises ``InvalidMetadataError``.

        Beyond ``AttentionMetadata.validate`` (each new token's slot is where the page table puts
        its position), it checks SGLang's paging invariant for every position each row reads
        (``req_to_token[row, pos] == page_table[b, pos // P] * P + pos % P``) and that each page
        written this step receives tokens of one request only.
        """
        meta = self.build_metadata(fb).validate(cache)
        p = self.page_size
        rows = _fb(fb, "req_pool_indices").to("cpu", torch.long)
        table = meta.page_table.to("cpu", torch.long)
        r2t = self.req_to_token.to("cpu", torch.long)
        for b, seq_len in enumerate(meta.seq_lens_cpu.tolist()):
            pos = torch.arange(seq_len)
            found = r2t[rows[b], :seq_len]
            expected = table[b, pos // p] * p + pos % p
            wrong = torch.nonzero(found != expected)
            if wrong.numel():
                j = int(wrong[0])
                raise InvalidMetadataError(
                    f"req_to_token[{int(rows[b])}, {j}]",
                    f"{int(expected[j])} = page {int(table[b, j // p])} * {p} + {j % p} "
                    f"(row {b} of the batch)",
                    int(found[j]),
                    "SGLang's pages hold P contiguous slots of one request",
                )
        slots = meta.slot_mapping[: meta.num_tokens].to("cpu")
        owner = torch.repeat_interleave(torch.arange(meta.num_seqs), meta.query_lens_cpu.long())
        keep = slots >= p  # page 0 is the padding page, shared by design
        pairs = torch.unique(torch.stack([slots[keep] // p, owner[keep]], 1), dim=0)
        shared = pairs[1:, 0] == pairs[:-1, 0]
        if bool(shared.any()):
            i = int(torch.nonzero(shared)[0])
            raise InvalidMetadataError(
                "forward_batch.out_cache_loc",
                f"page {int(pairs[i, 0])} written by one request",
                f"rows {int(pairs[i, 1])} and {int(pairs[i + 1, 1])} of the batch",
            )
        return meta

    def _check_rows(self, fb: ForwardBatch) -> None:
        """Request rows in range, from the host copy SGLang keeps (0.5.13+), when it is there."""
        b = _batch_size(fb)
        indices = _fb(fb, "req_pool_indices")
        if not is_int_tensor(indices) or tuple(indices.shape) != (b,):
            is_tensor = isinstance(indices, torch.Tensor)
            found = (indices.dtype, tuple(indices.shape)) if is_tensor else repr(indices)
            raise InvalidMetadataError(
                "forward_batch.req_pool_indices", f"({b},) integer rows of req_to_token", found
            )
        rows = getattr(fb, "req_pool_indices_cpu", None)
        if rows is None and indices.device.type == "cpu":
            rows = indices
        if not isinstance(rows, torch.Tensor) or rows.numel() == 0:
            return
        limit = self.req_to_token.shape[0]
        bad = (rows < 0) | (rows >= limit)
        if bool(bad.any()):
            b = int(torch.nonzero(bad)[0])
            raise InvalidMetadataError(
                f"forward_batch.req_pool_indices[{b}]",
                f"a row of req_to_token, 0..{limit - 1}",
                int(rows[b]),
            )

    def _check_prefix(self, fb: ForwardBatch, q: Lengths, s: Lengths) -> None:
        # SGLang's extend batches also carry the prefix lengths: a cheap host cross-check.
        if step_kind(_fb(fb, "forward_mode")) is not StepKind.EXTEND:
            return
        prefix = getattr(fb, "extend_prefix_lens_cpu", None)
        if prefix is None:
            return
        found = _host_ints("forward_batch.extend_prefix_lens_cpu", prefix, q.host.shape[0])
        wrong = torch.nonzero(found != s.host - q.host)
        if wrong.numel():
            b = int(wrong[0])
            raise InvalidMetadataError(
                f"forward_batch.extend_prefix_lens_cpu[{b}]",
                f"seq_lens - extend_seq_lens = {int(s.host[b] - q.host[b])}",
                int(found[b]),
            )


def _host_ints(field: str, values: object, batch_size: int) -> torch.Tensor:
    if values is None:
        raise InvalidMetadataError(
            field, f"{batch_size} host ints (SGLang fills it; attnsdk never syncs for it)", None
        )
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise InvalidMetadataError(f"{field}.device", "cpu", values.device)
        t = values
    else:
        try:
            t = torch.tensor(list(values))  # type: ignore[call-overload]
        except (TypeError, ValueError, RuntimeError):
            raise InvalidMetadataError(field, f"{batch_size} host ints", repr(values)) from None
    if not is_int_tensor(t) and t.numel():
        raise InvalidMetadataError(field, "integers", t.dtype)
    t = t.to(torch.int32)
    if tuple(t.shape) != (batch_size,):
        raise InvalidMetadataError(field, f"shape ({batch_size},) (batch_size)", tuple(t.shape))
    return t


def _device_ints(field: str, values: torch.Tensor | None, batch_size: int) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        raise InvalidMetadataError(field, f"a ({batch_size},) tensor", type(values).__name__)
    if not is_int_tensor(values):
        raise InvalidMetadataError(field, "an integer tensor", values.dtype)
    if tuple(values.shape) != (batch_size,):
        raise InvalidMetadataError(
            field, f"shape ({batch_size},) (batch_size)", tuple(values.shape)
        )
    return values.to(torch.int32)


def _chunk_lens_cpu(fb: ForwardBatch, i: int, b: int) -> torch.Tensor:
    """(B,) int32 host keys of prefix chunk ``i``: ``prefix_chunk_seq_lens_cpu[i]`` (0.5.13+),
    else SGLang's own rule from the host prefix lengths (chunk i of a prefix p covers
    positions ``i * len .. min(p, (i + 1) * len) - 1``)."""
    table = getattr(fb, "prefix_chunk_seq_lens_cpu", None)
    if table is not None:
        return _host_ints(f"forward_batch.prefix_chunk_seq_lens_cpu[{i}]", table[i], b)
    size = getattr(fb, "prefix_chunk_len", None)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidMetadataError("forward_batch.prefix_chunk_len", "an int >= 1", repr(size))
    prefix = _host_ints(
        "forward_batch.extend_prefix_lens_cpu", _fb(fb, "extend_prefix_lens_cpu"), b
    )
    return (prefix.clamp(max=(i + 1) * size) - i * size).clamp(min=0).to(torch.int32)


def _fb(fb: ForwardBatch, name: str) -> Any:
    return engine_attr(fb, "forward_batch", name)


def _batch_size(fb: ForwardBatch) -> int:
    b = _fb(fb, "batch_size")
    if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 0:
        raise InvalidMetadataError("forward_batch.batch_size", "an int >= 0", repr(b))
    return int(b)

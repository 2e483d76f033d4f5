"""The invariants of a step's metadata: the host-only checks every plan runs
(``check_fields``) and the thorough ones behind ``AttentionMetadata.validate``
(``validate_fields``; may sync).

They read the record through ``StepView``, the fields they need, so that this module does not
import ``contract.metadata`` (which imports it: ``AttentionMetadata.validate``,
``check_metadata`` there add the type check to these).
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from attnsdk.contract.errors import InvalidMetadataError
from attnsdk.contract.kv import KVCache, KVCacheLayout

__all__ = ["StepView", "check_fields", "check_pages", "token_positions", "validate_fields"]

_CPU = torch.device("cpu")


class StepView(Protocol):
    """What the checks read of an ``AttentionMetadata`` (its fields, documented there)."""

    @property
    def query_start_loc(self) -> torch.Tensor: ...
    @property
    def seq_lens(self) -> torch.Tensor: ...
    @property
    def page_table(self) -> torch.Tensor: ...
    @property
    def slot_mapping(self) -> torch.Tensor: ...
    @property
    def query_start_loc_cpu(self) -> torch.Tensor: ...
    @property
    def seq_lens_cpu(self) -> torch.Tensor: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def max_query_len(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def page_size(self) -> int | None: ...
    @property
    def tree_mask(self) -> torch.Tensor | None: ...
    @property
    def cross_attention(self) -> bool: ...
    @property
    def key_start_loc(self) -> torch.Tensor | None: ...
    @property
    def num_seqs(self) -> int: ...
    @property
    def query_lens_cpu(self) -> torch.Tensor: ...


def check_fields(meta: StepView, page_size: int | None = None) -> None:
    """The host-only invariants (no device sync, a few microseconds): what ``plan`` checks.

    Types, dtypes and shapes of every field, the host twins' lengths (``query_start_loc`` starts
    at 0 and never decreases, every ``seq_len`` covers its query, the host maxima are upper
    bounds), and that the page table is wide enough for ``max_seq_len`` at the page size.
    Device values (page ids, slots) are left to ``validate`` and to the kernels' guards.
    """
    _check_tensors(meta)
    _check_scalars(meta)
    check_tree_mask(meta)
    if page_size is not None and meta.page_size is not None and meta.page_size != page_size:
        raise InvalidMetadataError(
            "page_size",
            f"{page_size}, the cache's page size",
            meta.page_size,
            "The page table and slot mapping were built for another page size",
        )
    if meta.slot_mapping.shape[0] < meta.num_tokens:
        raise InvalidMetadataError(
            "slot_mapping",
            f"at least num_tokens={meta.num_tokens} entries",
            meta.slot_mapping.shape[0],
        )
    qsl, seq = meta.query_start_loc_cpu, meta.seq_lens_cpu
    if not meta.num_seqs:
        if int(qsl[0]) != 0:
            raise InvalidMetadataError("query_start_loc[0]", "0", int(qsl[0]))
        return
    # One fused pass on the host twins (this runs once per step, on every backend's plan):
    # [query_start_loc[0], min query len, min (seq_len - query len), max query len, max seq_len,
    #  query_start_loc[-1]]. Only a failure pays for the diagnosis below.
    first, min_q, min_slack, max_q, max_s, owned = _host_stats(qsl, seq)
    cross = meta.cross_attention
    if cross:  # encoder keys: a sequence may have more queries than keys
        min_slack = int(seq.min())
    p = page_size or meta.page_size
    too_narrow = p is not None and meta.page_table.shape[1] * p < max_s
    if (
        first == 0
        and min_q >= 0
        and min_slack >= 0
        and meta.num_tokens >= owned
        and meta.max_query_len >= max_q
        and meta.max_seq_len >= max_s
        and not too_narrow
    ):
        return
    if first != 0:
        raise InvalidMetadataError("query_start_loc[0]", "0", first)
    qlen = qsl[1:] - qsl[:-1]
    _first_bad("query_start_loc", qlen < 0, "non-decreasing", qsl[1:], offset=1)
    if meta.num_tokens < owned:
        raise InvalidMetadataError("num_tokens", f">= query_start_loc[-1]={owned}", meta.num_tokens)
    if cross:
        _first_bad("seq_lens", seq < 0, ">= 0 (encoder keys)", seq)
    else:
        _first_bad("seq_lens", seq < qlen, ">= the sequence's query length", seq)
    if meta.max_query_len < max_q:
        raise InvalidMetadataError("max_query_len", f">= {max_q}", meta.max_query_len)
    if meta.max_seq_len < max_s:
        raise InvalidMetadataError("max_seq_len", f">= {max_s}", meta.max_seq_len)
    if p is not None:  # too_narrow
        b = int(torch.argmax(seq))
        raise InvalidMetadataError(
            "page_table",
            f"at least {-(-max_s // p)} columns for seq_lens[{b}]={max_s} at page_size {p}",
            f"{meta.page_table.shape[1]} columns",
        )


def _host_stats(qsl: torch.Tensor, seq: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(query_start_loc[0], min query len, min (seq_len - query len), max query len,
    max seq_len, query_start_loc[-1]) of a non-empty batch, the cheapest way for its size."""
    if seq.shape[0] <= 64:  # plain Python beats five tiny tensor ops up to here
        q, s = qsl.tolist(), seq.tolist()
        qlen = [b - a for a, b in itertools.pairwise(q)]
        slack = min(si - qi for si, qi in zip(s, qlen))
        return q[0], min(qlen), slack, max(qlen), max(s), q[-1]
    qlen_t = qsl[1:] - qsl[:-1]
    stats = torch.stack(
        (qsl[0], qlen_t.min(), (seq - qlen_t).min(), qlen_t.max(), seq.max(), qsl[-1])
    ).tolist()
    return tuple(stats)


def validate_fields(
    meta: StepView,
    layout_or_cache: KVCacheLayout | KVCache | int | None,
    reserved_page: int | None = 0,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> None:
    """Every invariant of ``meta`` for a cache layout, a cache (page ids checked against its
    size too) or a bare page size; None: a ragged step (no page table). May sync the device.
    ``sliding_window`` / ``attention_chunk_size``: pages wholly below every query's window, or
    before the chunk of a row's first query, are not read, so an engine may have freed them
    (vLLM puts its null block there)."""
    if layout_or_cache is None:
        check_fields(meta)
        if meta.page_table.dim() == 2 and meta.page_table.shape[1]:
            raise InvalidMetadataError(
                "layout_or_cache",
                "the KVCacheLayout or KVCache of metadata with a page table (None: ragged "
                "metadata, AttentionMetadata.for_ragged)",
                None,
            )
        _check_host_twins(meta)
        return
    if isinstance(layout_or_cache, KVCache):
        page_size, num_pages = layout_or_cache.layout.page_size, layout_or_cache.num_pages
        cache_device: torch.device | None = layout_or_cache.device
    elif isinstance(layout_or_cache, KVCacheLayout):
        page_size, num_pages, cache_device = layout_or_cache.page_size, None, None
    elif isinstance(layout_or_cache, int) and not isinstance(layout_or_cache, bool):
        page_size, num_pages, cache_device = layout_or_cache, None, None
    else:
        raise InvalidMetadataError(
            "layout_or_cache", "a KVCacheLayout or KVCache", type(layout_or_cache).__name__
        )
    check_fields(meta, page_size)
    if cache_device is not None and meta.seq_lens.device != cache_device:
        raise InvalidMetadataError(
            "seq_lens.device", f"the cache's device {cache_device}", meta.seq_lens.device
        )
    _check_host_twins(meta)
    validate_tree_mask(meta)
    qsl = meta.query_start_loc_cpu.long()
    owned = int(qsl[-1])

    pt, used = check_pages(meta, page_size, num_pages)

    slots = meta.slot_mapping.to(_CPU)
    if reserved_page is not None:
        if sliding_window is not None or attention_chunk_size is not None:
            used = used & _read(meta, pt.shape[1], page_size, sliding_window, attention_chunk_size)
        _check_reserved_page(meta, pt, used, slots, reserved_page, page_size)
    if meta.cross_attention:  # the encoder's keys were written before; nothing is written now
        _first_bad("slot_mapping", slots >= 0, "< 0 (a cross-attention step writes nothing)", slots)
        return
    _first_bad(
        "slot_mapping",
        slots[owned:] >= 0,
        f"< 0 (no write) for token rows past query_start_loc[-1]={owned}, which no sequence owns",
        slots[owned:],
        offset=owned,
    )
    # Each written token must land where the page table says its position lives.
    real = slots[:owned]
    seq_of_token, pos = token_positions(meta.query_start_loc_cpu, meta.seq_lens_cpu)
    expected = pt[seq_of_token, pos // page_size] * page_size + pos % page_size
    wrong = (real >= 0) & (real != expected)
    if bool(wrong.any()):
        t = int(torch.nonzero(wrong)[0])
        b, p = int(seq_of_token[t]), int(pos[t])
        raise InvalidMetadataError(
            f"slot_mapping[{t}]",
            f"{int(expected[t])} = page_table[{b}, {p // page_size}] * {page_size} + "
            f"{p % page_size} (sequence {b}, position {p}) or a negative 'no write' slot",
            int(real[t]),
            "Slots inside one page must belong to one sequence and be page-contiguous",
        )
    written = real[real >= 0]
    if written.numel() != torch.unique(written).numel():
        dup = _first_duplicate(written)
        raise InvalidMetadataError(
            "slot_mapping", "each slot written at most once", f"slot {dup} twice"
        )
    if num_pages is not None and written.numel() and int(written.max()) >= num_pages * page_size:
        raise InvalidMetadataError(
            "slot_mapping", f"< num_pages * page_size = {num_pages * page_size}", int(written.max())
        )


def _check_tensors(meta: StepView) -> None:
    host_seq = meta.seq_lens_cpu
    b = host_seq.shape[0] if isinstance(host_seq, torch.Tensor) and host_seq.dim() == 1 else -1
    # seq_lens_cpu defines B and seq_lens the device, so they are checked first: a malformed one
    # is named itself, not its peers.
    specs = (
        ("seq_lens_cpu", meta.seq_lens_cpu, torch.int32, (b,), _CPU),
        ("seq_lens", meta.seq_lens, torch.int32, (b,), None),
        ("query_start_loc", meta.query_start_loc, torch.int32, (b + 1,), None),
        ("page_table", meta.page_table, torch.int32, (b, -1), None),
        ("slot_mapping", meta.slot_mapping, torch.int64, (-1,), None),
        ("query_start_loc_cpu", meta.query_start_loc_cpu, torch.int32, (b + 1,), _CPU),
        *(
            (("key_start_loc", meta.key_start_loc, torch.int32, (b + 1,), None),)
            if meta.key_start_loc is not None
            else ()
        ),
    )
    device = meta.seq_lens.device if isinstance(meta.seq_lens, torch.Tensor) else _CPU
    for name, t, dtype, shape, where in specs:
        if not isinstance(t, torch.Tensor):
            raise InvalidMetadataError(name, "a torch.Tensor", type(t).__name__)
        if t.dtype != dtype:
            raise InvalidMetadataError(name, f"dtype {dtype}", t.dtype)
        if t.dim() != len(shape) or any(e not in (-1, f) for e, f in zip(shape, t.shape)):
            legend = "(B + 1,)" if shape[0] == b + 1 else str(shape).replace("-1", "any")
            raise InvalidMetadataError(name, f"shape {legend} with B={b}", tuple(t.shape))
        expected_device = where or device
        if t.device.type != expected_device.type:
            raise InvalidMetadataError(f"{name}.device", str(expected_device), t.device)


def check_pages(
    meta: StepView, page_size: int, num_pages: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every page a sequence reads is in 0..num_pages-1 (syncs to read the page table).

    Returns the page table on the CPU (int64) and the mask of the entries sequences read.
    """
    pt = meta.page_table.to(_CPU).long()
    pages_needed = (meta.seq_lens_cpu.long() + page_size - 1) // page_size
    widest = int(pages_needed.max()) if pages_needed.numel() else 0
    if widest > pt.shape[1]:
        b = int(torch.argmax(pages_needed))
        raise InvalidMetadataError(
            "page_table",
            f"at least {widest} columns for seq_lens[{b}]={int(meta.seq_lens_cpu[b])} at "
            f"page_size {page_size}",
            f"{pt.shape[1]} columns",
        )
    used = torch.arange(pt.shape[1]) < pages_needed[:, None]
    _first_bad_2d("page_table", (pt < 0) & used, ">= 0", pt)
    if num_pages is not None:
        _first_bad_2d("page_table", (pt >= num_pages) & used, f"< num_pages={num_pages}", pt)
    return pt, used


def _read(
    meta: StepView, width: int, page_size: int, window: int | None, chunk: int | None
) -> torch.Tensor:
    """(B, width) mask of the pages some query of each row can see: none before the first key
    its first query (position seq_len - query_len) sees, which a window of ``window`` keys puts
    at position - window + 1 and a chunk of ``chunk`` tokens at the start of that chunk."""
    seq = meta.seq_lens_cpu.long()
    first = seq - meta.query_lens_cpu.long()
    first_key = torch.zeros_like(first)
    if window is not None:
        first_key = torch.maximum(first_key, first - window + 1)
    if chunk is not None:
        first_key = torch.maximum(first_key, first.clamp(min=0) // chunk * chunk)
    return torch.arange(width) >= (first_key // page_size)[:, None]


def _check_reserved_page(
    meta: StepView,
    pt: torch.Tensor,
    used: torch.Tensor,
    slots: torch.Tensor,
    reserved: int,
    page_size: int,
) -> None:
    """Only padding rows may read the reserved page: rows that read nothing else and write
    nowhere else (SGLang's graph padding writes its one token there)."""
    on_reserved = (pt == reserved) & used
    rows = torch.nonzero(on_reserved.any(1)).flatten().tolist()
    if not rows:
        return
    qsl = meta.query_start_loc_cpu.tolist()
    for b in rows:
        other_page = bool(((pt[b] != reserved) & used[b]).any())
        written = slots[qsl[b] : qsl[b + 1]]
        written = written[written >= 0]
        other_slot = bool(((written // page_size) != reserved).any())
        if other_page or other_slot:
            i = int(torch.nonzero(on_reserved[b])[0])
            raise InvalidMetadataError(
                f"page_table[{b}, {i}]",
                f"a page other than the reserved page {reserved} (sequence {b} is not a padding "
                "row: it reads or writes other pages too)",
                reserved,
                "Never give the reserved page to a real sequence; validate(..., reserved_page=None)"
                " turns this check off",
            )


def _check_scalars(meta: StepView) -> None:
    for name in ("num_tokens", "max_query_len", "max_seq_len"):
        value = getattr(meta, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidMetadataError(name, "a host int >= 0", repr(value))
    p = meta.page_size
    if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p <= 0):
        raise InvalidMetadataError("page_size", "a positive int or None", repr(p))
    if not isinstance(meta.cross_attention, bool):
        raise InvalidMetadataError("cross_attention", "a bool", repr(meta.cross_attention))
    if meta.cross_attention and meta.tree_mask is not None:
        raise InvalidMetadataError(
            "tree_mask", "None in a cross-attention step (drafts see their own tokens)", "a mask"
        )


def _check_host_twins(meta: StepView) -> None:
    for name, dev, host in (
        ("query_start_loc", meta.query_start_loc, meta.query_start_loc_cpu),
        ("seq_lens", meta.seq_lens, meta.seq_lens_cpu),
    ):
        diff = dev.to(_CPU) != host
        if bool(diff.any()):
            i = int(torch.nonzero(diff)[0])
            raise InvalidMetadataError(
                f"{name}_cpu[{i}]", f"{int(dev[i])} (its device twin)", int(host[i])
            )
    if meta.key_start_loc is not None:
        starts = torch.nn.functional.pad(torch.cumsum(meta.seq_lens_cpu, 0), (1, 0))
        _first_bad(
            "key_start_loc",
            meta.key_start_loc.to(_CPU) != starts,
            "the prefix sum of seq_lens",
            meta.key_start_loc.to(_CPU),
        )


def _first_bad(
    field: str, bad: torch.Tensor, expected: str, values: torch.Tensor, offset: int = 0
) -> None:
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        raise InvalidMetadataError(f"{field}[{i + offset}]", expected, int(values[i]))


def _first_bad_2d(field: str, bad: torch.Tensor, expected: str, values: torch.Tensor) -> None:
    if bool(bad.any()):
        b, i = (int(x) for x in torch.nonzero(bad)[0])
        raise InvalidMetadataError(f"{field}[{b}, {i}]", expected, int(values[b, i]))


def _first_duplicate(values: torch.Tensor) -> int:
    sorted_vals, _ = torch.sort(values)
    same = sorted_vals[1:] == sorted_vals[:-1]
    return int(sorted_vals[1:][same][0])


def check_tree_mask(meta: StepView) -> None:
    """The host-only checks of ``meta.tree_mask`` (part of every plan): dtype, shape, device."""
    mask = meta.tree_mask
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
        found = (
            f"{mask.dtype} of shape {tuple(mask.shape)}"
            if isinstance(mask, torch.Tensor)
            else type(mask).__name__
        )
        raise InvalidMetadataError("tree_mask", "a (T, M) torch.bool tensor", found)
    if mask.shape[0] < meta.num_tokens or mask.shape[1] < meta.max_query_len:
        raise InvalidMetadataError(
            "tree_mask",
            f"shape (T >= num_tokens={meta.num_tokens}, M >= max_query_len={meta.max_query_len})",
            tuple(mask.shape),
        )
    if mask.device.type != meta.seq_lens.device.type:
        raise InvalidMetadataError("tree_mask.device", str(meta.seq_lens.device), mask.device)


def validate_tree_mask(meta: StepView) -> None:
    """``validate``'s part (syncs): every draft token sees itself. A mask that fails this is
    misaligned with the query rows (or transposed), not a tree."""
    mask = meta.tree_mask
    if mask is None or not meta.num_tokens:
        return
    qsl = meta.query_start_loc_cpu.long()
    qlen = qsl[1:] - qsl[:-1]
    rows = torch.arange(int(qsl[-1]))
    index = rows - torch.repeat_interleave(qsl[:-1], qlen)
    diagonal = mask.to("cpu")[rows, index]
    if not bool(diagonal.all()):
        t = int(torch.nonzero(~diagonal)[0])
        raise InvalidMetadataError(
            f"tree_mask[{t}, {int(index[t])}]",
            "True (every draft token sees itself; row t is new token "
            f"{int(index[t])} of its sequence)",
            False,
        )


def token_positions(
    query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, KV position) of every owned query token, as two (T,) int64 CPU tensors.

    Token j of sequence b sits at position ``seq_lens[b] - query_len[b] + j`` (DESIGN §2).
    """
    qsl = query_start_loc_cpu.long()
    qlen = qsl[1:] - qsl[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(qlen.shape[0]), qlen)
    start = (seq_lens_cpu.long() - qlen - qsl[:-1])[seq_of_token]
    return seq_of_token, torch.arange(seq_of_token.shape[0]) + start

"""``AttentionMetadata``: the per-step batch description shared by every layer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.checks import check_usable_device, is_int_tensor
from attnsdk.contract.errors import InvalidInputError, InvalidMetadataError
from attnsdk.contract.validate import check_fields, token_positions, validate_fields

if TYPE_CHECKING:
    from typing import TypeAlias

    from attnsdk.contract.kv import KVCache, KVCacheLayout

__all__ = ["AttentionMetadata", "check_is_metadata", "check_metadata", "validate_metadata"]

IntsLike: TypeAlias = Sequence[int] | torch.Tensor

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's batch: which new tokens belong to which sequence, and where its KV lives.

    Shape legend: B sequences, T new query tokens, W page-table width (max pages per sequence).
    Sequence b owns query rows ``query_start_loc[b]:query_start_loc[b+1]``; they sit at KV
    positions ``seq_lens[b] - query_len[b] ... seq_lens[b] - 1``. Build it with ``from_seqlens``
    (which derives the slot mapping) or ``from_tensors`` (an engine's own tensors, no copy).

    >>> meta = AttentionMetadata.from_seqlens(
    ...     query_lens=[1, 3], seq_lens=[5, 3], page_table=[[1, 2], [3, 0]], page_size=4)
    >>> meta.slot_mapping.tolist(), meta.max_query_len, meta.max_seq_len
    ([8, 12, 13, 14], 3, 5)
    """

    query_start_loc: torch.Tensor
    """(B + 1,) int32, on the device: prefix sum of query lengths, starting at 0."""
    seq_lens: torch.Tensor
    """(B,) int32, on the device: KV length of each sequence after this step."""
    page_table: torch.Tensor
    """(B, W) int32, on the device: logical page i of sequence b is ``page_table[b, i]``."""
    slot_mapping: torch.Tensor
    """(T,) int64, on the device: cache slot (page * P + offset) of each new token; < 0 = skip."""
    query_start_loc_cpu: torch.Tensor
    """(B + 1,) int32, on the CPU: host twin of ``query_start_loc``."""
    seq_lens_cpu: torch.Tensor
    """(B,) int32, on the CPU: host twin of ``seq_lens``."""
    num_tokens: int
    """Query token rows the step covers: ``query_start_loc_cpu[-1]``, except in a plan replayed
    under a CUDA graph, where it is the captured count and rows past ``query_start_loc[-1]``
    belong to no sequence (their slots are negative, their outputs unspecified)."""
    max_query_len: int
    """Host int, >= every query length (equal to the max outside CUDA graphs)."""
    max_seq_len: int
    """Host int, >= every seq length (equal to the max outside CUDA graphs)."""
    page_size: int | None = None
    """P the page table and slot mapping were built for; a cache of another page size is
    refused. None: not recorded (then the cache's page size is taken on trust)."""
    tree_mask: torch.Tensor | None = None
    """(T', M) bool, on the device, T' >= T and M >= max_query_len; or None (the new tokens of a
    sequence form a causal chain). Speculative-tree verify: the query row t that is new token i
    of its sequence sees every key before the sequence's new tokens, and new token j <= i
    exactly when ``tree_mask[t, j]`` (a token's ancestors and itself). Entries j > i and rows
    past T are not read. See docs/kv_layout.md, "Tree verify"."""
    cross_attention: bool = False
    """True: the keys are another sequence's, an encoder's output written by an earlier step
    (encoder-decoder cross-attention). Every query row of sequence b sees keys
    ``0 .. seq_lens[b] - 1`` of b whatever its own position, so a sequence may have more queries
    than keys (``seq_lens[b] == 0``: its rows are zero); ``forward`` writes nothing (k = v =
    None; ``slot_mapping`` holds -1). Non-causal layers without a window or chunks only. See
    docs/kv_layout.md, "Cross-attention"."""
    key_start_loc: torch.Tensor | None = None
    """(B + 1,) int32, on the device, or None: prefix sum of ``seq_lens``, starting at 0. Only
    ``forward_ragged`` reads it: sequence b's keys are rows ``key_start_loc[b]:key_start_loc[b+1]``
    of its k and v. None: derived there (``query_start_loc`` itself when every ``seq_len``
    equals its query length, else one prefix sum per call). See docs/kv_layout.md, "Ragged
    attention"."""

    @property
    def num_seqs(self) -> int:
        """B."""
        return self.seq_lens_cpu.shape[0]

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @property
    def query_lens_cpu(self) -> torch.Tensor:
        """(B,) int32, on the CPU: new tokens per sequence."""
        return self.query_start_loc_cpu[1:] - self.query_start_loc_cpu[:-1]

    @classmethod
    def from_seqlens(
        cls,
        query_lens: IntsLike,
        seq_lens: IntsLike,
        page_table: IntsLike | Sequence[Sequence[int]],
        page_size: int,
        device: torch.device | str | None = None,
        tree_mask: torch.Tensor | None = None,
        cross_attention: bool = False,
    ) -> AttentionMetadata:
        """Build metadata from host lengths and a page table, deriving ``slot_mapping``.

        ``query_lens`` and ``seq_lens`` are host ints (lists or CPU tensors). ``page_table`` is a
        (B, W) tensor or nested list; ``device`` defaults to the page table's device (CPU for a
        list). Token j of sequence b is written at position ``seq_lens[b] - query_lens[b] + j``.
        ``tree_mask`` (see the field; ``tree_mask_from_parents`` builds one) is moved to
        ``device``. ``cross_attention``: ``seq_lens`` are encoder lengths, which the query
        lengths may exceed, and the slot mapping is -1 (the step writes nothing).
        ``for_ragged`` builds the metadata of a step that reads no cache.
        """
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidMetadataError("page_size", "a positive int", repr(page_size))
        q, s = _lengths(query_lens, seq_lens, cross_attention)
        max_q = int(q.max()) if q.numel() else 0
        _check_total("query_lens", q, max_q, "query_start_loc")
        pt = _page_table(page_table)
        device = pt.device if device is None else check_usable_device("device", device)
        if pt.dim() != 2 or pt.shape[0] != s.shape[0]:
            raise InvalidMetadataError("page_table", f"shape (B={s.shape[0]}, W)", tuple(pt.shape))
        needed = int(((s + page_size - 1) // page_size).max()) if s.numel() else 0
        if needed > pt.shape[1]:
            raise InvalidMetadataError(
                "page_table", f"at least {needed} columns (max seq_len / page_size)", pt.shape[1]
            )
        used = torch.arange(pt.shape[1]) < ((s + page_size - 1) // page_size)[:, None]
        # A convenience constructor may sync; "meta" tensors (shape-only dry runs) hold no values.
        negative = (pt.cpu() < 0) & used if pt.device.type != "meta" else used & False
        if bool(negative.any()):
            b, i = (int(x) for x in torch.nonzero(negative)[0])
            raise InvalidMetadataError(f"page_table[{b}, {i}]", ">= 0", int(pt[b, i]))
        qsl_cpu = torch.zeros(q.shape[0] + 1, dtype=torch.int32)
        torch.cumsum(q, 0, out=qsl_cpu[1:])
        pt_dev = pt.to(device)
        if cross_attention:
            slot_mapping = torch.full((int(qsl_cpu[-1]),), -1, dtype=torch.int64, device=device)
        else:
            seq_of_token, pos = token_positions(qsl_cpu, s)
            pages = pt_dev[seq_of_token.to(device), (pos // page_size).to(device)].long()
            slot_mapping = pages * page_size + (pos % page_size).to(device)
        return cls(
            query_start_loc=qsl_cpu.to(device),
            seq_lens=s.to(device),
            page_table=pt_dev,
            slot_mapping=slot_mapping,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=s,
            num_tokens=int(qsl_cpu[-1]),
            max_query_len=max_q,
            max_seq_len=int(s.max()) if s.numel() else 0,
            page_size=page_size,
            tree_mask=None if tree_mask is None else _tree_mask(tree_mask).to(device),
            cross_attention=_flag("cross_attention", cross_attention),
        )

    @classmethod
    def for_ragged(
        cls,
        query_lens: IntsLike,
        seq_lens: IntsLike,
        device: torch.device | str | None = None,
        cross_attention: bool = False,
    ) -> AttentionMetadata:
        """Metadata of a step whose keys come with the call, not from a cache
        (``forward_ragged``): sequence b has ``query_lens[b]`` query rows and ``seq_lens[b]`` key
        rows, packed in sequence order. No page table (B, 0) and no slots (-1): a paged
        ``forward`` refuses it. ``device`` defaults to the CPU; on a CUDA device the lengths
        move in one pinned, non-blocking copy, so building the step never syncs (an engine
        builds one per step, ahead of the GPU).

        >>> meta = AttentionMetadata.for_ragged(query_lens=[2, 3], seq_lens=[2, 5])
        >>> meta.key_start_loc.tolist(), meta.query_start_loc.tolist()
        ([0, 2, 7], [0, 2, 5])
        """
        q, s = _lengths(query_lens, seq_lens, cross_attention)
        max_q = int(q.max()) if q.numel() else 0
        max_s = int(s.max()) if s.numel() else 0
        _check_total("query_lens", q, max_q, "query_start_loc")
        _check_total("seq_lens", s, max_s, "key_start_loc")
        dev = torch.device("cpu") if device is None else check_usable_device("device", device)
        b = s.shape[0]
        host = torch.zeros(3 * b + 2, dtype=torch.int32)  # [query_start_loc | seq_lens | keys]
        qsl, s_host, ksl = host.split([b + 1, b, b + 1])
        torch.cumsum(q, 0, out=qsl[1:])
        s_host.copy_(s)
        torch.cumsum(s, 0, out=ksl[1:])
        # A blocking copy from pageable memory would wait for the GPU: pin, copy async.
        cuda = dev.type == "cuda"
        moved = (host.pin_memory() if cuda else host).to(dev, non_blocking=cuda)
        qsl_dev, s_dev, ksl_dev = moved.split([b + 1, b, b + 1])
        return cls(
            query_start_loc=qsl_dev,
            seq_lens=s_dev,
            page_table=torch.zeros(b, 0, dtype=torch.int32, device=dev),
            slot_mapping=torch.full((int(qsl[-1]),), -1, dtype=torch.int64, device=dev),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=s,
            num_tokens=int(qsl[-1]),
            max_query_len=max_q,
            max_seq_len=max_s,
            cross_attention=_flag("cross_attention", cross_attention),
            key_start_loc=ksl_dev,
        )

    @classmethod
    def from_tensors(
        cls,
        *,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        page_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        query_start_loc_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        max_query_len: int | None = None,
        max_seq_len: int | None = None,
        page_size: int | None = None,
        tree_mask: torch.Tensor | None = None,
        cross_attention: bool = False,
        key_start_loc: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """Adopt an engine's tensors as they are (no copy when dtypes already match).

        The host maxima default to the maxima of the host twins. ``page_size`` records what the
        page table and slots were built for (None: not recorded). Integer tensors only; host
        values must fit int32; ``tree_mask`` a bool tensor, taken as it is; ``key_start_loc``
        (cu_seqlens_k of a ragged step) an integer tensor. No device sync.
        """
        for name, t in (
            ("query_start_loc", query_start_loc),
            ("seq_lens", seq_lens),
            ("page_table", page_table),
            ("slot_mapping", slot_mapping),
            *((("key_start_loc", key_start_loc),) if key_start_loc is not None else ()),
        ):
            if not is_int_tensor(t):
                found = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                raise InvalidMetadataError(name, "an integer torch.Tensor", found)
        qsl_cpu = _host_ints("query_start_loc_cpu", query_start_loc_cpu)
        s_cpu = _host_ints("seq_lens_cpu", seq_lens_cpu)
        if qsl_cpu.shape[0] == 0:
            raise InvalidMetadataError(
                "query_start_loc_cpu", "B + 1 >= 1 entries (it starts with 0)", "no entries"
            )
        if page_size is not None and (
            isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0
        ):
            raise InvalidMetadataError("page_size", "a positive int or None", repr(page_size))
        for name, value in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise InvalidMetadataError(name, "None or a host int >= 0", repr(value))
        q_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
        if max_query_len is None:
            max_query_len = int(q_cpu.max()) if q_cpu.numel() else 0
        if max_seq_len is None:
            max_seq_len = int(s_cpu.max()) if s_cpu.numel() else 0
        return cls(
            query_start_loc=query_start_loc.to(torch.int32),
            seq_lens=seq_lens.to(torch.int32),
            page_table=page_table.to(torch.int32),
            slot_mapping=slot_mapping.to(torch.int64),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=s_cpu,
            num_tokens=int(qsl_cpu[-1]),
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            page_size=page_size,
            tree_mask=None if tree_mask is None else _tree_mask(tree_mask),
            cross_attention=_flag("cross_attention", cross_attention),
            key_start_loc=None if key_start_loc is None else key_start_loc.to(torch.int32),
        )

    def validate(
        self,
        layout_or_cache: KVCacheLayout | KVCache | None,
        *,
        reserved_page: int | None = 0,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
    ) -> AttentionMetadata:
        """Check every invariant (may sync the device); raise ``InvalidMetadataError`` on the first.

        Given a ``KVCache`` it also checks every page index against the cache's page count.
        None: a ragged step's metadata (``for_ragged``; it reads no cache), whose lengths, host
        twins and ``key_start_loc`` are checked; metadata with a page table needs its layout.
        ``reserved_page`` (page 0, SGLang's padding page and vLLM's null block) may be read only
        by padding rows, which read and write nothing else; None skips that check. This strict
        default is for explicit calls: debug mode skips it in a self-attention step that
        writes nothing (vLLM's encoder-only attention, token t of the step's own k/v on page t,
        is served exactly; see docs/kv_layout.md, "Pages and slots"). With the layer's
        ``sliding_window`` or ``attention_chunk_size``, pages wholly below every query's window,
        or before the chunk of a row's first query, count as unread (vLLM frees them and puts
        its null block there). Returns ``self`` so it can be chained.
        """
        validate_fields(self, layout_or_cache, reserved_page, sliding_window, attention_chunk_size)
        return self


def _page_table(values: IntsLike | Sequence[Sequence[int]]) -> torch.Tensor:
    """(B, W) int32 page table from a tensor or nested lists of ints (no silent float cast)."""
    if isinstance(values, torch.Tensor):
        t = values
    else:
        try:
            t = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidMetadataError(
                "page_table", "a (B, W) tensor or nested list of ints", repr(values)
            ) from exc
        if t.numel() == 0:
            t = t.to(torch.int32)  # torch reads [[]] as float32
    if not is_int_tensor(t):
        raise InvalidMetadataError("page_table", "integer page ids", t.dtype)
    if t.dtype != torch.int32 and t.numel() and t.device.type != "meta":
        big = (t > _INT32_MAX) | (t < -_INT32_MAX - 1)
        if bool(big.any()):
            where = tuple(int(i) for i in torch.nonzero(big)[0])
            raise InvalidMetadataError(
                f"page_table{list(where)}", "a page id that fits int32", int(t[where])
            )
    return t.to(torch.int32)


def _tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """A (T', M) bool tree mask, refused with the field named when it is anything else."""
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        found = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InvalidMetadataError("tree_mask", "a (T, M) torch.bool tensor", found)
    if mask.dim() != 2:
        raise InvalidMetadataError("tree_mask", "a (T, M) torch.bool tensor", tuple(mask.shape))
    return mask


def _host_ints(field: str, values: IntsLike) -> torch.Tensor:
    """(n,) int32 CPU tensor of host ints; floats, bools and values past int32 are refused."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise InvalidMetadataError(f"{field}.device", "cpu (host ints)", values.device)
        t = values
    else:
        try:
            t = torch.as_tensor(values)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidMetadataError(field, "a 1-D sequence of ints", repr(values)) from exc
    if t.numel() == 0 and not isinstance(values, torch.Tensor):
        t = t.to(torch.int32)  # torch reads [] as float32
    if not is_int_tensor(t):
        raise InvalidMetadataError(field, "integers", t.dtype)
    if t.dim() != 1:
        raise InvalidMetadataError(field, "a 1-D sequence of ints", tuple(t.shape))
    if t.dtype != torch.int32 and t.numel():
        big = (t > _INT32_MAX) | (t < -_INT32_MAX - 1)
        if bool(big.any()):
            i = int(torch.nonzero(big)[0])
            raise InvalidMetadataError(f"{field}[{i}]", "a value that fits int32", int(t[i]))
    return t.to(torch.int32)


def _flag(field: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidMetadataError(field, "a bool", repr(value))
    return value


def _lengths(
    query_lens: IntsLike, seq_lens: IntsLike, cross: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host query and seq lengths as int32 CPU tensors, one of each per sequence, checked."""
    q = _host_ints("query_lens", query_lens)
    s = _host_ints("seq_lens", seq_lens)
    if q.shape != s.shape:
        raise InvalidMetadataError(
            "query_lens", f"one length per sequence ({s.shape[0]} like seq_lens)", q.shape[0]
        )
    _check_lengths(q, s, cross)
    return q, s


def _check_total(field: str, lengths: torch.Tensor, longest: int, prefix_sum: str) -> None:
    """``lengths`` (>= 0, each at most ``longest``) sum to at most int32's max, so their int32
    prefix sum ``prefix_sum`` cannot wrap. B * longest bounds the sum: only a batch past that
    bound pays for the exact sum."""
    if lengths.shape[0] * longest <= _INT32_MAX:
        return
    total = int(lengths.sum(dtype=torch.int64))
    if total > _INT32_MAX:
        raise InvalidMetadataError(
            field,
            f"a sum of at most {_INT32_MAX} ({prefix_sum} is their int32 prefix sum)",
            f"a sum of {total}",
        )


def _check_lengths(query_lens: torch.Tensor, seq_lens: torch.Tensor, cross: bool) -> None:
    if bool((query_lens < 0).any()):
        b = int(torch.nonzero(query_lens < 0)[0])
        raise InvalidMetadataError(f"query_lens[{b}]", ">= 0", int(query_lens[b]))
    if cross and bool((seq_lens < 0).any()):
        b = int(torch.nonzero(seq_lens < 0)[0])
        raise InvalidMetadataError(f"seq_lens[{b}]", ">= 0 (encoder keys)", int(seq_lens[b]))
    if not cross and bool((query_lens > seq_lens).any()):
        b = int(torch.nonzero(query_lens > seq_lens)[0])
        raise InvalidMetadataError(
            f"seq_lens[{b}]",
            f">= query_lens[{b}]={int(query_lens[b])} (seq_lens count cached + new tokens)",
            int(seq_lens[b]),
        )


def check_is_metadata(field: str, meta: object) -> AttentionMetadata:
    """``meta`` if it is an ``AttentionMetadata`` (a ``Plan`` in its place is named as such)."""
    if isinstance(meta, AttentionMetadata):
        return meta
    # A Plan in its place, recognised by its field (contract.plan builds on this module).
    is_plan = isinstance(getattr(meta, "metadata", None), AttentionMetadata)
    hint = "Pass plan.metadata, or plan the metadata once" if is_plan else ""
    found = "None" if meta is None else f"a {type(meta).__name__}"
    raise InvalidInputError(field, "an AttentionMetadata", found, hint)


def check_metadata(meta: object, page_size: int | None = None) -> None:
    """``meta`` is an ``AttentionMetadata`` whose host-only invariants hold (no device sync):
    what every ``plan`` checks (``contract.validate.check_fields``)."""
    check_fields(check_is_metadata("meta", meta), page_size)


def validate_metadata(
    meta: object,
    layout_or_cache: KVCacheLayout | KVCache | int | None,
    reserved_page: int | None = 0,
    sliding_window: int | None = None,
    attention_chunk_size: int | None = None,
) -> None:
    """``AttentionMetadata.validate`` for any object: the type first, then every invariant."""
    checked = check_is_metadata("meta", meta)
    validate_fields(checked, layout_or_cache, reserved_page, sliding_window, attention_chunk_size)

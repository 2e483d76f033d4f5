"""Chunked local attention as plain attention over a *virtual batch* (for kernels without a
chunk mask).

FA3 and FlashInfer serve ``LayerSpec.attention_chunk_size = C`` the way vLLM and SGLang serve
Llama 4: every chunk that a sequence's query rows fall in becomes one virtual sequence, whose
keys are that chunk's keys up to the end of the sequence. The kernel then runs its usual mask
over the virtual batch, and gets the chunked result, because:

- a virtual sequence starts on a chunk boundary, so its positions are the real ones minus the
  chunk start; bottom-right causality and a sliding window look only at differences of
  positions and mean the same there, and a non-causal row sees exactly its chunk;
- query rows stay where they were: a sequence's virtual sequences follow each other in chunk
  order and sequences keep theirs, so the virtual ``query_start_loc`` only adds boundaries and
  every output lands in its original row; ``slot_mapping`` is the original one;
- C is a multiple of the page size P (``chunk_reasons`` refuses other sizes), so a chunk starts
  on a page and a virtual sequence's page-table row is a slice of its sequence's row;
- a sequence without queries keeps one virtual sequence (its last chunk, no query), so a decode
  batch (at most one query per sequence) has exactly one virtual sequence per sequence.

Example, C = 4, a sequence that extends positions 3..9 (query_len 7, seq_len 10)::

    virtual sequence   keys (positions)   queries (positions)   query_len   seq_len
    0                  0..3               3                     1           4
    1                  4..7               4..7                  4           4
    2                  8..9               8..9                  2           2

Decode batches are rebuilt on the device from the device tensors alone, in fixed shapes, so a
captured CUDA graph can replay the construction. Any other batch is described on the host
(O(virtual sequences) work, from the host twins) and its page table gathered on the device
without a sync; its number of virtual sequences changes from step to step, which a captured
graph cannot follow (``check_capture`` refuses such captures).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from collections.abc import Iterable

    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec

__all__ = ["check_capture", "chunk_reasons", "prepared_chunks", "virtual_metadata"]

_CFG = ReasonKind.CONFIGURATION


def chunk_reasons(layer: LayerSpec | None, layout: KVCacheLayout | None) -> list[Reason]:
    """Why a backend that serves chunks as virtual sequences cannot serve ``layer`` on
    ``layout``: a chunk size that is not a multiple of the page size."""
    if layer is None or layout is None or layer.attention_chunk_size is None:
        return []
    c, p = layer.attention_chunk_size, layout.page_size
    if c % p == 0:
        return []
    return [
        Reason(
            _CFG,
            "attention_chunk_size",
            f"must be a multiple of page_size={p} (chunks are served as virtual sequences, "
            f"which must start on a page), found {c}",
        )
    ]


def check_capture(meta: AttentionMetadata) -> None:
    """Refuse a CUDA-graph capture of chunked layers unless each row has at most one query:
    the virtual batch of any other step changes size from step to step."""
    if meta.max_query_len > 1:
        raise UnsupportedConfigError(
            "chunked local attention cannot be captured in this CUDA graph:",
            [
                Reason(
                    _CFG,
                    "attention_chunk_size",
                    "is served in decode graphs only (at most one query token per sequence; "
                    "other steps split into a number of virtual sequences that changes every "
                    f"step), found a capture of max_query_len={meta.max_query_len}",
                )
            ],
        )


def prepared_chunks(
    pairs: Iterable[tuple[LayerSpec, KVCacheLayout]], meta: AttentionMetadata
) -> list[tuple[int, int]]:
    """The (chunk size, page size) pairs of the chunked layers among ``pairs`` (a backend's
    ``prepared``) that can run with ``meta``'s page table: the page size it records, if any,
    and one its width covers. In first-seen order, without repeats."""
    width, longest = meta.page_table.shape[1], meta.max_seq_len
    found = (
        (layer.attention_chunk_size, layout.page_size)
        for layer, layout in pairs
        if layer.attention_chunk_size is not None
    )
    return [
        (c, p)
        for c, p in dict.fromkeys(found)
        if c % p == 0 and meta.page_size in (None, p) and width * p >= longest
    ]


def virtual_metadata(meta: AttentionMetadata, chunk_size: int, page_size: int) -> AttentionMetadata:
    """The virtual batch of ``meta`` for chunks of ``chunk_size`` tokens on pages of
    ``page_size`` (the cache's P; ``chunk_size`` must be a multiple of it). No device sync.

    Attention over it with the chunk rule left out equals attention over ``meta`` with it
    (module docstring). Its ``num_tokens`` and ``slot_mapping`` are ``meta``'s. Host maxima:
    exact, except for a decode batch, whose are ``meta``'s bounded by the chunk size (it is
    built from device tensors, which under a CUDA graph change after capture).
    """
    if chunk_size % page_size:
        raise InvalidInputError("chunk_size", f"a multiple of page_size={page_size}", chunk_size)
    if meta.max_query_len <= 1:
        return _decode(meta, chunk_size, page_size)
    return _any(meta, chunk_size, page_size)


def _decode(meta: AttentionMetadata, c: int, p: int) -> AttentionMetadata:
    """One virtual sequence per sequence: its last chunk, where its query (if any) is."""
    start = (meta.seq_lens - 1).clamp_min(0) // c * c
    start_cpu = (meta.seq_lens_cpu - 1).clamp_min(0) // c * c
    width = meta.page_table.shape[1]
    # A chunk spans C / P pages; a table narrower than that holds the whole sequence already.
    cols = (start // p).long()[:, None] + torch.arange(min(c // p, width), device=meta.device)
    return dataclasses.replace(
        meta,
        seq_lens=meta.seq_lens - start,
        seq_lens_cpu=meta.seq_lens_cpu - start_cpu,
        page_table=meta.page_table.gather(1, cols.clamp_max(max(width - 1, 0))),
        max_seq_len=min(meta.max_seq_len, c),
        page_size=p,
    )


def _any(meta: AttentionMetadata, c: int, p: int) -> AttentionMetadata:
    """One virtual sequence per (sequence, chunk its queries touch), described on the host."""
    qsl = meta.query_start_loc_cpu.long()
    seq = meta.seq_lens_cpu.long()
    qlen = qsl[1:] - qsl[:-1]
    first_query = seq - qlen
    last = (seq - 1).clamp_min(0) // c
    first = torch.where(qlen > 0, first_query // c, last)
    count = last - first + 1
    owner = torch.repeat_interleave(torch.arange(seq.shape[0]), count)
    n = owner.shape[0]
    rank = torch.arange(n) - (torch.cumsum(count, 0) - count)[owner]
    start = (first[owner] + rank) * c
    end = torch.minimum(seq[owner], start + c)
    keys = end - start
    queries = end - torch.maximum(first_query[owner], start)
    qsl_v = torch.zeros(n + 1, dtype=torch.long)
    torch.cumsum(queries, 0, out=qsl_v[1:])
    # One host-to-device copy for all the device needs, from pinned memory: from pageable
    # memory the driver may wait for the stream first.
    host = torch.cat([qsl_v, keys, owner, start // p])
    if meta.device.type == "cuda":
        host = host.pin_memory()
    dev = host.to(meta.device, non_blocking=True)
    qsl_d, keys_d, owner_d, col_d = dev.split([n + 1, n, n, n])
    width = meta.page_table.shape[1]
    longest = int(keys.max()) if n else 0
    cols = col_d[:, None] + torch.arange(min(max(1, -(-longest // p)), width), device=meta.device)
    return AttentionMetadata(
        query_start_loc=qsl_d.to(torch.int32),
        seq_lens=keys_d.to(torch.int32),
        page_table=meta.page_table[owner_d[:, None], cols.clamp_max(max(width - 1, 0))],
        slot_mapping=meta.slot_mapping,
        query_start_loc_cpu=qsl_v.to(torch.int32),
        seq_lens_cpu=keys.to(torch.int32),
        num_tokens=meta.num_tokens,
        max_query_len=int(queries.max()) if n else 0,
        max_seq_len=longest,
        page_size=p,
    )

"""The ``flex`` backend's per-step block-mask inputs, built on the device from the metadata.

Shape legend of ``attnsdk.contract.backend``; Bb, Lb, Wb are buckets:

- **KV straight from the cache, no gather copy.** The whole page pool of an NHD cache is one KV
  sequence: ``k_nhd`` (N, P, Hkv, D) is viewed as (1, Hkv, N*P, D) (a permute, no copy; its
  strides are fixed per cache, so they never cause a recompile). A ``BlockMask`` whose KV block
  size is the page size lists, per sequence and per 128-row query block, only the pages that
  hold keys some row of that block may see (pages below a sliding window are left out, which
  also keeps vLLM's null block out of real rows; so are pages outside a query block's chunks).
  The kernel reads nothing else.
- **Positions through a per-page table.** ``mask_mod`` needs each key's logical position:
  ``page_pos[n]`` (N + 1 int32, built per step on the device by one scatter from the page table,
  no host sync) holds the logical index of physical page n. ``mask_mod`` also checks that
  ``page_table[b, page_pos[n]] == n``, so a row never counts another sequence's page (the eager
  path ignores block sparsity, so the mask must be complete on its own). A page read by two
  sequences of one step must therefore sit at the same logical index in both, which prefix
  sharing (SGLang's radix cache, vLLM's prefix caching) does (a page table that breaks the rule
  is refused on the CPU before anything is written, where checking costs no sync; on CUDA the
  step reports it through the backend's page flag, ``bad_page``); a [B, N] table would lift
  that rule but costs B*N*4 bytes per step (1 GiB at B=256 and a million pages).
- **Queries: one row per sequence**, (Bb, Hq, Lb, D) with Lb = next power of two >= the longest
  query. This suits decode and speculative verify (on CUDA flex uses its split-KV decoding kernel
  for Lb < 128). Mixed batches with one long prefill pad every row to that prefill's length: the
  padded query blocks list no page so they cost a launch slot, not FLOPs, but q and the output
  staging buffer grow to Bb*Lb rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.errors import InvalidMetadataError

if TYPE_CHECKING:
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = ["Q_BLOCK", "LayerKind", "StepMask", "bad_page", "build_mask", "check_shared_pages"]

Q_BLOCK = 128
"""Query rows per BlockMask block: a multiple of every forward BLOCK_M flex picks on CUDA."""
_NEGATIVE = 1 << 40
"""Flag code of a negative page id ``p``: ``_NEGATIVE - p`` (the flag keeps the largest code)."""


@dataclass(frozen=True, slots=True)
class LayerKind:
    """Per (layer, layout): what the masks and the compiled function depend on."""

    page_size: int
    causal: bool
    window_left: int
    chunk: int
    """Chunked local attention C, 0 = off."""
    softcap: float
    scale: float
    sinks: bool
    gqa_pow2: bool

    @classmethod
    def of(cls, layer: LayerSpec, layout: KVCacheLayout) -> LayerKind:
        g = layer.group_size
        return cls(
            page_size=layout.page_size,
            causal=layer.causal,
            window_left=layer.window_left,
            chunk=layer.attention_chunk_size or 0,
            softcap=float(layer.softcap or 0.0),
            scale=layer.softmax_scale,
            sinks=layer.has_sinks,
            gqa_pow2=g & (g - 1) == 0,
        )


@dataclass(frozen=True, slots=True)
class StepMask:
    """One step's BlockMask inputs and the tensors ``mask_mod`` reads (all on the device)."""

    kv_num_blocks: torch.Tensor
    """(Bb, 1, nq) int32: pages listed per sequence and query block."""
    kv_indices: torch.Tensor
    """(Bb, 1, nq, Wb) int32: physical pages, in logical order."""
    page_pos: torch.Tensor
    """(N + 1,) int32: logical index of each physical page (entry N: sink of unused columns)."""
    page_table: torch.Tensor
    """(Bb, Wpt) int32: the page table, padding rows -1."""
    seq_lens: torch.Tensor
    """(Bb,) int32: KV lengths, padding rows 0."""
    q_start: torch.Tensor
    """(Bb,) int32: KV position of each row's first query."""
    q_index: torch.Tensor
    """(Bb * Lb,) int64: token row of q gathered into each padded query row."""
    out_row: torch.Tensor
    """(T,) int64: padded row (b * Lb + j) each token's output is read from."""
    tree: torch.Tensor | None
    """(Bb, Lb, Lb) bool: the step's tree mask by padded row and new-token column, or None."""


def _next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, x))))


def build_mask(
    meta: AttentionMetadata, st: LayerKind, n: int, t: int, bad_page: torch.Tensor | None
) -> StepMask:
    """Per-step block mask inputs, on the device, from the metadata alone (no host sync).

    ``bad_page`` (CUDA): the ``DeviceFlag`` tensor that a page read wrongly is reported into.
    """
    dev = meta.device
    p = st.page_size
    b = meta.num_seqs
    bb = _next_pow2(b)
    lb = _next_pow2(max(1, meta.max_query_len))
    nq = -(-lb // Q_BLOCK)
    # The CPU kernel wants one index column per pool page; CUDA only as many as a row reads.
    wb = n if dev.type == "cpu" else min(n, _next_pow2(-(-max(1, meta.max_seq_len) // p)))
    i32 = torch.int32
    qsl = meta.query_start_loc.to(i32)
    seq = meta.seq_lens.to(i32)
    qlen = qsl[1:] - qsl[:-1]
    pad = bb - b
    seq_p = torch.nn.functional.pad(seq, (0, pad))
    qlen_p = torch.nn.functional.pad(qlen, (0, pad))
    qsl_p = torch.nn.functional.pad(qsl[:-1], (0, pad))
    q_start = seq_p - qlen_p
    pt = meta.page_table.to(i32).clamp(0, n - 1)
    wpt = pt.shape[1]
    # mask_mod reads the table: its width is bucketed too, or every new width would recompile.
    pt_p = torch.nn.functional.pad(pt, (0, _next_pow2(wpt) - wpt, 0, pad), value=-1)

    # Logical index of every page the batch maps (unused columns scatter into entry n).
    cols = torch.arange(wpt, device=dev, dtype=i32)
    used = cols[None, :] < ((seq + p - 1) // p)[:, None]
    page_pos = torch.zeros(n + 1, dtype=i32, device=dev)
    target = torch.where(used, pt, n).long().flatten()
    page_pos.scatter_(0, target, cols.expand(b, wpt).flatten())
    if bad_page is not None:
        # Ids are clamped into the pool and page_pos holds one logical index per page, so a
        # page id outside the pool, or a page at two logical indices, would be read as some
        # other key: reported through the flag instead (the CPU checks it before any write).
        raw = meta.page_table.long()
        wrong = used & (
            (raw < 0) | (raw >= n) | (page_pos.gather(0, pt.flatten()).view_as(pt) != cols)
        )
        code = torch.where(raw < 0, _NEGATIVE - raw, raw)
        bad_page.copy_(torch.maximum(bad_page, torch.where(wrong, code, -1).amax().view(1)))

    # Pages each (row, query block) may see, in logical order.
    j0 = torch.arange(nq, device=dev, dtype=i32)[None, :] * Q_BLOCK  # (1, nq)
    real = (qlen_p[:, None] - j0).clamp(0, min(Q_BLOCK, lb))  # rows of the block in use
    first_pos = q_start[:, None] + j0
    last_pos = first_pos + real - 1
    hi = (seq_p - 1)[:, None].expand_as(last_pos)
    wl = st.window_left
    if st.causal:
        hi = torch.minimum(hi, last_pos)
    elif wl >= 0:
        hi = torch.minimum(hi, last_pos + wl)
    lo = (first_pos - wl).clamp_min(0) if wl >= 0 else torch.zeros_like(first_pos)
    if st.chunk:
        # The block's rows see nothing before its first row's chunk or after its last row's.
        lo = torch.maximum(lo, first_pos // st.chunk * st.chunk)
        hi = torch.minimum(hi, (last_pos // st.chunk + 1) * st.chunk - 1)
    first_page = lo // p
    count = torch.where((real > 0) & (hi >= lo), hi.clamp_min(0) // p - first_page + 1, 0)
    count = count.clamp(0, wb)
    ramp = torch.arange(wb, device=dev, dtype=i32)
    col = (first_page[..., None] + ramp).clamp(0, wpt - 1).long()  # (Bb, nq, Wb)
    rows = torch.arange(bb, device=dev)[:, None, None].clamp(max=b - 1)
    indices = torch.where(ramp < count[..., None], pt[rows, col], 0)

    # Query gather (padded rows repeat a real row: finite, discarded) and output scatter.
    j = torch.arange(lb, device=dev, dtype=torch.int64)
    q_index = qsl_p.long()[:, None] + j.clamp_max(qlen_p.long()[:, None] - 1).clamp_min(0)
    # Rows past num_tokens (allowed, unspecified) are never gathered: the tree mask has
    # only num_tokens rows for sure.
    q_index = q_index.clamp(0, max(1, min(t, meta.num_tokens)) - 1).flatten()
    tok = torch.arange(t, device=dev, dtype=i32)
    seq_of = torch.searchsorted(qsl[1:], tok, right=True).clamp_max(b - 1)
    out_row = seq_of.long() * lb + (tok - qsl[seq_of]).long().clamp(0, lb - 1)
    return StepMask(
        kv_num_blocks=count.view(bb, 1, nq).to(i32).contiguous(),
        kv_indices=indices.view(bb, 1, nq, wb).to(i32).contiguous(),
        page_pos=page_pos,
        page_table=pt_p,
        seq_lens=seq_p,
        q_start=q_start,
        q_index=q_index,
        out_row=out_row,
        tree=None if meta.tree_mask is None else _tree_rows(meta.tree_mask, q_index, bb, lb),
    )


def _tree_rows(mask: torch.Tensor, q_index: torch.Tensor, bb: int, lb: int) -> torch.Tensor:
    """The tree mask as (Bb, Lb, Lb): padded query row by new-token column (False past M)."""
    rows = mask.index_select(0, q_index)[:, :lb]
    if rows.shape[1] < lb:
        rows = torch.nn.functional.pad(rows, (0, lb - rows.shape[1]), value=False)
    return rows.reshape(bb, lb, lb).contiguous()


def bad_page(code: int, when: str) -> Exception:
    """What the page flag raises for ``code``, the largest flag code of a page read wrongly
    (``build_mask``)."""
    page = -(code - _NEGATIVE) if code >= _NEGATIVE else code
    return InvalidMetadataError(
        "page_table",
        "page ids in [0, num_pages), each at one logical index in every sequence that reads it "
        "(the flex backend maps a page to one position per step)",
        f"page {page}",
        f"That step's output was computed from other keys ({when})",
    )


def check_shared_pages(meta: AttentionMetadata, page_size: int, num_pages: int) -> None:
    """A page two sequences read must sit at one logical index in both (``page_pos`` holds one
    index per page). Checked where it costs no device sync (CPU); on CUDA it is the documented
    rule of this backend."""
    seq = meta.seq_lens_cpu.long()
    pt = meta.page_table.long()
    cols = torch.arange(pt.shape[1])
    used = cols[None, :] < ((seq + page_size - 1) // page_size)[:, None]
    pages, logical = pt[used], cols.expand_as(pt)[used]
    first = torch.full((num_pages,), -1, dtype=torch.long)
    first.scatter_(0, pages, logical)
    clash = first[pages] != logical
    if bool(clash.any()):
        page = int(pages[clash][0])
        raise InvalidMetadataError(
            "page_table",
            "each page at one logical index in every sequence that reads it (the flex backend "
            "maps a page to one position per step)",
            f"page {page} at logical indices {sorted(set(logical[pages == page].tolist()))}",
        )

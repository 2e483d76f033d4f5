"""FlashInfer's CSR page format (``indptr`` / ``indices`` / ``last_page_len``) from attnsdk metadata.

The host describes rows only, from the metadata's host twins (O(rows) work, no device access);
the page ids are gathered on the device where the page table lives, with sizes known on the
host, so building it never syncs the device. (``attnsdk bench``'s raw FlashInfer baseline
builds its page lists independently, so that a bug here cannot hide in both sides.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnsdk.contract.errors import InvalidInputError, InvalidMetadataError

__all__ = ["PagedCSR", "build_csr", "gather_indices"]


@dataclass(frozen=True, slots=True)
class PagedCSR:
    """FlashInfer's page format for R rows, described on the host (shape legend: R rows, nnz
    pages). Only O(R) host work: the page ids themselves are gathered on the device
    (``gather_indices``).

    Row r owns query rows ``qo_indptr[r]:qo_indptr[r+1]`` and pages
    ``indices[kv_indptr[r]:kv_indptr[r+1]]``, the last one filled to ``last_page_len[r]``.
    """

    qo_indptr: torch.Tensor
    """(R + 1,) int32, on the CPU."""
    kv_indptr: torch.Tensor
    """(R + 1,) int32, on the CPU."""
    last_page_len: torch.Tensor
    """(R,) int32, on the CPU: ``L - (pages - 1) * P``, 0 for an empty row."""
    seq_of_row: torch.Tensor
    """(R,) int64, on the CPU: the page-table row each CSR row reads."""
    width: int
    """The page table's W."""

    @property
    def num_rows(self) -> int:
        return self.last_page_len.shape[0]

    @property
    def num_q_rows(self) -> int:
        """Query rows the kernel reads: ``qo_indptr[-1]``."""
        return int(self.qo_indptr[-1])

    @property
    def nnz(self) -> int:
        return int(self.kv_indptr[-1])

    @property
    def positions(self) -> torch.Tensor:
        """(nnz,) int64 on the CPU: where each page id sits in the flattened (B, W) table
        (what ``gather_indices`` computes on the device; for tests and debugging)."""
        return _positions(self.kv_indptr.long(), self.seq_of_row, self.width, self.nnz)


def _positions(
    kv_indptr: torch.Tensor, seq_of_row: torch.Tensor, width: int, nnz: int
) -> torch.Tensor:
    """Flat page-table positions of every CSR page, on the tensors' device, no sync."""
    dev = kv_indptr.device
    pages = kv_indptr[1:] - kv_indptr[:-1]
    rows = torch.arange(pages.shape[0], device=dev)
    row_of_page = torch.repeat_interleave(rows, pages, output_size=nnz)
    col = torch.arange(nnz, device=dev) - kv_indptr[:-1][row_of_page]
    return seq_of_row[row_of_page] * width + col


def build_csr(
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    page_size: int,
    width: int,
    *,
    per_token: bool,
    rows: int | None = None,
) -> PagedCSR:
    """The CSR form of a batch from its host twins (no device work, O(rows) host work).

    ``per_token=False``: one row per sequence, ``qo_indptr = query_start_loc``.
    ``per_token=True`` (decode steps, every query length <= 1): one row per query row, each
    pointing at its sequence's pages; ``rows`` (>= ``query_start_loc[-1]``) pads the tail with
    rows that own no query token and read one key on the page at flat position 0.
    ``width`` is the page table's W. Raises ``InvalidMetadataError`` when a sequence needs more
    than W pages.
    """
    qsl = query_start_loc_cpu.long()
    seq = seq_lens_cpu.long()
    b = seq.shape[0]
    pages_of_seq = (seq + page_size - 1) // page_size
    if b and int(pages_of_seq.max()) > width:
        i = int(torch.argmax(pages_of_seq))
        raise InvalidMetadataError(
            "page_table",
            f"at least {int(pages_of_seq[i])} columns for seq_lens[{i}]={int(seq[i])} "
            f"at page_size {page_size}",
            width,
        )
    if per_token:
        owned = int(qsl[-1])
        total = owned if rows is None else rows
        if total < owned:
            raise InvalidInputError("rows", f">= query_start_loc[-1]={owned}", total)
        seq_of_row = torch.repeat_interleave(torch.arange(b), qsl[1:] - qsl[:-1])
        lens = seq[seq_of_row]
        pad = total - owned
        if pad:
            filler = 1 if width > 0 and b > 0 else 0
            seq_of_row = torch.cat([seq_of_row, torch.zeros(pad, dtype=torch.long)])
            lens = torch.cat([lens, torch.full((pad,), filler, dtype=torch.long)])
        qo_indptr = torch.arange(total + 1, dtype=torch.int32)
    else:
        seq_of_row = torch.arange(b)
        lens = seq
        qo_indptr = qsl.to(torch.int32)
    pages = (lens + page_size - 1) // page_size
    kv_indptr = torch.zeros(pages.shape[0] + 1, dtype=torch.long)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    return PagedCSR(
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr.to(torch.int32),
        last_page_len=last.to(torch.int32),
        seq_of_row=seq_of_row,
        width=width,
    )


def gather_indices(
    page_table: torch.Tensor,
    csr: PagedCSR,
    *,
    out: torch.Tensor | None = None,
    staging: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CSR ``indices`` (nnz,) int32 on the page table's device, without a device sync.

    The O(R) row description goes to the device in one asynchronous copy (into ``staging``
    when given: a static int64 buffer of at least 2R + 1 entries); the flat positions of the
    nnz pages are computed there and one ``index_select`` reads the page ids (into ``out``
    when given). Measured on an H200 before this: positions built on the host cost up to
    3.9 ms per step at 256 x 32k.
    """
    flat = page_table.reshape(-1)  # a view, or one device copy for a strided page table
    r, nnz = csr.num_rows, csr.nnz
    host = torch.cat([csr.kv_indptr.long(), csr.seq_of_row])
    if staging is not None:
        rows = staging[: 2 * r + 1]
        rows.copy_(host, non_blocking=True)
    else:
        rows = host.to(page_table.device, non_blocking=True)
    pos = _positions(rows[: r + 1], rows[r + 1 :], csr.width, nnz)
    if out is not None:
        return torch.index_select(flat, 0, pos, out=out[:nnz])
    return flat.index_select(0, pos)

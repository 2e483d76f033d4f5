"""Static metadata buffers for CUDA-graph capture and replay, shared by every backend.

A graph captured for ``batch_size`` rows and ``num_tokens`` token rows reads its metadata from
fixed addresses. ``GraphBuffers`` owns those buffers (sized for the largest capture); a captured
plan views a prefix of them, and ``replay_update`` copies a smaller real batch in, padding the
rest: padding rows take an even share of the leftover token rows (the last one the remainder;
at most the captured ``max_query_len`` each), see that many keys (at least ``seq_len_fill``) on the reserved page and
write nothing (slot -1); token rows left over after that belong to no sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attnsdk.contract.checks import check_int, check_usable_device
from attnsdk.contract.errors import (
    InvalidInputError,
    InvalidMetadataError,
)
from attnsdk.contract.metadata import AttentionMetadata, check_is_metadata, check_metadata

__all__ = ["GraphBuffers", "Plan"]


class GraphBuffers:
    """Static device buffers (and host twins) that captured plans view.

    >>> buffers = GraphBuffers(max_batch=4, max_tokens=4, max_pages=2, page_size=16, device="cpu")
    >>> captured = buffers.capture_metadata(batch_size=4, num_tokens=4)
    >>> real = AttentionMetadata.from_seqlens([1, 1], [20, 5], [[3, 4], [5, 0]], page_size=16)
    >>> buffers.replay_update(captured, real)
    >>> captured.seq_lens.tolist(), captured.slot_mapping.tolist()
    ([20, 5, 1, 1], [67, 84, -1, -1])
    """

    def __init__(
        self,
        max_batch: int,
        max_tokens: int,
        max_pages: int,
        *,
        page_size: int,
        device: torch.device | str,
        reserved_page: int = 0,
        seq_len_fill: int = 1,
    ) -> None:
        self.max_batch = check_int("max_batch", max_batch)
        self.max_tokens = check_int("max_tokens", max_tokens)
        self.max_pages = check_int("max_pages", max_pages)
        self.page_size = check_int("page_size", page_size)
        self.reserved_page = check_int("reserved_page", reserved_page, low=0)
        self.seq_len_fill = check_int(
            "seq_len_fill", seq_len_fill, low=0, high=max_pages * page_size
        )
        dev = check_usable_device("device", device)
        i32 = torch.int32
        self.query_start_loc = torch.zeros(max_batch + 1, dtype=i32, device=dev)
        self.seq_lens = torch.full((max_batch,), seq_len_fill, dtype=i32, device=dev)
        self.page_table = torch.full((max_batch, max_pages), reserved_page, dtype=i32, device=dev)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=dev)
        self.query_start_loc_cpu = torch.zeros(max_batch + 1, dtype=i32)
        self.seq_lens_cpu = torch.full((max_batch,), seq_len_fill, dtype=i32)
        self._ramp = torch.arange(max_batch + 1, dtype=i32, device=dev)
        self._ramp_cpu = torch.arange(max_batch + 1, dtype=i32)

    def capture_metadata(
        self, batch_size: int, num_tokens: int, *, max_query_len: int | None = None
    ) -> AttentionMetadata:
        """Metadata of basic-slice views for a graph of ``batch_size`` rows and ``num_tokens`` tokens.

        Its host maxima are upper bounds because the captured kernels keep them: every page used,
        and ``max_query_len`` (default: every row has one token and one row all the rest; pass
        the tokens per row for uniform graphs such as speculative verify, so the kernel is sized
        for them). Replay takes any smaller real batch whose longest query fits.
        """
        batch_size = check_int("batch_size", batch_size, high=self.max_batch)
        num_tokens = check_int("num_tokens", num_tokens, low=batch_size, high=self.max_tokens)
        # No row can hold more query tokens than keys its page-table row covers.
        loosest = min(num_tokens - batch_size + 1, self.capacity)
        if max_query_len is None:
            max_query_len = loosest
        elif (
            isinstance(max_query_len, bool)
            or not isinstance(max_query_len, int)
            or not -(-num_tokens // batch_size) <= max_query_len <= loosest
        ):
            raise InvalidInputError(
                "max_query_len",
                f"{-(-num_tokens // batch_size)}..{loosest} for {num_tokens} tokens in "
                f"{batch_size} rows of at most max_pages * page_size = {self.capacity} keys",
                repr(max_query_len),
            )
        self._pad(0, 0, batch_size, num_tokens, max_query_len)
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: batch_size + 1],
            seq_lens=self.seq_lens[:batch_size],
            page_table=self.page_table[:batch_size],
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc_cpu=self.query_start_loc_cpu[: batch_size + 1],
            seq_lens_cpu=self.seq_lens_cpu[:batch_size],
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=self.capacity,
            page_size=self.page_size,
        )

    @property
    def capacity(self) -> int:
        """Keys one page-table row covers: ``max_pages * page_size``."""
        return self.max_pages * self.page_size

    def replay_update(self, captured: AttentionMetadata, meta: AttentionMetadata) -> None:
        """Copy ``meta`` into the buffers that ``captured`` views and pad the remaining rows.

        ``meta`` passes ``plan``'s host checks first (from its host twins, no device sync): its
        ``max_query_len`` / ``max_seq_len`` must bound its real lengths, since the captured
        kernels are sized by them, and its page table must cover ``max_seq_len`` at the
        buffers' page size. Nothing is written before a refusal.
        """
        check_is_metadata("captured", captured)
        check_metadata(meta, self.page_size)
        bs, tokens = captured.num_seqs, captured.num_tokens
        b, t = meta.num_seqs, meta.num_tokens
        if b > bs:
            raise InvalidMetadataError("seq_lens", f"at most {bs} sequences (captured batch)", b)
        if t > tokens:
            raise InvalidMetadataError("num_tokens", f"at most {tokens} (captured tokens)", t)
        if meta.max_query_len > captured.max_query_len:
            raise InvalidMetadataError(
                "max_query_len", f"<= {captured.max_query_len} (captured)", meta.max_query_len
            )
        if meta.page_size is not None and meta.page_size != self.page_size:
            raise InvalidMetadataError(
                "page_size", f"{self.page_size} (the graph buffers')", meta.page_size
            )
        if meta.max_seq_len > captured.max_seq_len:
            raise InvalidMetadataError(
                "max_seq_len",
                f"<= max_pages * page_size = {captured.max_seq_len} (graph buffers)",
                meta.max_seq_len,
            )
        width = min(meta.page_table.shape[1], self.max_pages)
        self.query_start_loc[: b + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.page_table[:b, :width].copy_(meta.page_table[:, :width], non_blocking=True)
        self.page_table[:b, width:].fill_(self.reserved_page)
        self.slot_mapping[:t].copy_(meta.slot_mapping[:t], non_blocking=True)
        self.query_start_loc_cpu[: b + 1].copy_(meta.query_start_loc_cpu)
        self.seq_lens_cpu[:b].copy_(meta.seq_lens_cpu)
        self._pad(b, t, bs, tokens, captured.max_query_len)

    def _pad(self, b: int, t: int, bs: int, tokens: int, max_query_len: int) -> None:
        """Rows b..bs-1 share token rows t..tokens-1 evenly (the last also takes the remainder),
        each at most ``max_query_len`` (which ``capture_metadata`` keeps within a row's pages)."""
        self.slot_mapping[t:tokens].fill_(-1)
        if b == bs:
            return
        share = min((tokens - t) // (bs - b), max_query_len)
        end = min(tokens, t + share * (bs - b - 1) + max_query_len)
        self.page_table[b:bs].fill_(self.reserved_page)
        for qsl, seq, ramp in (
            (self.query_start_loc, self.seq_lens, self._ramp),
            (self.query_start_loc_cpu, self.seq_lens_cpu, self._ramp_cpu),
        ):
            pad = qsl[b + 1 : bs + 1]
            torch.mul(ramp[1 : bs - b + 1], share, out=pad)
            pad.add_(t)
            qsl[bs].fill_(end)
            torch.sub(qsl[b + 1 : bs + 1], qsl[b:bs], out=seq[b:bs])
            seq[b:bs].clamp_(min=self.seq_len_fill)


@dataclass(frozen=True, slots=True)
class Plan:
    """What ``Backend.plan`` returns: the step's metadata plus backend-private precomputation.

    Backends subclass it. A plan made by ``plan_for_capture`` also carries the static
    ``graph`` buffers its tensors are views of, which ``plan_for_replay`` refreshes in place.
    """

    metadata: AttentionMetadata
    graph: GraphBuffers | None = None

"""Speculative-tree verify: ``AttentionMetadata.tree_mask``, what it means and who serves it.

A verify step carries, per sequence, n draft tokens that form a tree (EAGLE with topk > 1,
NGRAM): token i must see the context (every key before the sequence's new tokens) and, among
the new tokens, only its ancestors and itself, not every earlier token as a causal chain would.
Trees list parents before children, so the ancestors of token i are all among tokens 0..i-1.

Semantics (docs/kv_layout.md, "Tree verify"): the query row t, new token i of its sequence,
sees key position k < seq_len - n always, and the new token j <= i when ``tree_mask[t, j]``.
All new tokens' K/V are written before attention as in any step. The mask replaces only the
causal rule among the new tokens: a layer with a sliding window, attention chunks or no
causality has no meaning for a tree's positions and is refused (``refusals``), as is a
CUDA-graph capture (the graph buffers carry no mask).

Kernels without a mask input (FA3) serve a tree in two passes merged by their log-sum-exps
(``tree_passes``, SGLang's way for EAGLE topk > 1): one over each sequence's context, non-causal
(every row sees all of it), and one in which every query row is a sequence of its own whose keys
are its visible new tokens, found through a page table of slots over the pool viewed with pages
of one token. ``attnsdk.merge_states`` then gives attention over the union, exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.capabilities import Feature
from attnsdk.contract.checks import check_usable_device
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from attnsdk.contract.capabilities import Request

__all__ = [
    "TreePasses",
    "refusals",
    "token_pool",
    "tree_mask_from_parents",
    "tree_passes",
]


def tree_mask_from_parents(
    parents: Sequence[Sequence[int]], device: torch.device | str | None = None
) -> torch.Tensor:
    """The (T, M) ``tree_mask`` of draft trees given as parent lists, M = the longest list.

    ``parents[b][i]`` is the parent of sequence b's new token i: an earlier new token of the
    same sequence (0 <= parent < i), or -1 for a child of the context (a root). Rows follow the
    sequences in order, as the step's query rows do; a sequence without new tokens has [].

    >>> tree_mask_from_parents([[-1, 0, 0, 1]]).int().tolist()  # root, two children, a grandchild
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    if not _is_list(parents):
        raise InvalidInputError(
            "parents", "a list of parent lists, one per sequence", _short(parents)
        )
    for b, seq in enumerate(parents):
        if not _is_list(seq):
            raise InvalidInputError(
                f"parents[{b}]", "a list of parents ([] for no new tokens)", _short(seq)
            )
    dev = None if device is None else check_usable_device("device", device)
    width = max((len(p) for p in parents), default=0)
    rows: list[list[bool]] = []
    for b, seq in enumerate(parents):
        seen: list[list[bool]] = []
        for i, parent in enumerate(seq):
            if isinstance(parent, bool) or not isinstance(parent, int) or not -1 <= parent < i:
                raise InvalidInputError(
                    f"parents[{b}][{i}]", f"-1 (a root) or an earlier token 0..{i - 1}", parent
                )
            row = list(seen[parent]) if parent >= 0 else [False] * width
            row[i] = True
            seen.append(row)
        rows.extend(seen)
    return torch.tensor(rows, dtype=torch.bool, device=dev).reshape(len(rows), width)


def _is_list(value: object) -> bool:
    """A list, tuple or other sequence, but not a string (whose characters would be parents)."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes))


def _short(value: object) -> str:
    return repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"


def refusals(request: Request) -> list[Reason]:
    """Why ``request``'s layer cannot run in a step with a tree mask (``Feature.TREE_MASK`` in
    ``request.uses``): the layer features whose positions a tree does not define."""
    layer = request.layer
    if Feature.TREE_MASK not in request.uses or layer is None:
        return []
    reasons = []
    if not layer.causal:
        reasons.append(Reason(ReasonKind.BATCH, "causal", "a tree mask needs a causal layer"))
    if layer.sliding_window is not None:
        reasons.append(
            Reason(
                ReasonKind.BATCH,
                "sliding_window",
                "is not defined over a draft tree's positions; tree verify runs without one",
            )
        )
    if layer.attention_chunk_size is not None:
        reasons.append(
            Reason(
                ReasonKind.BATCH,
                "attention_chunk_size",
                "is not defined over a draft tree's positions; tree verify runs without one",
            )
        )
    return reasons


@dataclass(frozen=True, slots=True)
class TreePasses:
    """A tree verify step as two plain steps (module docstring); built once per plan."""

    context: AttentionMetadata
    """The step with each sequence's keys cut to its context (run non-causal). Not a step of
    the contract: a sequence may have more queries than keys, so only kernels read it."""
    drafts: AttentionMetadata
    """One sequence per query row over its visible new tokens, on pages of one token (run
    non-causal over ``token_pool`` views). Its host twins are upper bounds (new token i sees
    at most i + 1 tokens), as in a replayed plan; the device lengths are exact."""
    context_empty: torch.Tensor
    """(T,) bool, on the device: rows whose sequence has no context (their context pass sees
    no key: the log-sum-exp is set to -inf whatever the kernel writes there)."""
    some_context_empty: bool
    """Whether any sequence has no context (read from the host twins): only then does
    ``context_empty`` need applying."""
    drafts_empty: torch.Tensor
    """(T,) bool, on the device: rows that see no new token (only with a mask that hides a
    token from itself, which ``validate`` refuses)."""


def tree_passes(meta: AttentionMetadata, page_size: int) -> TreePasses:
    """The two passes of ``meta``'s tree verify step (``meta.tree_mask`` must be set) over a
    cache of ``page_size``. No device sync: lengths come from the host twins, the mask stays
    on the device.

    The draft pass finds each visible new token through the page table, like every other key,
    never through ``slot_mapping``: an engine that stored the drafts itself passes slots of -1
    ("do not write"), and the keys are where the page table says they are."""
    mask = meta.tree_mask
    if mask is None:
        raise InvalidInputError("meta.tree_mask", "a tree mask", None)
    dev = meta.device
    t = meta.num_tokens
    qsl = meta.query_start_loc_cpu.long()
    qlen = qsl[1:] - qsl[:-1]
    ctx_cpu = meta.seq_lens_cpu - qlen.to(torch.int32)
    owner = torch.repeat_interleave(torch.arange(qlen.shape[0]), qlen)
    first = qsl[:-1][owner]  # each row's sequence's first query row
    index = torch.arange(t) - first  # each row's new-token index i
    host = torch.cat([owner, index, qlen[owner], ctx_cpu.long()[owner]])
    if dev.type == "cuda":
        host = host.pin_memory()
    owner_d, index_d, n_d, ctx_d = host.to(dev, non_blocking=True).split([t, t, t, t])

    context = dataclasses.replace(
        meta,
        seq_lens=meta.seq_lens - (meta.query_start_loc[1:] - meta.query_start_loc[:-1]),
        seq_lens_cpu=ctx_cpu,
        max_seq_len=int(ctx_cpu.max()) if ctx_cpu.numel() else 0,
        tree_mask=None,
    )

    m = max(1, meta.max_query_len)
    cols = torch.arange(m, device=dev)
    rows = mask[:t, :m] if mask.shape[1] >= m else mask[:t]
    if rows.shape[1] < m:
        rows = torch.nn.functional.pad(rows, (0, m - rows.shape[1]), value=False)
    seen = rows & (cols[None, :] <= index_d[:, None]) & (cols[None, :] < n_d[:, None])
    # Visible columns first, in order: sort keys j (visible) and m + j (hidden).
    order = torch.where(seen, cols, m + cols).argsort(dim=1)
    count = seen.sum(dim=1, dtype=torch.int32)
    # New token j of a row's sequence sits at position context + j. Columns past ``count``
    # are never read; clamped to the sequence's last token they stay inside its pages.
    j = torch.minimum(order, (n_d[:, None] - 1).clamp_min(0))
    pos = (ctx_d[:, None] + j).long()
    pages = meta.page_table[owner_d[:, None], pos // page_size].long()
    slots = pages * page_size + pos % page_size
    drafts = AttentionMetadata(
        query_start_loc=torch.arange(t + 1, dtype=torch.int32, device=dev),
        seq_lens=count,
        page_table=slots.to(torch.int32),
        slot_mapping=meta.slot_mapping,
        query_start_loc_cpu=torch.arange(t + 1, dtype=torch.int32),
        seq_lens_cpu=(index + 1).to(torch.int32),
        num_tokens=t,
        max_query_len=1 if t else 0,
        max_seq_len=m if t else 0,
        page_size=1,
    )
    empty = ctx_cpu == 0
    return TreePasses(
        context, drafts, empty.to(dev)[owner_d], bool(empty.any()), drafts_empty=count == 0
    )


def token_pool(x: torch.Tensor) -> torch.Tensor | None:
    """(N, P, Hkv, D) pages as (N * P, 1, Hkv, D) pages of one token, without a copy; None
    when the pages are not runs of P token rows at one stride (HND caches, vLLM's packed K|V)."""
    n, p, h, d = x.shape
    if x.stride(0) != p * x.stride(1):
        return None
    return x.as_strided((n * p, 1, h, d), (x.stride(1), x.stride(1), x.stride(2), x.stride(3)))

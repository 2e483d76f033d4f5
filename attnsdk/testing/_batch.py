"""``make_batch``: a random paged batch (inputs, metadata, prefilled cache) from a ``BatchSpec``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from attnsdk.contract.errors import InvalidInputError
from attnsdk.contract.kv import KVCache, KVCacheLayout, KVOrder, quantize
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.features.tree import tree_mask_from_parents

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.testing._spec import BatchSpec

__all__ = ["Batch", "PageOrder", "assign_pages", "make_batch"]

PageOrder = Literal["shuffled", "contiguous", "interleaved"]


@dataclass(frozen=True, slots=True)
class Batch:
    """Everything one ``Backend.forward`` call needs, built by ``make_batch``."""

    spec: BatchSpec
    layer: LayerSpec
    metadata: AttentionMetadata
    cache: KVCache
    """Prefilled with random context; every other slot holds random values too."""
    q: torch.Tensor
    """(T, Hq, D) in the layout's compute dtype."""
    k: torch.Tensor
    """(T, Hkv, D): new keys, written at ``metadata.slot_mapping`` by forward."""
    v: torch.Tensor | None
    """(T, Hkv, Dv): new values; None for an MLA layout (V is the latent part of ``k``)."""
    sinks: torch.Tensor | None = None
    """(Hq,) fp32 when ``layer.has_sinks``."""
    k_scale: torch.Tensor | None = None
    """fp32 () or (Hkv,) for fp8 caches."""
    v_scale: torch.Tensor | None = None

    def fresh_cache(self) -> KVCache:
        """A copy of the initial cache, so several backends can run from the same state.

        K and V that are views of one tensor (vLLM's packed K‖V) stay views of one copy, with
        the same strides: a backend then runs on exactly the arrangement it was given.
        """
        k, v = self.cache.k, self.cache.v
        if self.cache.layout.mla:  # one latent tensor: V is a view of it
            return self.cache.layout.wrap(k.clone())
        if k.untyped_storage().data_ptr() != v.untyped_storage().data_ptr():
            return KVCache(self.cache.layout, k.clone(), v.clone())
        whole = k.untyped_storage().nbytes() // k.element_size()
        copy = k.as_strided((whole,), (1,), 0).clone()
        return KVCache(
            self.cache.layout,
            copy.as_strided(k.shape, k.stride(), k.storage_offset()),
            copy.as_strided(v.shape, v.stride(), v.storage_offset()),
        )

    def run(self, backend: Backend, cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Plan and run ``backend`` on a fresh cache copy; return (out[:num_tokens], cache).

        The output buffer is poisoned with NaN first, so rows a backend forgets show up.
        """
        return self._run(backend, cache, lse=None)

    def run_with_lse(
        self, backend: Backend, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
        """``run`` with ``lse=``: (out[:num_tokens], lse[:num_tokens] (T, Hq) fp32, cache).

        Both buffers are poisoned with NaN first.
        """
        lse = torch.full(
            (self.q.shape[0], self.layer.num_heads), float("nan"), device=self.q.device
        )
        out, cache = self._run(backend, cache, lse=lse)
        return out, lse[: self.metadata.num_tokens], cache

    def _run(
        self, backend: Backend, cache: KVCache | None, *, lse: torch.Tensor | None
    ) -> tuple[torch.Tensor, KVCache]:
        cache = self.fresh_cache() if cache is None else cache
        plan = backend.plan(self.metadata)
        out = torch.full(
            (self.q.shape[0], self.layer.num_heads, self.layer.v_dim),
            float("nan"),
            dtype=self.q.dtype,
            device=self.q.device,
        )
        # lse= only when asked for: a backend written before it (the protocol, not
        # BackendBase) still runs.
        extra = {} if lse is None else {"lse": lse}
        # A cross-attention step reads the encoder's keys already in the cache; it writes none.
        write = not self.metadata.cross_attention
        result = backend.forward(
            self.q,
            self.k if write else None,
            self.v if write else None,
            cache,
            plan,
            self.layer,
            sinks=self.sinks,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            out=out,
            **extra,
        )
        return result[: self.metadata.num_tokens], cache


def assign_pages(
    pages_per_seq: list[int], num_pages: int, order: PageOrder, generator: torch.Generator
) -> list[list[int]]:
    """Physical pages for each sequence from pages 1..num_pages-1 (page 0 is reserved)."""
    total = sum(pages_per_seq)
    if total > num_pages - 1:
        raise InvalidInputError(
            "num_pages", f">= {total + 1} (pages needed + reserved page 0)", num_pages
        )
    if order == "contiguous":
        pool = list(range(1, total + 1))
    elif order == "shuffled":
        pool = (torch.randperm(num_pages - 1, generator=generator)[:total] + 1).tolist()
    elif order == "interleaved":
        # Round-robin allocation, as when sequences grow one page at a time side by side.
        slots = [
            (i, b)
            for i in range(max(pages_per_seq, default=0))
            for b, n in enumerate(pages_per_seq)
            if i < n
        ]
        by_seq: list[list[int]] = [[] for _ in pages_per_seq]
        for page, (_, b) in enumerate(slots, start=1):
            by_seq[b].append(page)
        return by_seq
    else:
        raise InvalidInputError("pages", "'shuffled', 'contiguous' or 'interleaved'", repr(order))
    out, start = [], 0
    for n in pages_per_seq:
        out.append(pool[start : start + n])
        start += n
    return out


def make_batch(
    spec: BatchSpec,
    layer: LayerSpec,
    layout: KVCacheLayout,
    *,
    pages: PageOrder = "shuffled",
    seed: int = 0,
    device: torch.device | str = "cpu",
    spare_pages: int = 3,
    per_head_scales: bool = False,
    tree: bool = False,
) -> Batch:
    """A random batch for ``spec``: q/k/v, metadata, a prefilled cache, sinks and fp8 scales.

    Page 0 is reserved for padding rows; ``spare_pages`` unused pages make out-of-range reads
    visible. Values are drawn from a generator seeded with ``seed`` (on the CPU, then moved).
    ``tree``: the new tokens of each sequence form a random draft tree (the metadata's
    ``tree_mask``; token i's parent drawn from -1 .. i - 1, half of them i - 1). A ``spec.cross``
    batch is a cross-attention step: the cache holds the encoder's keys, ``run`` writes none.

    >>> from attnsdk import KVCacheLayout, LayerSpec
    >>> from attnsdk.testing import BatchSpec
    >>> layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=32)
    >>> batch = make_batch(BatchSpec.decode(batch_size=2), layer, KVCacheLayout(2, 32, 16))
    >>> tuple(batch.q.shape), batch.metadata.num_seqs
    ((2, 4, 32), 2)
    """
    if (layer.num_kv_heads, layer.head_dim, layer.mla) != (
        layout.num_kv_heads,
        layout.head_dim,
        layout.mla,
    ):
        raise InvalidInputError(
            "layer",
            f"num_kv_heads/head_dim/mla = {(layout.num_kv_heads, layout.head_dim, layout.mla)} "
            "like the layout",
            (layer.num_kv_heads, layer.head_dim, layer.mla),
        )
    gen = torch.Generator().manual_seed(seed)
    p = layout.page_size
    pages_per_seq = [0 if pad else -(-s // p) for s, pad in zip(spec.seq_lens, spec.padded)]
    num_pages = sum(pages_per_seq) + 1 + spare_pages
    assigned = assign_pages(pages_per_seq, num_pages, pages, gen)
    width = max([1, *(-(-s // p) for s in spec.seq_lens)])
    table = torch.zeros(spec.num_seqs, width, dtype=torch.int32)
    for b, row in enumerate(assigned):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    mask = _random_tree(spec.query_lens, gen) if tree else None
    meta = AttentionMetadata.from_seqlens(
        spec.query_lens,
        spec.seq_lens,
        table,
        p,
        device=device,
        tree_mask=mask,
        cross_attention=spec.cross,
    )
    if any(spec.padded):
        pad_tokens = torch.repeat_interleave(
            torch.tensor(spec.padded), torch.tensor(spec.query_lens)
        ).to(device)
        meta = dataclasses.replace(meta, slot_mapping=meta.slot_mapping.masked_fill(pad_tokens, -1))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    t, hq, hkv, d, dv = (
        spec.num_tokens,
        layer.num_heads,
        layer.num_kv_heads,
        layer.head_dim,
        layer.v_dim,
    )
    dtype = layout.dtype
    k_scale = v_scale = None
    if layout.is_quantized:
        n = hkv if per_head_scales else 1
        k_scale = (0.5 + torch.rand(n, generator=gen)).reshape(() if n == 1 else (n,))
        v_scale = (0.5 + torch.rand(n, generator=gen)).reshape(() if n == 1 else (n,))
    k_cache = quantize(randn(num_pages, p, hkv, d), layout.storage_dtype, k_scale)
    if layout.mla:  # one latent cache: V is its first kv_lora_rank dims, K's scale reads it
        cache, v_scale = layout.wrap(k_cache.to(device)), None
    else:
        v_cache = quantize(randn(num_pages, p, hkv, dv), layout.storage_dtype, v_scale)
        if layout.kv_order is KVOrder.HND:
            k_cache, v_cache = (
                k_cache.transpose(1, 2).contiguous(),
                v_cache.transpose(1, 2).contiguous(),
            )
        cache = layout.wrap(k_cache.to(device), v_cache.to(device))
    sinks = randn(hq).to(device) if layer.has_sinks else None
    q = randn(t, hq, d).to(device, dtype)
    k = randn(t, hkv, d).to(device, dtype)
    v = randn(t, hkv, dv).to(device, dtype)  # drawn for MLA too: the same stream as before
    return Batch(
        spec=spec,
        layer=layer,
        metadata=meta,
        cache=cache,
        q=q,
        k=k,
        v=None if layout.mla else v,
        sinks=sinks,
        k_scale=None if k_scale is None else k_scale.to(device),
        v_scale=None if v_scale is None else v_scale.to(device),
    )


def _random_tree(query_lens: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A (T, max query len) tree mask: per sequence, each token's parent is the previous token
    (a chain link) or, as often, any earlier token or the context (a branch)."""
    parents = []
    for n in query_lens:
        seq = []
        for i in range(n):
            draw = int(torch.randint(0, 2 * (i + 1), (1,), generator=gen))
            seq.append(i - 1 if draw > i else draw - 1)  # i - 1 half the time, else -1 .. i - 1
        parents.append(seq)
    return tree_mask_from_parents(parents)

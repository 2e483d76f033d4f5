"""Copying a case's KV cache and comparing it with the reference's, slot by slot."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnsdk.contract.kv import KVCache
from attnsdk.testing.conformance._cases import E4M3

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attnsdk.contract.metadata import AttentionMetadata


def as_packed(cache: KVCache) -> KVCache:
    """An HND cache as vLLM stores it: one [N, Hkv, P, D + Dv] tensor, K and V its halves."""
    d = cache.layout.head_dim
    both = torch.cat([cache.k, cache.v], dim=-1)
    return cache.layout.wrap(both[..., :d], both[..., d:])


def copy_cache(cache: KVCache) -> KVCache:
    """A copy that keeps the storage arrangement (a packed cache stays packed)."""
    if cache.layout.mla:  # one latent tensor: V is a view of it
        return cache.layout.wrap(cache.k.clone())
    same = cache.k.untyped_storage().data_ptr() == cache.v.untyped_storage().data_ptr()
    if same:
        return as_packed(cache)
    return KVCache(cache.layout, cache.k.clone(), cache.v.clone())


def _entries(x: torch.Tensor) -> torch.Tensor:
    """(N, P, Hkv, D) as (N, P, bytes) on the CPU, to compare bits per slot."""
    return x.contiguous().cpu().view(torch.uint8).reshape(x.shape[0], x.shape[1], -1)


def _fp8_step(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) of one step of ``dtype``: its smallest subnormal, 2 ** -mantissa bits."""
    return (2.0**-9, 2.0**-3) if dtype == E4M3 else (2.0**-16, 2.0**-2)


def _slots(meta: AttentionMetadata) -> Iterator[int]:
    yield from (s for s in meta.slot_mapping[: meta.num_tokens].tolist() if s >= 0)


def assert_same_cache(
    got: KVCache,
    want: KVCache,
    meta: AttentionMetadata,
    *,
    exact: bool,
    what: str = "step",
) -> None:
    """Every slot as ``want`` has it: bit-exact, or for fp8 slots the step writes, within one
    fp8 step (a kernel's division may round the other way). Names the first bad slot."""
    p = got.layout.page_size
    written = torch.zeros(got.num_pages * p, dtype=torch.bool)
    written[list(_slots(meta))] = True
    written = written.view(-1, p)
    for name, g, w in (("K", got.k_nhd, want.k_nhd), ("V", got.v_nhd, want.v_nhd)):
        bad = (_entries(g) != _entries(w)).any(dim=-1)
        if not exact:
            atol, rtol = _fp8_step(g.dtype)
            gf, wf = g.float().cpu(), w.float().cpu()
            near = ((gf - wf).abs() <= atol + rtol * wf.abs()).flatten(2).all(dim=-1)
            bad &= ~(written & near)
        if bool(bad.any()):
            page, offset = (int(i) for i in torch.nonzero(bad)[0])
            slot = page * p + offset
            role = "a slot it writes" if bool(written[page, offset]) else "a slot it must not touch"
            raise AssertionError(
                f"{name} cache after the {what} differs from the reference's at {int(bad.sum())} "
                f"slots; first: slot {slot} (page {page}, offset {offset}), {role}"
            )

"""Plumbing every GPU backend shares: finding kernel packages, and the sync-free KV store.

- ``module_present`` / ``first_present``: is a kernel package installed? Path lookups only, so
  asking never imports a kernel library (``find_spec`` on a dotted name would import the
  parent package).
- ``DeviceKVStore``: writes new K/V with one Triton launch (``_triton_store``), quantising when
  the cache stores fp8, and reports slots past the cache through a per-device ``SlotGuard``
  that ``poll()`` (called from every plan) reads back without a sync.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Iterable

    from attnsdk._kv import KVCache
    from attnsdk._metadata import AttentionMetadata
    from attnsdk.backends._triton_store import SlotGuard

__all__ = ["DeviceKVStore", "first_present", "module_present"]

_FP8_MAX = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),
}


def module_present(name: str) -> bool:
    """True when ``name`` (possibly dotted) can be imported; imports nothing."""
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)
    for part in rest.split(".") if rest else ():
        if spec is None or spec.submodule_search_locations is None:
            return False
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    return spec is not None


def first_present(names: Iterable[str]) -> str | None:
    """The first importable module of ``names``; None when none is. Imports nothing."""
    return next((n for n in names if module_present(n)), None)


class DeviceKVStore:
    """The KV store of GPU backends, with one ``SlotGuard`` per device."""

    def __init__(self) -> None:
        self._guards: dict[torch.device, SlotGuard] = {}

    def guard(self, device: torch.device) -> SlotGuard:
        guard = self._guards.get(device)
        if guard is None:
            from attnsdk.backends._triton_store import SlotGuard  # imports Triton

            guard = self._guards[device] = SlotGuard(device)
        return guard

    def poll(self, device: torch.device) -> None:
        """From every plan: raise, within ~32 steps and without a sync, a slot the store
        refused."""
        self.guard(device).poll()

    def check_now(self, device: torch.device) -> None:
        """Raise now, with a device sync, a slot the store refused (debug mode)."""
        self.guard(device).check_now()

    def __call__(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
        *,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> None:
        """Write rows ``0..num_tokens-1`` of k / v at ``meta.slot_mapping`` (negative: skip),
        quantising to the cache's fp8 dtype (dividing by the scales) when it has one."""
        from attnsdk.backends._triton_store import store_kv

        layout = cache.layout
        store_kv(
            k,
            v,
            cache.k_nhd,
            cache.v_nhd,
            meta.slot_mapping,
            meta.num_tokens,
            k_scale,
            v_scale,
            quantize=layout.is_quantized,
            fp8_max=_FP8_MAX.get(layout.storage_dtype, 0.0),
            bad_slot=self.guard(cache.device).flag,
        )

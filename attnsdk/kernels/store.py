"""The sync-free KV store every GPU backend shares, and the device flag it reports through.

- ``DeviceFlag``: a device-side error flag that kernels and device ops set and ``poll()`` (called
  from every plan) reads back without a sync.
- ``DeviceKVStore``: writes new K/V with one Triton launch (``kernels.triton_store``), quantising
  when the cache stores fp8, and reports slots past the cache through a per-device
  ``DeviceFlag``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnsdk.contract.errors import InvalidMetadataError

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = ["DeviceFlag", "DeviceKVStore"]

_FP8_MAX = {
    torch.float8_e4m3fn: float(torch.finfo(torch.float8_e4m3fn).max),
    torch.float8_e5m2: float(torch.finfo(torch.float8_e5m2).max),
}


class DeviceFlag:
    """A bad value found on the device (a slot past the cache, a page read twice), reported on
    the host without a device sync.

    ``flag`` is an int64 (1,) device tensor holding the largest bad value (-1: none); device
    code max-reduces into it. ``poll()`` runs from every ``plan``; one call in ``POLL_EVERY``
    starts a non-blocking copy of the flag to pinned host memory and records an event (~15 us
    of host time, which amortised costs ~1 us a step), and a later poll reads the copy once that
    event has completed and raises ``error(value, when)``. So a bad value is reported within
    about ``2 * POLL_EVERY`` steps of the step that carried it. ``check_now()`` syncs and
    reports at once (debug mode).
    """

    POLL_EVERY = 16

    def __init__(self, device: torch.device, error: Callable[[int, str], Exception]) -> None:
        self.flag = torch.full((1,), -1, dtype=torch.int64, device=device)
        self._error = error
        self._host = torch.full((1,), -1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._pending = False
        self._calls = 0

    def poll(self) -> None:
        # Inside CUDA-graph capture nothing may query or record events: nothing to do there.
        if self._event is None or torch.cuda.is_current_stream_capturing():
            return
        self._calls += 1
        if self._pending:
            if not self._event.query():
                return
            self._pending = False
            self._raise_if_bad(int(self._host[0]), "reported by a later step's plan")
        if self._calls >= self.POLL_EVERY:
            self._calls = 0
            self._host.copy_(self.flag, non_blocking=True)
            self._event.record()
            self._pending = True

    def check_now(self) -> None:
        self._raise_if_bad(int(self.flag[0]), "reported at once: debug mode")

    def _raise_if_bad(self, value: int, when: str) -> None:
        if value < 0:
            return
        self.flag.fill_(-1)
        raise self._error(value, when)


def _slot_past_the_cache(slot: int, when: str) -> Exception:
    return InvalidMetadataError(
        "slot_mapping",
        "slots < num_pages * page_size of the cache",
        f"slot {slot}",
        f"The KV store skipped it, nothing was written outside the cache ({when})",
    )


class DeviceKVStore:
    """The KV store of GPU backends, with one ``DeviceFlag`` for bad slots per device."""

    def __init__(self) -> None:
        self._guards: dict[torch.device, DeviceFlag] = {}

    def guard(self, device: torch.device) -> DeviceFlag:
        guard = self._guards.get(device)
        if guard is None:
            guard = self._guards[device] = DeviceFlag(device, _slot_past_the_cache)
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
        from attnsdk.kernels.triton_store import store_kv

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

"""Plumbing every GPU backend shares: finding kernel packages, and the sync-free KV store.

- ``module_present`` / ``first_present``: is a kernel package installed? Path lookups only, so
  asking never imports a kernel library (``find_spec`` on a dotted name would import the
  parent package).
- ``DeviceFlag``: a device-side error flag that kernels and device ops set and ``poll()`` (called
  from every plan) reads back without a sync.
- ``DeviceKVStore``: writes new K/V with one Triton launch (``_triton_store``), quantising when
  the cache stores fp8, and reports slots past the cache through a per-device ``DeviceFlag``.
- ``DeviceStoreBackend``: the ``BackendBase`` the GPU backends subclass: the Triton store on
  CUDA (``KVCache.store`` elsewhere), its flag polled from every plan and replay and checked at
  once by ``sync_check`` (debug mode).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
from typing import TYPE_CHECKING

import torch

from attnsdk._base import BackendBase
from attnsdk._capabilities import Reason, ReasonKind
from attnsdk._errors import InvalidMetadataError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from pydantic import BaseModel

    from attnsdk._backend import Plan
    from attnsdk._kv import KVCache, KVCacheLayout
    from attnsdk._layer import LayerSpec
    from attnsdk._metadata import AttentionMetadata

__all__ = [
    "DeviceFlag",
    "DeviceKVStore",
    "DeviceStoreBackend",
    "first_present",
    "mla_kernel_reasons",
    "module_present",
]

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


def mla_kernel_reasons(
    layer: LayerSpec | None,
    layout: KVCacheLayout | None,
    kernel: str,
    fp8_why: str,
    fp8_ok: frozenset[torch.dtype] = frozenset(),
) -> list[Reason]:
    """What the MLA kernels of the GPU backends (FA3's qv path, FlashInfer's MLA wrapper) take
    beyond their dims: no window, softcap, sinks or chunks (none of them has these), and a
    bf16 / fp16 latent cache, or one of the ``fp8_ok`` storage dtypes (``fp8_why`` says why
    not the others). ``kernel`` names the kernel."""
    cfg = ReasonKind.CONFIGURATION
    reasons = []
    if layer is not None:
        for name, wanted in (
            ("sliding_window", layer.sliding_window is not None),
            ("softcap", layer.has_softcap),
            ("has_sinks", layer.has_sinks),
            ("attention_chunk_size", layer.attention_chunk_size is not None),
        ):
            if wanted:
                reasons.append(Reason(cfg, name, f"is not served with mla=True ({kernel})"))
    if layout is not None and layout.is_quantized and layout.storage_dtype not in fp8_ok:
        reasons.append(
            Reason(
                cfg,
                "kv_dtype",
                f"must be the compute dtype for MLA, found {layout.storage_dtype}: {fp8_why}",
            )
        )
    return reasons


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


class DeviceStoreBackend(BackendBase):
    """A ``BackendBase`` whose new K/V go through ``DeviceKVStore`` on CUDA (no sync; slots past
    the cache are skipped and reported) and through ``KVCache.store`` on other devices."""

    __abstract__ = True

    def __init__(self, options: BaseModel | None = None) -> None:
        super().__init__(options)
        self._store = DeviceKVStore()

    def poll(self, device: torch.device) -> None:
        """Report, without a sync, what device code recorded in earlier steps; ``plan`` and
        ``plan_for_replay`` call it. A backend with device flags of its own extends it."""
        if device.type == "cuda":
            self._store.poll(device)

    def sync_check(self, device: torch.device) -> None:
        """Raise now, with a device sync, what the KV store recorded (debug mode calls it)."""
        if device.type == "cuda":
            self._store.check_now(device)

    def plan(self, meta: AttentionMetadata) -> Plan:
        self.poll(meta.device)
        return super().plan(meta)

    def plan_for_replay(self, plan: Plan, meta: AttentionMetadata) -> None:
        super().plan_for_replay(plan, meta)
        self.poll(meta.device)

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        plan: Plan,
        state: object,
        *,
        k_scale: torch.Tensor | None,
        v_scale: torch.Tensor | None,
    ) -> None:
        if cache.device.type == "cuda":
            self._store(k, v, cache, plan.metadata, k_scale=k_scale, v_scale=v_scale)
        else:
            super().store(k, v, cache, plan, state, k_scale=k_scale, v_scale=v_scale)

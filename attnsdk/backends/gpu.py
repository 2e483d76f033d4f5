"""What the GPU backends share on top of ``BackendBase``.

- ``DeviceStoreBackend``: the ``BackendBase`` the GPU backends subclass: the Triton store on
  CUDA (``kernels.store.DeviceKVStore``; ``KVCache.store`` elsewhere), its flag polled from
  every plan and replay and checked at once by ``sync_check`` (debug mode).
- ``mla_kernel_reasons``: what the GPU MLA kernels refuse beyond their dims.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnsdk.backends.base import BackendBase
from attnsdk.contract.errors import Reason, ReasonKind
from attnsdk.kernels.store import DeviceKVStore

if TYPE_CHECKING:
    import torch
    from pydantic import BaseModel

    from attnsdk.contract.kv import KVCache, KVCacheLayout
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import Plan

__all__ = ["DeviceStoreBackend", "mla_kernel_reasons"]


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

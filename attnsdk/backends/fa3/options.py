"""``FA3Options``: the ``fa3`` backend's options (a config's ``options`` for ``backend="fa3"``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FA3Options"]


class FA3Options(BaseModel):
    """Options of the ``fa3`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Literal["auto", "flash_attn_interface", "sgl_kernel", "vllm"] = "auto"
    """Kernel package; "auto" takes the first installed in that order."""
    num_splits: int = Field(default=0, ge=0, le=256)
    """Split-KV chunks; 0 lets FA3's heuristic (and its dynamic per-sequence split) decide."""
    pack_gqa: bool | None = None
    """Pack a KV head's query heads into one tile; None lets FA3 decide."""
    precompute_scheduler: bool | None = None
    """Compute FA3's ``scheduler_metadata`` once per step and layer shape (at the first layer)
    instead of inside every layer's call. None (default): on whenever the provider exposes FA3's
    scheduler op (flash_attn_interface does), else off; True insists (an error without the op);
    False turns it off. Measured on an H200 (docs/benchmarks.md) it saves
    ~10 µs of host time per eager layer and ~16% of GPU time per layer at batch 1 under graph
    replay, and is neutral at batch 64-256; the per-step cost is one small launch."""

"""``FlexOptions``: the ``flex`` backend's options, and where they make flex compile."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

__all__ = ["FlexOptions", "compiles"]


class FlexOptions(BaseModel):
    """Options of the ``flex`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    compile: bool | None = None
    """``torch.compile`` flex per shape bucket. None (default): on CUDA, off on CPU (a CPU
    compile takes seconds per bucket; see docs/backends.md). False runs the unfused eager flex,
    which materialises scores over the whole page pool (tests and debugging)."""


def compiles(options: FlexOptions, device: torch.device) -> bool:
    """Whether flex runs compiled on ``device`` with ``options`` (None: on CUDA only)."""
    return device.type == "cuda" if options.compile is None else options.compile

"""``FlashInferOptions``: the ``flashinfer`` backend's options (docs/backends.md lists them)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["FlashInferOptions"]


class FlashInferOptions(BaseModel):
    """Options of the ``flashinfer`` backend."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    decode: Literal["tensor_cores", "cuda_cores"] = "tensor_cores"
    """Kernel of decode steps. Tensor cores read 98% of the H200's copy bandwidth at batch 64 x
    4k, CUDA cores 66% (docs/backends.md); sink layers always use tensor cores."""
    prefill_backend: Literal["fa2", "auto"] = "fa2"
    """FlashInfer backend of the prefill wrapper. "auto" lets FlashInfer pick FA3 on Hopper for
    long queries (its sm90 module takes minutes to compile); fp8-KV and sink layers stay on fa2,
    whose kernels take a bf16 / fp16 query with an fp8 cache."""
    mla_backend: Literal["auto", "fa3", "fa2"] = "auto"
    """FlashInfer backend of the MLA wrapper (``LayerSpec.mla`` layers): "auto" takes its fa3
    variant on Hopper and fa2 elsewhere (each JIT-compiled on first use), "fa3" insists on
    Hopper's, "fa2" runs on any GPU of sm 8.0 or newer."""
    workspace_mib: int = Field(default=128, ge=16, le=4096)
    """Float workspace (split-KV partial results) per device, shared by every wrapper."""

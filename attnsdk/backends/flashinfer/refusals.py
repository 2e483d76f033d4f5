"""What the ``flashinfer`` backend refuses beyond its declared capabilities: what FlashInfer's
kernels cannot express (paged and ragged), and the kernel variants an option selects. Pure
functions of the request, so ``FlashInferBackend.refusals`` answers before a backend exists."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnsdk.backends.gpu import mla_kernel_reasons
from attnsdk.contract.capabilities import is_mla
from attnsdk.contract.device import compute_capability
from attnsdk.contract.errors import Reason, ReasonKind
from attnsdk.features.chunked import chunk_reasons

if TYPE_CHECKING:
    from attnsdk.backends.flashinfer.options import FlashInferOptions
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec

__all__ = ["HEAD_DIMS", "option_reasons", "paged_reasons", "ragged_reasons"]

_CFG = ReasonKind.CONFIGURATION
_CUDA_CORE_GROUPS = frozenset({1, 2, 3, 4, 6, 8, 16})
"""Query heads per KV head that FlashInfer's CUDA-core decode kernel is compiled for."""
HEAD_DIMS = frozenset({64, 128, 256})
"""Head dims FlashInfer's kernels dispatch, its split-KV merge included."""


def paged_reasons(layer: LayerSpec | None, layout: KVCacheLayout | None) -> list[Reason]:
    """What FlashInfer's kernels cannot express, and chunk sizes that are not a multiple of
    the page size."""
    reasons = chunk_reasons(layer, layout)
    dims = {}
    if layer is not None:
        dims = {"head_dim": layer.head_dim, "v_head_dim": layer.v_dim}
    if layout is not None:
        dims = {"head_dim": layout.head_dim, "v_head_dim": layout.v_dim}
    if is_mla(layer, layout):
        return (
            reasons
            + mla_kernel_reasons(
                layer,
                layout,
                "FlashInfer's MLA wrapper",
                "FlashInfer's MLA wrapper reads an e4m3 latent only",
                fp8_ok=frozenset({torch.float8_e4m3fn}),
            )
            + _fp8_mla_reasons(layout)
        )  # its dims: ``mla_dims``
    for name, d in dims.items():
        if d not in HEAD_DIMS:
            # Measured on an H200: head_dim 80 compiles, then its split-KV merge kernel
            # raises "Unsupported head_dim" and leaves the CUDA context unusable.
            reasons.append(
                Reason(
                    _CFG,
                    name,
                    f"must be one of {sorted(HEAD_DIMS)} (FlashInfer's merge kernels), found {d}",
                )
            )
    if layer is None:
        return reasons
    if not layer.causal and layer.sliding_window is not None:
        reasons.append(
            Reason(
                _CFG,
                "sliding_window",
                "must be None when causal=False: FlashInfer's fa2 kernels have a left "
                "window only (window_left), not the symmetric non-causal window",
            )
        )
    if layer.has_sinks and layer.has_softcap:
        reasons.append(
            Reason(
                _CFG,
                "softcap",
                "must be None with has_sinks=True: FlashInfer's attention-sink variant "
                "applies no logits soft cap",
            )
        )
    return reasons


def option_reasons(
    options: FlashInferOptions,
    layer: LayerSpec | None,
    layout: KVCacheLayout | None,
    device: torch.device,
) -> list[Reason]:
    """What the CUDA-core decode kernel (``decode="cuda_cores"``) is not compiled for."""
    cuda_cores = (
        layer is not None
        and options.decode == "cuda_cores"
        and not layer.has_sinks
        and layer.head_dim == layer.v_dim  # else the prefill wrapper decodes it
    )
    if device.type == "cuda" and is_mla(layer, layout):
        cc = compute_capability(device)
        if cc is not None and cc[0] != 9:
            if options.mla_backend == "fa3":
                return [
                    Reason(
                        _CFG,
                        "mla_backend",
                        f"'fa3' needs a Hopper GPU (sm 9.x), found sm {cc[0]}.{cc[1]}: use "
                        "'auto' or 'fa2'",
                    )
                ]
            if layout is not None and layout.is_quantized:
                return [
                    Reason(
                        _CFG,
                        "kv_dtype",
                        f"an fp8 latent needs a Hopper GPU (sm 9.x) in FlashInfer's MLA "
                        f"wrapper, found sm {cc[0]}.{cc[1]}",
                    )
                ]
    if not cuda_cores or layer is None or layer.group_size in _CUDA_CORE_GROUPS:
        return []
    return [
        Reason(
            _CFG,
            "num_heads",
            f"num_heads / num_kv_heads must be one of {sorted(_CUDA_CORE_GROUPS)} with "
            f"decode='cuda_cores'; use decode='tensor_cores', found {layer.group_size}",
        )
    ]


def ragged_reasons(layer: LayerSpec) -> list[Reason]:
    """What FlashInfer's ragged prefill cannot express: head dims
    outside its kernels (q / k also 192: DeepSeek's expanded prefill), sinks (its sink
    wrappers are paged) and chunked layers (a virtual batch needs a page table)."""
    reasons = []
    for name, d, dims in (
        ("head_dim", layer.head_dim, HEAD_DIMS | {192}),
        ("v_head_dim", layer.v_dim, HEAD_DIMS),
    ):
        if d not in dims:
            reasons.append(
                Reason(_CFG, name, f"must be one of {sorted(dims)} in a ragged step, found {d}")
            )
    if not layer.causal and layer.sliding_window is not None:
        reasons.append(Reason(_CFG, "sliding_window", "must be None when causal=False"))
    for name, asked in (
        ("has_sinks", layer.has_sinks),
        ("attention_chunk_size", layer.attention_chunk_size is not None),
    ):
        if asked:
            reasons.append(Reason(_CFG, name, "is served in paged steps only"))
    return sorted(set(reasons))


def _fp8_mla_reasons(layout: KVCacheLayout | None) -> list[Reason]:
    """FlashInfer's MLA wrapper reads an e4m3 latent with bf16 queries only."""
    if layout is None or not layout.is_quantized or layout.dtype == torch.bfloat16:
        return []
    return [
        Reason(
            _CFG,
            "dtype",
            f"must be torch.bfloat16 over an fp8 latent (FlashInfer's MLA wrapper), found "
            f"{layout.dtype}",
        )
    ]

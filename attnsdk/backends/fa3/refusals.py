"""What the ``fa3`` backend refuses beyond its declared capabilities: what FA3 (or the installed
build of it, read from ``flash_attn_config``) cannot compute, and what the kernel provider's
call cannot pass. Pure functions of the request, the build flags and the loaded provider, so
``FA3Backend.refusals`` gives the same answer before and after a backend is created."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from attnsdk.backends.fa3.kernels import INSTALL_COMMAND
from attnsdk.backends.gpu import mla_kernel_reasons
from attnsdk.contract.capabilities import Feature, is_mla
from attnsdk.contract.errors import Reason, ReasonKind
from attnsdk.features.chunked import chunk_reasons

if TYPE_CHECKING:
    from attnsdk.backends.fa3.kernels import KernelCall
    from attnsdk.contract.capabilities import Request
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec

__all__ = ["build_reasons", "provider_reasons", "ragged_layer"]

_CFG = ReasonKind.CONFIGURATION


def ragged_layer(layer: LayerSpec, flags: dict[str, bool]) -> LayerSpec:
    """The layer FA3 runs for a ragged call: ``layer``, or, when this build lacks the kernels
    for its narrower V (DeepSeek's 192 / 128 needs HDIMDIFF192), the same layer with V padded
    to ``head_dim``. Zero columns of V add zero columns to the output and change nothing else,
    so the kernel for equal dims serves it exactly (vLLM pads the same way)."""
    if layer.v_dim >= layer.head_dim:
        return layer
    missing = any(r.field == "v_head_dim" for r in _build_reasons(layer, None, flags))
    return dataclasses.replace(layer, v_head_dim=layer.head_dim) if missing else layer


def _build_reasons(
    layer: LayerSpec | None, layout: KVCacheLayout | None, flags: dict[str, bool]
) -> list[Reason]:
    """What FA3 (or this build of it) refuses beyond the generic capabilities."""
    if is_mla(layer, layout):
        return _fa3_mla_reasons(layer, layout, flags)
    reasons: list[Reason] = []
    d = dv = None
    if layer is not None:
        d, dv = layer.head_dim, layer.v_dim
    if layout is not None:
        d, dv = layout.head_dim, layout.v_dim
        if layout.is_quantized and layout.dtype != torch.bfloat16:
            reasons.append(
                Reason(
                    _CFG,
                    "dtype",
                    f"must be torch.bfloat16 with an fp8 KV cache (FA3 returns bf16 for fp8 "
                    f"inputs), found {layout.dtype}",
                )
            )
        if layout.is_quantized and (layout.head_dim % 16 or layout.v_dim % 16):
            reasons.append(
                Reason(
                    _CFG,
                    "head_dim",
                    f"must be a multiple of 16 with fp8 KV, found {layout.head_dim}/{layout.v_dim}",
                )
            )
        if layout.dtype == torch.float16 and flags.get("FLASHATTENTION_DISABLE_FP16"):
            reasons.append(Reason(_CFG, "dtype", "float16 is not compiled into this FA3 build"))
        if layout.is_quantized and flags.get("FLASHATTENTION_DISABLE_FP8"):
            reasons.append(Reason(_CFG, "kv_dtype", "fp8 is not compiled into this FA3 build"))
    if d is not None and dv is not None and d != dv:
        diff192 = 128 < d <= 192 and 96 < dv <= 128
        diff64 = d <= 64 and dv <= 512
        built = (diff192 and not flags.get("FLASH_ATTENTION_DISABLE_HDIMDIFF192")) or (
            diff64 and not flags.get("FLASH_ATTENTION_DISABLE_HDIMDIFF64")
        )
        if not built:
            reasons.append(
                Reason(
                    _CFG,
                    "v_head_dim",
                    f"must equal head_dim={d}, or be in (96, 128] with head_dim in (128, 192] "
                    f"(when compiled in), found {dv}",
                )
            )
    if d is not None:
        built_dims = [
            h for h in (64, 96, 128, 192, 256) if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{h}")
        ]
        if built_dims and max(d, dv or d) > max(built_dims):
            reasons.append(
                Reason(
                    _CFG,
                    "head_dim",
                    f"must be <= {max(built_dims)} in this FA3 build, found {max(d, dv or d)}",
                )
            )
    if layer is not None:
        if layer.has_softcap and flags.get("FLASHATTENTION_DISABLE_SOFTCAP"):
            reasons.append(
                Reason(_CFG, "softcap", "is not compiled into this FA3 build (DISABLE_SOFTCAP)")
            )
        if layer.sliding_window is not None and flags.get("FLASHATTENTION_DISABLE_LOCAL"):
            reasons.append(
                Reason(
                    _CFG, "sliding_window", "is not compiled into this FA3 build (DISABLE_LOCAL)"
                )
            )
    return reasons


def _fa3_mla_reasons(
    layer: LayerSpec | None, layout: KVCacheLayout | None, flags: dict[str, bool]
) -> list[Reason]:
    """An MLA layer (its dims: ``Capabilities.mla_dims``): the qv kernels in this build, and
    what every GPU MLA kernel refuses (``mla_kernel_reasons``)."""
    reasons = []
    if flags.get("FLASH_ATTENTION_DISABLE_HDIMDIFF64"):
        reasons.append(
            Reason(
                _CFG,
                "mla",
                "needs FA3's hdim 64 x 512 (qv) kernels, which this build leaves out "
                "(FLASH_ATTENTION_DISABLE_HDIMDIFF64 in flash_attn_config); sgl-kernel's and "
                "vLLM's FA3 builds have them, or use the flashinfer backend",
            )
        )
    if (
        layout is not None
        and layout.dtype == torch.float16
        and flags.get("FLASHATTENTION_DISABLE_FP16")
    ):
        reasons.append(Reason(_CFG, "dtype", "float16 is not compiled into this FA3 build"))
    fp8 = "SGLang's FA3 path upcasts an fp8 latent without a scale (not served yet)"
    return reasons + mla_kernel_reasons(layer, layout, "FA3's qv path", fp8)


def build_reasons(request: Request, flags: dict[str, bool]) -> list[Reason]:
    """What this FA3 build refuses for ``request``: its head dims, dtypes and switches, in a
    ragged call for the layer it actually runs (``ragged_layer``), in a paged one for the layer
    over its layout (and chunk sizes that are not a multiple of the page size: chunks run as
    virtual sequences, which must start on a page)."""
    layer = request.layer
    if Feature.RAGGED not in request.uses:
        return _build_reasons(layer, request.layout, flags) + chunk_reasons(layer, request.layout)
    reasons = _build_reasons(None if layer is None else ragged_layer(layer, flags), None, flags)
    if layer is not None and layer.attention_chunk_size is not None:
        reasons.append(
            Reason(
                _CFG,
                "attention_chunk_size",
                "is served in paged steps only (a virtual batch over the page table)",
            )
        )
    return reasons


def provider_reasons(request: Request, kernel: KernelCall) -> list[Reason]:
    """What the provider's call cannot pass for ``request``: MLA's ``qv``, the log-sum-exp
    (``lse=``, and a tree step's two passes, which are merged by theirs), dense K/V."""
    who = f"{kernel.provider}'s flash_attn_with_kvcache"
    fix = f"use flash_attn_interface ({INSTALL_COMMAND})"
    reasons = []
    if request.mla and not kernel.takes_qv:
        reasons.append(Reason(_CFG, "mla", f"needs FA3's qv argument, which {who} lacks: {fix}"))
    if not kernel.returns_lse:
        if Feature.LSE in request.uses:
            reasons.append(
                Reason(_CFG, "lse", f"needs return_softmax_lse, which {who} lacks: {fix}")
            )
        if Feature.TREE_MASK in request.uses:
            reasons.append(
                Reason(
                    _CFG,
                    "tree_mask",
                    "its two passes are merged by their log-sum-exps, which "
                    f"{who} does not return: {fix}",
                )
            )
    if Feature.RAGGED in request.uses and not kernel.takes_ragged:
        reasons.append(
            Reason(
                _CFG,
                "ragged",
                f"needs the registered op flash_attn_3::fwd, which {kernel.provider} does not "
                f"expose: {fix}",
            )
        )
    return reasons

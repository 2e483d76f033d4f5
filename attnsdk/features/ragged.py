"""Ragged attention: keys and values that come with the call, not from a cache.

An MLA model (DeepSeek V2/V3, Kimi K2) keeps a compressed latent in its cache and decodes
against it (``LayerSpec.for_mla``), but prefills the expanded way: it up-projects the new
tokens' latents into per-head K (qk_nope + rope = 192 dims) and V (128 dims) and attends over
those directly, causally; a prefix already in the cache is expanded chunk by chunk and attended
without a mask, each part returning its log-sum-exp for ``attnsdk.merge_states``. Neither pass
reads or writes the cache: that is ``Backend.forward_ragged`` (FA's ``flash_attn_varlen_func``,
FlashInfer's ragged prefill).

Semantics (docs/kv_layout.md, "Ragged attention"): sequence b has its query rows at
``query_start_loc[b]:query_start_loc[b+1]`` and its ``seq_lens[b]`` keys at rows
``key_start_loc[b]:key_start_loc[b+1]`` of k and v, key i at position i; its queries sit at the
last ``query_len`` positions, so the layer's rules (bottom-right causal, window, chunks,
softcap, sinks) read exactly as in a paged step. With ``cross_attention`` every query row sees
all of its sequence's keys (a prefix chunk: a non-causal layer, and a chunk may be shorter
than the queries). Parts merged by ``merge_states`` each count the sinks they are given: give
them to one part only. ``AttentionMetadata.for_ragged`` builds such a step. Tree masks, MLA layers
(their latent lives in a cache) and CUDA-graph plans are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.backend import check_no_grad, check_plan, check_tensor
from attnsdk.contract.capabilities import Feature
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind
from attnsdk.contract.layer import LayerSpec

if TYPE_CHECKING:
    from attnsdk.contract.capabilities import Request
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import Plan

__all__ = [
    "RaggedStep",
    "check_ragged_args",
    "clear_keyless_rows",
    "key_starts",
    "ragged_step",
    "refusals",
]

_CFG = ReasonKind.CONFIGURATION
_Q = {"dtype_of": "q's", "device_of": "q's"}


def refusals(request: Request) -> list[Reason]:
    """Why ``request``'s layer cannot run ragged (``Feature.RAGGED`` in ``request.uses``):
    an MLA layer reads its latent from a cache. (Whether the backend has ragged attention at
    all, and the dims it takes, are ``capability_reasons``'.)"""
    layer = request.layer
    if Feature.RAGGED not in request.uses or layer is None:
        return []
    reasons = []
    if layer.mla:
        reasons.append(
            Reason(
                _CFG,
                "mla",
                "an MLA layer reads its latent from a cache; its expanded prefill is a plain "
                "LayerSpec (head_dim = qk_nope + rope dims, v_head_dim = the value dims)",
            )
        )
    return sorted(set(reasons))


def check_ragged_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Plan,
    layer: LayerSpec,
    *,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    lse: torch.Tensor | None,
    keys: int | None = None,
) -> None:
    """Host-only checks of ``forward_ragged``'s arguments (shape, dtype, device); no sync.

    q (T, Hq, D), k (Tk, Hkv, D) and v (Tk, Hkv, Dv) share a dtype and a device, with
    Tk >= sum(seq_lens) (``keys`` when the caller has it: ``RaggedStep.keys``); ``out``
    (T, Hq, Dv), ``lse`` (T, Hq) fp32 contiguous, ``sinks`` (Hq,) fp32 when ``layer.has_sinks``.
    """
    check_plan(plan)
    check_no_grad(q=q, k=k, v=v, sinks=sinks)
    if not isinstance(layer, LayerSpec):
        raise InvalidInputError("layer", "a LayerSpec", type(layer).__name__)
    meta = plan.metadata
    if meta.tree_mask is not None:
        raise InvalidInputError(
            "plan.metadata.tree_mask", "None in a ragged step (trees verify over a cache)", "a mask"
        )
    if plan.graph is not None:
        raise InvalidInputError(
            "plan",
            "an eager plan (backend.plan(metadata)): ragged steps are not captured",
            "a CUDA-graph plan",
        )
    hq, hkv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim
    if not isinstance(q, torch.Tensor):
        raise InvalidInputError("q", "a torch.Tensor", type(q).__name__)
    dtype, device = q.dtype, q.device
    check_tensor("q", q, (None, hq, d), dtype, device, **_Q)
    rows = q.shape[0]
    if rows < meta.num_tokens:
        raise InvalidInputError("q.shape[0]", f">= num_tokens={meta.num_tokens}", rows)
    check_tensor("k", k, (None, hkv, d), dtype, device, **_Q)
    if keys is None:
        keys = int(meta.seq_lens_cpu.sum())
    if k.shape[0] < keys:
        raise InvalidInputError("k.shape[0]", f">= sum(seq_lens)={keys}", k.shape[0])
    check_tensor("v", v, (k.shape[0], hkv, dv), dtype, device, **_Q)
    if out is not None:
        check_tensor("out", out, (rows, hq, dv), dtype, device, **_Q)
    if lse is not None:
        check_tensor("lse", lse, (rows, hq), torch.float32, device, device_of="q's")
        if not lse.is_contiguous():
            raise InvalidInputError("lse.stride()", f"contiguous strides ({hq}, 1)", lse.stride())
    if layer.has_sinks:
        if sinks is None:
            raise InvalidInputError(
                "sinks", f"an fp32 tensor of shape ({hq},) (layer.has_sinks)", None
            )
        check_tensor("sinks", sinks, (hq,), torch.float32, device, device_of="q's")
    elif sinks is not None:
        raise InvalidInputError("sinks", "None (layer.has_sinks is False)", tuple(sinks.shape))
    if meta.device != device:
        raise InvalidInputError("plan.metadata.device", f"q's device {device}", meta.device)


def key_starts(meta: AttentionMetadata) -> torch.Tensor:
    """(B + 1,) int32 on the device: where each sequence's keys start in a ragged call's k / v.

    ``meta.key_start_loc`` when set; ``query_start_loc`` when every sequence has as many keys
    as queries (a prefill of new tokens only); else one prefix sum on the device (no sync).
    """
    if meta.key_start_loc is not None:
        return meta.key_start_loc
    if torch.equal(meta.seq_lens_cpu, meta.query_lens_cpu):
        return meta.query_start_loc
    starts = torch.zeros(meta.num_seqs + 1, dtype=torch.int32, device=meta.device)
    torch.cumsum(meta.seq_lens, 0, out=starts[1:])
    return starts


@dataclass(frozen=True, slots=True)
class RaggedStep:
    """What every layer's ``forward_ragged`` with one plan shares, read once from the host
    twins (``ragged_step``): the per-call host work stays off the kernels' critical path."""

    keys: int
    """sum(seq_lens): the key rows k and v must hold."""
    key_start_loc: torch.Tensor
    """(B + 1,) int32 on the device: ``key_starts(meta)``."""
    keyless: tuple[tuple[int, int], ...]
    """Query row ranges of sequences with queries and no keys (an empty prefix chunk)."""


def ragged_step(meta: AttentionMetadata) -> RaggedStep:
    """``RaggedStep`` of a ragged step's metadata; no device sync."""
    qsl = meta.query_start_loc_cpu
    keyless = (meta.seq_lens_cpu == 0) & (qsl[1:] > qsl[:-1])
    rows = tuple((int(qsl[b]), int(qsl[b + 1])) for b in torch.nonzero(keyless).flatten().tolist())
    return RaggedStep(int(meta.seq_lens_cpu.sum()), key_starts(meta), rows)


def clear_keyless_rows(
    keyless: tuple[tuple[int, int], ...],
    sinks: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Rows of sequences with queries and no keys (``RaggedStep.keyless``): zeros, and the
    sink's logit (or -inf) as their log-sum-exp, whatever a kernel wrote there. A loop only
    over such sequences; nothing at all in a step without them."""
    for q0, q1 in keyless:
        out[q0:q1] = 0
        if lse is not None:
            lse[q0:q1] = float("-inf") if sinks is None else sinks.float()

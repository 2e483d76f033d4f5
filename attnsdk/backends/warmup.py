"""One small real step per layer shape, so that lazily compiled kernels exist before serving."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from attnsdk.contract.capabilities import default_device
from attnsdk.contract.checks import check_int, check_usable_device
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.capabilities import Capabilities
    from attnsdk.contract.kv import KVCacheLayout
    from attnsdk.contract.layer import LayerSpec

__all__ = ["check_warmup_args", "warm_up"]


def check_warmup_args(
    capabilities: Capabilities, device: object, num_pages: object
) -> tuple[torch.device, int]:
    """``warmup``'s arguments, checked before anything runs: a device this machine has (None:
    the backend's default device) and ``num_pages`` an int >= 1."""
    dev = default_device(capabilities) if device is None else check_usable_device("device", device)
    return dev, check_int("num_pages", num_pages)


def warm_up(
    backend: Backend,
    layer: LayerSpec,
    layout: KVCacheLayout,
    device: torch.device,
    num_pages: int,
) -> None:
    """Run a decode row and a prefill row of ``layer`` through ``backend`` on scratch memory.

    Two steps: the first writes a prompt, the second decodes after it and extends a second
    sequence, so both the pure-prefill and the mixed kernel variants are built. Page 0 stays
    reserved, as in every engine. The scratch cache has ``num_pages`` pages, or the fewest the
    two steps need when that is more: 1 + 2 * ceil(2 / page_size), so that each sequence holds
    at least two tokens (a prompt and the token decoded after it) at any page size.
    ``check_warmup_args`` has checked ``device`` and ``num_pages``.
    """
    p = layout.page_size
    pages_per_seq = max(-(-2 // p), (num_pages - 1) // 2)
    cache = layout.allocate(max(num_pages, 1 + 2 * pages_per_seq), device=device)
    span = pages_per_seq * p
    table = [
        list(range(1, 1 + pages_per_seq)),
        list(range(1 + pages_per_seq, 1 + 2 * pages_per_seq)),
    ]
    prompt = max(1, min(span - 1, 2 * p))
    steps = (
        ([prompt, prompt], [prompt, prompt]),  # two prefills
        ([1, min(2, span - prompt)], [prompt + 1, prompt + min(2, span - prompt)]),  # mixed
    )
    gen = torch.Generator(device="cpu").manual_seed(0)
    for query_lens, seq_lens in steps:
        meta = AttentionMetadata.from_seqlens(
            query_lens, seq_lens, page_table=table, page_size=p, device=device
        )
        t = meta.num_tokens

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=layout.dtype)

        q = rand(t, layer.num_heads, layer.head_dim)
        k = rand(t, layer.num_kv_heads, layer.head_dim)
        # An MLA layer's V is the latent part of k (and k_scale reads it).
        v = None if layout.mla else rand(t, layer.num_kv_heads, layer.v_dim)
        sinks = torch.zeros(layer.num_heads, device=device) if layer.has_sinks else None
        scale = torch.ones((), device=device) if layout.is_quantized else None
        v_scale = None if layout.mla else scale
        plan = backend.plan(meta)
        backend.forward(q, k, v, cache, plan, layer, sinks=sinks, k_scale=scale, v_scale=v_scale)
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""The ``flex`` backend's attention function: one step of one layer kind through
``torch.nn.attention.flex_attention``, over the block mask of ``mask``.

- **Semantics**: bottom-right causal, HF sliding window (non-causal: symmetric), chunked local
  attention (in ``mask_mod``; the block mask leaves out pages outside a query block's chunks),
  GQA through ``enable_gqa``, softcap in ``score_mod``, sinks from the log-sum-exp flex returns:
  ``out * sigmoid(lse - sink)`` (= out * e^lse / (e^lse + e^sink); a row that sees no key has
  lse = -inf and stays 0, like the reference). ``lse=`` is that log-sum-exp (natural log: the
  public flex API converts its kernels' base-2 statistics), plus the sink term
  ``logaddexp(lse, sink)`` on sink layers. flex is always asked for its log-sum-exp where it
  can return one (everywhere but compiled CPU): one compiled function per layer kind, and an
  output that is bit for bit the same with and without ``lse=`` (the conformance suite checks
  it); writing (Bb, Hq, Lb) fp32 values costs next to nothing beside the output.
- **Uncompiled** (``FlexOptions(compile=False)``): torch's unfused implementation, whose "called
  without torch.compile" warning is the documented consequence of that choice and is filtered
  for that call only.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.backends.flex.mask import Q_BLOCK

if TYPE_CHECKING:
    from collections.abc import Callable

    from attnsdk.backends.flex.mask import LayerKind

__all__ = ["Result", "attention_function"]

_UNCOMPILED = "flex_attention called without torch.compile"
Result = tuple[torch.Tensor, torch.Tensor | None]
"""What a step's flex function returns: the output and, when asked for, the log-sum-exp."""


def attention_function(
    st: LayerKind, compiled: bool, cuda: bool, with_lse: bool
) -> Callable[..., Result]:
    """flex over one step for one layer kind; returns the output (Bb, Hq, Lb, Dv) and, when
    ``with_lse``, the fp32 log-sum-exp (Bb, Hq, Lb) with the sink term (else None)."""
    from torch.nn.attention import flex_attention as fa

    p, wl, causal, cap, chunk = st.page_size, st.window_left, st.causal, st.softcap, st.chunk
    aux = getattr(fa, "AuxRequest", None)
    kernel_options: dict[str, Any] | None = None
    # The main kernel instead of flex's split-KV decoding kernel (CUDA).
    main_kernel: dict[str, Any] | None = None
    if cuda:
        # Each KV block is one page: the kernel's KV tile must divide it (measured on an H200:
        # the default 64/128-wide tile fails to lower for 16-token pages).
        kernel_options = {"BLOCK_N": min(st.page_size, 64)}
        main_kernel = {**kernel_options, "FORCE_USE_FLEX_ATTENTION": True}
        # The decoding kernel packs a KV head's query heads only for power-of-two groups.
        if not st.gqa_pow2:
            kernel_options = main_kernel

    def run(
        qp: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        kv_num_blocks: torch.Tensor,
        kv_indices: torch.Tensor,
        page_pos: torch.Tensor,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        q_start: torch.Tensor,
        tree: torch.Tensor | None,
        sinks: torch.Tensor | None,
    ) -> Result:
        wpt = page_table.shape[1]

        def mask_mod(b: Any, h: Any, qi: Any, ki: Any) -> Any:
            page = ki // p
            logical = page_pos[page]
            own = page_table[b, logical.clamp(0, wpt - 1)] == page
            kpos = logical * p + ki % p
            qpos = q_start[b] + qi
            ok = own & (kpos < seq_lens[b])
            if causal:
                ok = ok & (kpos <= qpos)
            if tree is not None:
                # New token j = kpos - q_start is visible when it is an ancestor (or qi itself);
                # causality above already keeps j <= qi.
                j = kpos - q_start[b]
                ok = ok & ((j < 0) | tree[b, qi, j.clamp(0, tree.shape[-1] - 1)])
            if wl >= 0:
                ok = ok & (kpos >= qpos - wl)
                if not causal:
                    ok = ok & (kpos <= qpos + wl)
            if chunk:
                ok = ok & (kpos // chunk == qpos // chunk)
            return ok

        def softcap(score: Any, b: Any, h: Any, qi: Any, ki: Any) -> Any:
            return torch.tanh(score / cap) * cap

        lq = qp.shape[2]
        options = kernel_options
        if main_kernel is not None and lq * (qp.shape[1] // k_pool.shape[1]) > Q_BLOCK:
            # The decoding kernel tiles a KV head's query rows times its query heads as one
            # block that must divide the 128-row query block (no valid config otherwise:
            # measured, 32 rows x 8 heads per KV head on an H200, torch 2.11).
            options = main_kernel
        block_mask = fa.BlockMask.from_kv_blocks(
            kv_num_blocks,
            kv_indices,
            BLOCK_SIZE=(Q_BLOCK, p),
            mask_mod=mask_mod,
            seq_lengths=(lq, k_pool.shape[2]),
            compute_q_blocks=False,
        )
        kwargs: dict[str, Any] = {
            "score_mod": softcap if cap > 0 else None,
            "block_mask": block_mask,
            "scale": st.scale,
            "enable_gqa": True,
            "kernel_options": options,
        }
        if sinks is None and not with_lse:
            return fa.flex_attention(qp, k_pool, v_pool, **kwargs), None
        if aux is not None:
            out, extra = fa.flex_attention(qp, k_pool, v_pool, return_aux=aux(lse=True), **kwargs)
            lse = extra.lse.float()
        else:  # torch < 2.9
            out, lse = fa.flex_attention(qp, k_pool, v_pool, return_lse=True, **kwargs)
            lse = lse.float()
        if sinks is not None:
            sink = sinks.float().view(1, -1, 1)
            out = (out.float() * torch.sigmoid(lse - sink)[..., None]).to(out.dtype)
            lse = torch.logaddexp(lse, sink)  # the sink is one more term of the denominator
        return out, lse if with_lse else None

    if compiled:
        return run

    def eager(*args: Any) -> Result:
        # compile=False is the choice that warning describes: silence it for this call only.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_UNCOMPILED, category=UserWarning)
            return run(*args)

    return eager

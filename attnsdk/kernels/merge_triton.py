"""The Triton kernel of ``attnsdk.merge_states`` on CUDA (imported on first use: imports Triton).

One program per (query row, block of heads) holds a (heads, Dv) tile: it reads both parts'
log-sum-exps, computes the two weights in fp32, reads only the outputs of parts with a non-zero
weight (a part that saw no key may hold anything), and writes the merged output in the output's
dtype and the merged log-sum-exp. Strides come from the tensors, so views (a column block of a
wider buffer, an in-place ``out=out_a``) need no copy; nothing is allocated and nothing syncs,
so a CUDA graph can capture it.
"""
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

from typing import TYPE_CHECKING

from attnsdk.contract.errors import BackendUnavailableError

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # CPU-only torch ships without Triton; merge_states stays on PyTorch there
    triton = None

if TYPE_CHECKING:
    import torch

__all__ = ["merge_triton"]

_TILE = 4096
"""Elements of one program's (heads, Dv) tile: Dv = 512 still gets 8 heads per program."""


if triton is not None:

    @triton.jit
    def _merge_kernel(
        out_a,
        lse_a,
        out_b,
        lse_b,
        out,
        lse_out,
        oa_t,
        oa_h,
        oa_d,
        ob_t,
        ob_h,
        ob_d,
        o_t,
        o_h,
        o_d,
        la_t,
        la_h,
        lb_t,
        lb_h,
        lo_t,
        lo_h,
        num_heads,
        dv,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < num_heads
        d = tl.arange(0, BLOCK_D)
        tile_ok = h_ok[:, None] & (d < dv)[None, :]

        la = tl.load(lse_a + t * la_t + h * la_h, mask=h_ok, other=float("-inf"))
        lb = tl.load(lse_b + t * lb_t + h * lb_h, mask=h_ok, other=float("-inf"))
        m = tl.maximum(la, lb)
        # Both -inf: shift by 0, or -inf - -inf would be NaN; the weights stay exp(-inf) = 0.
        shift = tl.where(m == float("-inf"), 0.0, m)
        w_a = tl.exp(la - shift)
        w_b = tl.exp(lb - shift)
        total = w_a + w_b
        inv = tl.where(total > 0.0, 1.0 / total, 0.0)

        # A part of weight 0 is not read: its output may be garbage, and 0 * NaN is NaN.
        xa = tl.load(
            out_a + t * oa_t + h[:, None] * oa_h + d[None, :] * oa_d,
            mask=tile_ok & (w_a > 0.0)[:, None],
            other=0.0,
        ).to(tl.float32)
        xb = tl.load(
            out_b + t * ob_t + h[:, None] * ob_h + d[None, :] * ob_d,
            mask=tile_ok & (w_b > 0.0)[:, None],
            other=0.0,
        ).to(tl.float32)
        merged = xa * (w_a * inv)[:, None] + xb * (w_b * inv)[:, None]
        tl.store(
            out + t * o_t + h[:, None] * o_h + d[None, :] * o_d,
            merged.to(out.dtype.element_ty),
            mask=tile_ok,
        )
        tl.store(lse_out + t * lo_t + h * lo_h, m + tl.log(total), mask=h_ok)


def merge_triton(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
    lse_out: torch.Tensor,
) -> None:
    """Launch the merge; the arguments have passed ``merge_states``'s checks."""
    if triton is None:  # a CUDA build of torch ships Triton; a custom one may not
        raise BackendUnavailableError(
            "merge_states on CUDA runs a Triton kernel, and Triton cannot be imported.",
            "pip install triton",
        )
    t, h, dv = out_a.shape
    if t == 0 or h == 0:
        return
    block_d = triton.next_power_of_2(dv)
    block_h = min(triton.next_power_of_2(h), max(1, _TILE // block_d))
    grid = (t, triton.cdiv(h, block_h))
    _merge_kernel[grid](
        out_a, lse_a, out_b, lse_b, out, lse_out,
        *out_a.stride(), *out_b.stride(), *out.stride(),
        *lse_a.stride(), *lse_b.stride(), *lse_out.stride(),
        h, dv,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip

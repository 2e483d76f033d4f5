"""Tolerances derived from the dtype, and the comparison every backend test uses."""

from __future__ import annotations

import torch

from attnsdk.contract.kv import FP8_KV_DTYPES

__all__ = ["assert_close_to_reference", "tolerance"]

_TOLERANCE = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def tolerance(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> tuple[float, float]:
    """(atol, rtol) for outputs of ``dtype`` with unit-variance inputs; fp8 KV widens them.

    >>> tolerance(torch.bfloat16)
    (0.02, 0.02)
    """
    atol, rtol = _TOLERANCE[dtype]
    if kv_dtype in FP8_KV_DTYPES:
        atol, rtol = max(atol, 6e-2), max(rtol, 6e-2)
    return atol, rtol


def assert_close_to_reference(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    kv_dtype: torch.dtype | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> None:
    """Assert ``out`` matches the reference output within the dtype's tolerance.

    Both must be finite (a NaN anywhere fails, naming the first bad row). The error message
    gives the worst absolute error and where it is.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"shape: expected {tuple(ref.shape)}, found {tuple(out.shape)}")
    default_atol, default_rtol = tolerance(ref.dtype, kv_dtype)
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol
    o, r = out.detach().float().cpu(), ref.detach().float().cpu()
    for name, x in (("output", o), ("reference", r)):
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            where = tuple(torch.nonzero(bad)[0].tolist())
            raise AssertionError(f"non-finite {name} at index {where}")
    err = (o - r).abs()
    over = err > atol + rtol * r.abs()
    if bool(over.any()):
        worst = int(torch.argmax(err))
        idx = tuple(torch.unravel_index(torch.tensor(worst), err.shape))
        raise AssertionError(
            f"{int(over.sum())} of {err.numel()} elements differ beyond atol={atol}, rtol={rtol}; "
            f"worst |diff|={float(err.max()):.3g} at {tuple(int(i) for i in idx)} "
            f"(out={float(o[idx]):.5g}, ref={float(r[idx]):.5g})"
        )

"""``merge_states``: one attention result from two results over disjoint parts of the keys.

Shape legend: T query rows, H heads, Dv value head dim. A part is what ``forward(..., lse=)``
returns: its output (T, H, Dv) and its natural-log log-sum-exp (T, H) fp32 (docs/kv_layout.md,
"The log-sum-exp"). On CUDA one Triton launch merges them (``backends/_merge_triton.py``,
imported on first use); elsewhere the same maths runs in PyTorch.
"""

from __future__ import annotations

import torch

from attnsdk.contract.debug import env_debug
from attnsdk.contract.errors import InvalidInputError

__all__ = ["merge_states", "merge_states_torch"]

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def merge_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over key parts A and B into attention over both.

    out_a / out_b: (T, H, Dv) fp16, bf16 or fp32, one dtype; lse_a / lse_b: (T, H) fp32, the
    natural-log log-sum-exp of each part (``forward(..., lse=)``); all on one device. Returns
    ``(out, lse)``: out (T, H, Dv) in out_a's dtype, lse (T, H) fp32, written into ``out`` /
    ``lse_out`` when given (``out=out_a`` merges in place). With ``m = max(lse_a, lse_b)`` and
    ``w = exp(lse - m)``, computed in fp32::

        out = (w_a * out_a + w_b * out_b) / (w_a + w_b)      lse = m + log(w_a + w_b)

    A part whose lse is -inf (it saw no key) contributes nothing and its output is not read:
    the result is then exactly the other part; both -inf give out 0 and lse -inf, never NaN.
    Sinks belong to one part only (each part's lse counts the sink once). An lse is finite or
    -inf: +inf or NaN is no log-sum-exp of finite scores, and would make the row NaN.

    On CUDA this is one Triton launch with no host sync; given ``out`` and ``lse_out`` it
    allocates nothing, so it can be captured in a CUDA graph. Checks run on the host (shapes,
    dtypes, devices), raising ``InvalidInputError`` naming the argument before anything is
    written. The lse values are checked too (+inf or NaN refused, naming the entry) where that
    needs no device sync: on the CPU always, on CUDA only in debug mode (``ATTNSDK_DEBUG=1``)
    outside graph capture, since reading them there waits for the GPU. Without debug mode an
    lse of +inf or NaN on CUDA gives NaN in its row.

    >>> a, b = torch.zeros(1, 1, 2), torch.ones(1, 1, 2)
    >>> out, lse = merge_states(a, torch.zeros(1, 1), b, torch.zeros(1, 1))
    >>> out.tolist(), round(float(lse), 4)  # equal weights: the mean, and log(e^0 + e^0)
    ([[[0.5, 0.5]]], 0.6931)
    """
    t, h, dv = _check_part("out_a", out_a, "lse_a", lse_a, None)
    _check_part("out_b", out_b, "lse_b", lse_b, out_a)
    if out is None:
        out = torch.empty(t, h, dv, dtype=out_a.dtype, device=out_a.device)
    else:
        _check_tensor("out", out, (t, h, dv), out_a.dtype, out_a.device)
    if lse_out is None:
        lse_out = torch.empty(t, h, dtype=torch.float32, device=out_a.device)
    else:
        _check_tensor("lse_out", lse_out, (t, h), torch.float32, out_a.device)
    if _reads_values(out_a.device):
        _check_lse_values("lse_a", lse_a)
        _check_lse_values("lse_b", lse_b)
    if out_a.device.type == "cuda":
        from attnsdk.kernels.merge_triton import merge_triton  # imports Triton

        merge_triton(out_a, lse_a, out_b, lse_b, out, lse_out)
        return out, lse_out
    merged, merged_lse = merge_states_torch(out_a, lse_a, out_b, lse_b)
    out.copy_(merged)
    lse_out.copy_(merged_lse)
    return out, lse_out


def merge_states_torch(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_states`` in PyTorch, unchecked: the CPU path and the GPU kernel's oracle."""
    neg_inf = float("-inf")
    m = torch.maximum(lse_a, lse_b)
    # Both -inf: -inf - -inf would be NaN; shifting by 0 keeps the weights at exp(-inf) = 0.
    shift = torch.where(m == neg_inf, torch.zeros_like(m), m)
    w_a, w_b = torch.exp(lse_a - shift), torch.exp(lse_b - shift)
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / total, torch.zeros_like(total))
    # A part of weight 0 is never read: its output may be garbage (a row that saw no key).
    part_a = torch.where((w_a > 0)[..., None], out_a.float(), 0.0) * (w_a * inv)[..., None]
    part_b = torch.where((w_b > 0)[..., None], out_b.float(), 0.0) * (w_b * inv)[..., None]
    return (part_a + part_b).to(out_a.dtype), m + torch.log(total)


def _reads_values(device: torch.device) -> bool:
    """Whether the lse values can be read without a device sync (the CPU), or may be (CUDA in
    debug mode, outside graph capture); never on ``meta`` (no values)."""
    if device.type == "cpu":
        return True
    if device.type != "cuda":
        return False
    return env_debug() and not torch.cuda.is_current_stream_capturing()


def _check_lse_values(name: str, lse: torch.Tensor) -> None:
    """Finite or -inf, the values a log-sum-exp takes; +inf and NaN are refused."""
    bad = torch.isnan(lse) | (lse == float("inf"))
    if bool(bad.any()):
        t, h = (int(i) for i in torch.nonzero(bad)[0])
        raise InvalidInputError(
            f"{name}[{t}, {h}]",
            "a log-sum-exp: finite, or -inf for a part that saw no key",
            float(lse[t, h]),
        )


def _check_part(
    out_name: str,
    part_out: torch.Tensor,
    lse_name: str,
    part_lse: torch.Tensor,
    like: torch.Tensor | None,
) -> tuple[int, int, int]:
    """One part's (out, lse); ``like`` (the first part's output) fixes shape, dtype, device."""
    if not isinstance(part_out, torch.Tensor):
        raise InvalidInputError(out_name, "a torch.Tensor (T, H, Dv)", type(part_out).__name__)
    if like is None:
        if part_out.dim() != 3:
            raise InvalidInputError(f"{out_name}.shape", "(T, H, Dv)", tuple(part_out.shape))
        if part_out.dtype not in _OUT_DTYPES:
            names = ", ".join(str(d) for d in _OUT_DTYPES)
            raise InvalidInputError(f"{out_name}.dtype", f"one of {names}", part_out.dtype)
        like = part_out
    else:
        _check_tensor(out_name, part_out, tuple(like.shape), like.dtype, like.device)
    t, h, dv = like.shape
    _check_tensor(lse_name, part_lse, (t, h), torch.float32, like.device)
    return t, h, dv


def _check_tensor(
    name: str,
    x: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    if not isinstance(x, torch.Tensor):
        raise InvalidInputError(name, f"a torch.Tensor {shape}", type(x).__name__)
    if tuple(x.shape) != shape:
        raise InvalidInputError(f"{name}.shape", str(shape), tuple(x.shape))
    if x.dtype != dtype:
        raise InvalidInputError(f"{name}.dtype", str(dtype), x.dtype)
    if x.device != device:
        raise InvalidInputError(f"{name}.device", f"out_a's device {device}", x.device)

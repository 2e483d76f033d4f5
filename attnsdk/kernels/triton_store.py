"""A sync-free, bounds-checked paged K/V store: one Triton launch writes K and V of every token.

``KVCache.store`` selects valid slots with a boolean mask, which makes the host wait for the
device; under CUDA graphs that is not even capturable. Here each program handles one token row:
it reads the slot, returns early when it is negative (padding), and writes all KV heads of K and
V, quantising to fp8 with a per-tensor or per-head scale on the way. Strides come from the
tensors, so NHD, HND and packed K‖V caches and non-contiguous new K/V all work.

A slot past the cache is never written: the program records it in a device flag
(``attnsdk.backends.gpu.DeviceFlag``) instead, which the backend reports as
``InvalidMetadataError`` without a device sync at a later ``plan`` (at once in debug mode).
"""
# mypy: disable-error-code="no-untyped-def"

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from attnsdk.contract.errors import BackendUnavailableError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("attnsdk")

try:
    import triton  # type: ignore[import-not-found, unused-ignore]
    import triton.language as tl  # type: ignore[import-not-found, unused-ignore]
except ImportError:  # CPU-only torch ships without Triton; fa3 cannot run there anyway
    triton = None

__all__ = ["store_kv"]


if triton is not None:

    @triton.jit
    def _store_kv_kernel(
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k_scale,
        v_scale,
        k_row,
        k_head,
        k_dim,
        v_row,
        v_head,
        v_dim,
        kc_page,
        kc_off,
        kc_head,
        vc_page,
        vc_off,
        vc_head,
        k_scale_head,
        v_scale_head,
        page_size,
        num_slots,
        bad_slot,
        fp8_max,
        HKV: tl.constexpr,
        D: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
        QUANT: tl.constexpr,
        K_SCALED: tl.constexpr,
        V_SCALED: tl.constexpr,
    ):
        t = tl.program_id(0)
        slot = tl.load(slots + t)
        if slot < 0:
            return
        if slot >= num_slots:
            tl.atomic_max(bad_slot, slot)
            return
        page = slot // page_size
        off = slot - page * page_size
        h = tl.arange(0, BLOCK_H)[:, None]
        hmask = h < HKV

        d = tl.arange(0, BLOCK_D)[None, :]
        mask = hmask & (d < D)
        x = tl.load(k + t.to(tl.int64) * k_row + h * k_head + d * k_dim, mask=mask)
        if QUANT:
            x = x.to(tl.float32)
            if K_SCALED:
                x = x / tl.load(k_scale + h * k_scale_head, mask=hmask, other=1.0)
            x = tl.clamp(x, -fp8_max, fp8_max)
        dst = k_cache + page.to(tl.int64) * kc_page + off * kc_off + h * kc_head + d
        tl.store(dst, x.to(k_cache.dtype.element_ty), mask=mask)

        dv = tl.arange(0, BLOCK_DV)[None, :]
        mask = hmask & (dv < DV)
        y = tl.load(v + t.to(tl.int64) * v_row + h * v_head + dv * v_dim, mask=mask)
        if QUANT:
            y = y.to(tl.float32)
            if V_SCALED:
                y = y / tl.load(v_scale + h * v_scale_head, mask=hmask, other=1.0)
            y = tl.clamp(y, -fp8_max, fp8_max)
        dst = v_cache + page.to(tl.int64) * vc_page + off * vc_off + h * vc_head + dv
        tl.store(dst, y.to(v_cache.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    *,
    quantize: bool,
    fp8_max: float,
    bad_slot: torch.Tensor,
) -> None:
    """Write rows ``0..num_tokens-1`` of k (T, Hkv, D) / v (T, Hkv, Dv) at their slots.

    ``k``/``v`` may have any strides. ``k_cache`` / ``v_cache`` are (N, P, Hkv, D|Dv) views (any
    strides, last dim contiguous). ``quantize``: divide by the scales (fp32, 1 or Hkv elements;
    None: 1) and clamp to ±``fp8_max`` before the cast to the cache's fp8 dtype. A slot >= N * P
    is skipped and max-reduced into ``bad_slot`` (an int64 (1,) device tensor, see ``DeviceFlag``).
    """
    if num_tokens == 0:
        return
    if triton is None:
        raise BackendUnavailableError("the GPU KV store needs Triton.", "pip install triton")
    if quantize and not fp8_max > 0:
        raise ValueError(f"quantize=True needs the fp8 dtype's largest value, found {fp8_max}")
    hkv, d, dv = k.shape[1], k.shape[2], v.shape[2]
    quant = quantize
    # Unscaled launches never read the scale pointers; any tensor stands in for them.
    ks = k_scale if k_scale is not None else slot_mapping
    vs = v_scale if v_scale is not None else slot_mapping
    # A one-element scale is read by every head through a zero stride.
    ks_head = 1 if k_scale is not None and k_scale.numel() > 1 else 0
    vs_head = 1 if v_scale is not None and v_scale.numel() > 1 else 0
    runtime = (
        k, v, k_cache, v_cache, slot_mapping, ks, vs,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        ks_head, vs_head, k_cache.shape[1], k_cache.shape[0] * k_cache.shape[1], bad_slot,
        fp8_max,
    )  # fmt: skip
    constexprs = {  # in the kernel's parameter order
        "HKV": hkv,
        "D": d,
        "DV": dv,
        "BLOCK_H": triton.next_power_of_2(hkv),
        "BLOCK_D": triton.next_power_of_2(d),
        "BLOCK_DV": triton.next_power_of_2(dv),
        "QUANT": quant,
        "K_SCALED": quant and k_scale is not None,
        "V_SCALED": quant and v_scale is not None,
    }
    _launch(_store_kv_kernel, (num_tokens, 1, 1), runtime, constexprs)


_compiled: dict[tuple[object, ...], Any] = {}
_fast_launch = True


def _launch(
    kernel: Any, grid: tuple[int, int, int], runtime: tuple[Any, ...], constexprs: dict[str, Any]
) -> None:
    """Launch through the cached compiled kernel, skipping Triton's per-call argument binding.

    ``kernel[grid](...)`` costs ~28 µs of host time per call here (it re-derives the
    specialisation of 30 arguments every time), about as much as the FA3 call it precedes. The
    compiled kernel is keyed on everything Triton specialises on (pointer dtype and 16-byte
    alignment, integers equal to 1, divisible by 16 or beyond int32, constexpr values), so a
    cached launch is the one ``kernel[grid]`` would make. Should this Triton lack the
    compiled-kernel launch API, every call takes the ordinary path.
    """
    global _fast_launch
    if not _fast_launch:
        kernel[grid](*runtime, **constexprs, num_warps=4)
        return
    key = (runtime[0].device.index, *map(_spec, runtime), *constexprs.values())
    compiled = _compiled.get(key)
    args = (*runtime, *constexprs.values())
    if compiled is not None:
        compiled[grid](*args)
        return
    try:
        compiled = kernel.warmup(*runtime, **constexprs, num_warps=4, grid=grid)
        compiled[grid](*args)  # a launcher with another signature raises before launching
    except Exception:  # any other Triton launch API: fall back to the ordinary path for good
        _fast_launch = False
        logger.warning(
            "attnsdk: Triton's compiled-kernel launch is unavailable; the KV store uses the "
            "slower ordinary launch (~10 µs more host time per layer)",
            exc_info=True,
        )
        kernel[grid](*runtime, **constexprs, num_warps=4)
        return
    _compiled[key] = compiled


def _spec(a: Any) -> tuple[object, ...]:
    if isinstance(a, bool):
        return (bool, a)
    if isinstance(a, int):
        return (int, a == 1, a % 16 == 0, -(2**31) <= a < 2**31)
    if isinstance(a, float):
        return (float,)
    return (a.dtype, a.data_ptr() % 16 == 0)

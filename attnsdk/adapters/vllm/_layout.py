"""vLLM's per-layer KV-cache tensor → zero-copy attnsdk ``KVCache`` views.

vLLM has shipped three logical shapes for one layer's cache (legend: N blocks, P block size,
Hkv KV heads, D head size)::

    KV_BLOCKS  [2, N, P, Hkv, D]   K = t[0], V = t[1]                  (FlashAttention, v0.x)
    BLOCKS_KV  [N, 2, P, Hkv, D]   K = t[:, 0], V = t[:, 1]            (FlashInfer, Triton)
    PACKED     [N, Hkv, P, 2D]     K = t[..., :D], V = t[..., D:]      (recent: K‖V in one row)

Each may sit on any physical stride order (vLLM's ``get_kv_cache_stride_order``): the PACKED
view is token-major in memory by default (physical ``[N, P, Hkv, 2D]``). The layout is read from
the tensor's shape, never from a version string; the K/V views always come back in NHD order
(``[N, P, Hkv, D]``, any strides, stride 1 in the last dim) so they alias vLLM's storage.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from attnsdk.contract.errors import InvalidInputError
from attnsdk.contract.kv import FP8_KV_DTYPES, KVCache, KVCacheLayout

__all__ = [
    "VLLMKVLayout",
    "as_kv_layout",
    "compute_dtype_by_name",
    "detect_kv_layout",
    "fp8_storage_dtype",
    "wrap_kv_cache",
]

_FP8_BY_NAME: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""vLLM's ``kv_cache_dtype`` strings for fp8 storage (it allocates those caches as uint8)."""

_COMPUTE_BY_NAME: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
}


class VLLMKVLayout(str, enum.Enum):
    """The logical shapes vLLM has used for one layer's KV cache."""

    KV_BLOCKS = "[2, N, P, Hkv, D]"
    """K and V stacked in front: ``FlashAttentionBackend.get_kv_cache_shape`` until K‖V packing."""
    BLOCKS_KV = "[N, 2, P, Hkv, D]"
    """Block-major with K and V adjacent per block (FlashInfer, Triton)."""
    PACKED = "[N, Hkv, P, 2D]"
    """Recent logical view: K‖V packed in the last dim; token-major memory by default."""


_ACCEPTED = ", ".join(layout.value for layout in VLLMKVLayout)


@dataclass(frozen=True, slots=True)
class _Detected:
    layout: VLLMKVLayout
    k: torch.Tensor
    """(N, P, Hkv, D) view of vLLM's tensor."""
    v: torch.Tensor
    """(N, P, Hkv, D) view of vLLM's tensor."""


def fp8_storage_dtype(kv_cache_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """The fp8 dtype named by vLLM's ``kv_cache_dtype`` ("fp8", "fp8_e4m3", "fp8_e5m2"), else None."""
    if isinstance(kv_cache_dtype, torch.dtype):
        return kv_cache_dtype if kv_cache_dtype in FP8_KV_DTYPES else None
    if kv_cache_dtype is None or kv_cache_dtype in ("auto", *_COMPUTE_BY_NAME):
        return None
    if kv_cache_dtype in _FP8_BY_NAME:
        return _FP8_BY_NAME[kv_cache_dtype]
    raise InvalidInputError(
        "kv_cache_dtype",
        f"'auto', a compute dtype name or one of {sorted(_FP8_BY_NAME)}",
        repr(kv_cache_dtype),
    )


def compute_dtype_by_name(kv_cache_dtype: str | None) -> torch.dtype | None:
    """The compute dtype a ``kv_cache_dtype`` string names ("float16", "bfloat16", ...), else
    None ("auto", fp8 names)."""
    return _COMPUTE_BY_NAME.get(kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None


def detect_kv_layout(
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    head_size: int,
    layout: VLLMKVLayout | str | None = None,
) -> VLLMKVLayout:
    """Which of the three vLLM layouts ``kv_cache`` is, from its shape alone.

    ``layout`` resolves the one ambiguous case, a 5-D tensor with N == 2 (``[2, 2, P, Hkv, D]``
    reads as both stacked layouts); without it that case is rejected. A given ``layout`` is
    checked against the shape.
    """
    if not isinstance(kv_cache, torch.Tensor):
        raise InvalidInputError("kv_cache", "a torch.Tensor", type(kv_cache).__name__)
    shape = tuple(kv_cache.shape)
    h, d = num_kv_heads, head_size
    matches = []
    if len(shape) == 5 and shape[3:] == (h, d):
        if shape[0] == 2:
            matches.append(VLLMKVLayout.KV_BLOCKS)
        if shape[1] == 2:
            matches.append(VLLMKVLayout.BLOCKS_KV)
    elif len(shape) == 4 and shape[1] == h and shape[3] == 2 * d:
        matches.append(VLLMKVLayout.PACKED)
    if layout is not None:
        wanted = as_kv_layout(layout)
        if wanted not in matches:
            raise InvalidInputError(
                "kv_cache.shape",
                f"{wanted.value} with Hkv={h}, D={d} (the layout passed)",
                shape,
            )
        return wanted
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise InvalidInputError(
            "kv_cache.shape",
            "an unambiguous layout",
            shape,
            f"with N == 2 blocks it reads as both {VLLMKVLayout.KV_BLOCKS.value} and "
            f"{VLLMKVLayout.BLOCKS_KV.value}; pass layout=VLLMKVLayout.KV_BLOCKS or BLOCKS_KV",
        )
    hint = f"one of {_ACCEPTED} with Hkv={h}, D={d}"
    if len(shape) == 4 and shape[2] == h and shape[3] == 2 * d:
        hint += (
            "; this looks like the physical [N, P, Hkv, 2D] memory: pass kv_cache.transpose(1, 2)"
        )
    raise InvalidInputError("kv_cache.shape", hint, shape)


def wrap_kv_cache(
    kv_cache: torch.Tensor,
    num_kv_heads: int,
    head_size: int,
    *,
    dtype: torch.dtype | None = None,
    kv_cache_dtype: str | torch.dtype | None = None,
    layout: VLLMKVLayout | str | None = None,
) -> KVCache:
    """Zero-copy NHD ``KVCache`` over vLLM's tensor (see the module docstring)."""
    found = detect_kv_layout(kv_cache, num_kv_heads, head_size, layout)
    storage = _storage_view(kv_cache, kv_cache_dtype)
    views = _split(storage, found, head_size)
    compute = _compute_dtype(storage.dtype, dtype)
    kv_layout = KVCacheLayout(
        num_kv_heads=num_kv_heads,
        head_dim=head_size,
        page_size=views.k.shape[1],
        dtype=compute,
        kv_dtype=storage.dtype,
    )
    for name, view in (("k", views.k), ("v", views.v)):
        if view.stride(-1) != 1:
            raise InvalidInputError(
                "kv_cache.stride()",
                f"stride 1 in the head dim of {found.value}",
                kv_cache.stride(),
                f"the {name} view has strides {view.stride()}; kernels read each head vector "
                "as one contiguous run",
            )
    return kv_layout.wrap(views.k, views.v)


def as_kv_layout(value: VLLMKVLayout | str) -> VLLMKVLayout:
    """A ``VLLMKVLayout`` from itself, its name ("PACKED") or its value ("[N, Hkv, P, 2D]")."""
    if isinstance(value, VLLMKVLayout):
        return value
    try:
        return VLLMKVLayout[value] if value in VLLMKVLayout.__members__ else VLLMKVLayout(value)
    except ValueError:
        raise InvalidInputError(
            "layout", f"a VLLMKVLayout ({', '.join(VLLMKVLayout.__members__)})", repr(value)
        ) from None


def _split(t: torch.Tensor, layout: VLLMKVLayout, head_size: int) -> _Detected:
    if layout is VLLMKVLayout.KV_BLOCKS:
        return _Detected(layout, t[0], t[1])
    if layout is VLLMKVLayout.BLOCKS_KV:
        return _Detected(layout, t[:, 0], t[:, 1])
    nhd = t.transpose(1, 2)  # logical [N, Hkv, P, 2D] -> [N, P, Hkv, 2D], still a view
    return _Detected(layout, nhd[..., :head_size], nhd[..., head_size:])


def _storage_view(t: torch.Tensor, kv_cache_dtype: str | torch.dtype | None) -> torch.Tensor:
    """vLLM allocates fp8 caches as uint8; reinterpret them (same itemsize, so a pure view)."""
    fp8 = fp8_storage_dtype(kv_cache_dtype)
    if t.dtype == torch.uint8:
        if fp8 is None:
            raise InvalidInputError(
                "kv_cache_dtype",
                "'fp8', 'fp8_e4m3' or 'fp8_e5m2' for a uint8 cache (vLLM's fp8 storage)",
                repr(kv_cache_dtype),
            )
        return t.view(fp8)
    if fp8 is not None and t.dtype != fp8:
        raise InvalidInputError(
            "kv_cache.dtype", f"{fp8} or torch.uint8 (kv_cache_dtype={kv_cache_dtype!r})", t.dtype
        )
    return t


def _compute_dtype(storage: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    if storage in FP8_KV_DTYPES:
        raise InvalidInputError(
            "dtype",
            "the model's compute dtype (torch.float16 / torch.bfloat16) for an fp8 cache",
            None,
        )
    return storage

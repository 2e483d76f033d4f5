"""``KVCacheLayout`` and ``KVCache``: how paged K/V are stored. docs/kv_layout.md is the spec."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from attnsdk.contract.checks import (
    check_bool,
    check_int,
    check_mla_dims,
    check_usable_device,
    is_int_tensor,
)
from attnsdk.contract.errors import InvalidInputError, InvalidMetadataError

__all__ = [
    "COMPUTE_DTYPES",
    "FP8_KV_DTYPES",
    "KVCache",
    "KVCacheLayout",
    "KVOrder",
    "mla_value",
]

FP8_KV_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
"""Storage dtypes that hold quantised K/V (dequantised with ``k_scale`` / ``v_scale``)."""

COMPUTE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16, torch.float32})
"""Dtypes of q, new k/v and the output (``KVCacheLayout.dtype``)."""


class KVOrder(str, enum.Enum):
    """Order of the per-page dimensions of the K (and V) tensor."""

    NHD = "NHD"
    """``[num_pages, page_size, num_kv_heads, head_dim]`` (token-major pages; FA, SGLang, vLLM)."""
    HND = "HND"
    """``[num_pages, num_kv_heads, page_size, head_dim]`` (head-major pages; FlashInfer)."""


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    """Static description of a paged KV cache, shared by every layer that uses it.

    >>> layout = KVCacheLayout(num_kv_heads=2, head_dim=64, page_size=16)
    >>> cache = layout.allocate(num_pages=8)
    >>> tuple(cache.k.shape), cache.k.dtype
    ((8, 16, 2, 64), torch.bfloat16)
    """

    num_kv_heads: int
    """Hkv."""
    head_dim: int
    """D, the K head dim."""
    page_size: int
    """P, tokens per page."""
    dtype: torch.dtype = torch.bfloat16
    """Compute dtype: the dtype of q, of new k/v and of the output."""
    v_head_dim: int | None = None
    """Dv; None means ``head_dim``."""
    order: KVOrder | str = KVOrder.NHD
    """``"NHD"`` or ``"HND"`` (see ``KVOrder``)."""
    kv_dtype: torch.dtype | None = None
    """Storage dtype of the cache; None means ``dtype``. fp8 (e4m3/e5m2) stores quantised K/V."""
    mla: bool = False
    """A multi-head-latent-attention cache: one tensor of (N, P, 1, kv_lora_rank + rope_dim),
    each token's latent then its rope key; V is a view of its first ``v_head_dim =
    kv_lora_rank`` dims, not stored apart. NHD only. Build with ``for_mla``; ``LayerSpec.mla``
    says what a layer computes over it."""

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "page_size"):
            check_int(f"KVCacheLayout.{name}", getattr(self, name))
        if self.v_head_dim is not None:
            check_int("KVCacheLayout.v_head_dim", self.v_head_dim)
        try:
            object.__setattr__(self, "order", KVOrder(self.order))
        except ValueError:
            raise InvalidInputError(
                "KVCacheLayout.order", "'NHD' or 'HND'", repr(self.order)
            ) from None
        if self.dtype not in COMPUTE_DTYPES:
            raise InvalidInputError(
                "KVCacheLayout.dtype", "torch.float16, torch.bfloat16 or torch.float32", self.dtype
            )
        if self.kv_dtype is not None and self.kv_dtype not in FP8_KV_DTYPES | {self.dtype}:
            raise InvalidInputError(
                "KVCacheLayout.kv_dtype",
                f"None, {self.dtype} or an fp8 dtype (torch.float8_e4m3fn, torch.float8_e5m2)",
                self.kv_dtype,
            )
        check_bool("KVCacheLayout.mla", self.mla)
        if self.mla:
            check_mla_dims("KVCacheLayout", self.num_kv_heads, self.head_dim, self.v_head_dim)
            if self.order != KVOrder.NHD:
                raise InvalidInputError(
                    "KVCacheLayout.order",
                    "'NHD' for MLA (with one head both orders are the same bytes)",
                    repr(KVOrder(self.order).value),
                )

    @classmethod
    def for_mla(
        cls,
        page_size: int,
        *,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        dtype: torch.dtype = torch.bfloat16,
        kv_dtype: torch.dtype | None = None,
    ) -> KVCacheLayout:
        """An MLA latent cache: one (N, P, 1, kv_lora_rank + rope_dim) tensor, V a view of it.

        >>> layout = KVCacheLayout.for_mla(page_size=64)
        >>> cache = layout.allocate(num_pages=4)
        >>> tuple(cache.k.shape), tuple(cache.v.shape), cache.v.data_ptr() == cache.k.data_ptr()
        ((4, 64, 1, 576), (4, 64, 1, 512), True)
        """
        return cls(
            num_kv_heads=1,
            head_dim=kv_lora_rank + rope_dim,
            page_size=page_size,
            dtype=dtype,
            v_head_dim=kv_lora_rank,
            kv_dtype=kv_dtype,
            mla=True,
        )

    @property
    def v_dim(self) -> int:
        """Dv, resolved."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def kv_order(self) -> KVOrder:
        """``order`` as a ``KVOrder`` (strings are normalised on construction)."""
        return KVOrder(self.order)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the cache tensors hold."""
        return self.dtype if self.kv_dtype is None else self.kv_dtype

    @property
    def is_quantized(self) -> bool:
        """True when K/V are stored in fp8 and need ``k_scale`` / ``v_scale`` to be read."""
        return self.storage_dtype in FP8_KV_DTYPES

    def page_shape(self, num_pages: int, dim: int) -> tuple[int, int, int, int]:
        """Shape of the K (``dim=head_dim``) or V (``dim=v_dim``) tensor for ``num_pages``."""
        if self.kv_order is KVOrder.NHD:
            return (num_pages, self.page_size, self.num_kv_heads, dim)
        return (num_pages, self.num_kv_heads, self.page_size, dim)

    def allocate(self, num_pages: int, device: torch.device | str = "cpu") -> KVCache:
        """Allocate a zeroed cache of ``num_pages`` pages (page 0 is conventionally padding)."""
        num_pages = check_int("num_pages", num_pages)
        device = check_usable_device("device", device)
        dt = self.storage_dtype
        k = torch.zeros(self.page_shape(num_pages, self.head_dim), dtype=dt, device=device)
        if self.mla:
            return KVCache(self, k, k[..., : self.v_dim])
        v = torch.zeros(self.page_shape(num_pages, self.v_dim), dtype=dt, device=device)
        return KVCache(self, k, v)

    def wrap(self, k: torch.Tensor, v: torch.Tensor | None = None) -> KVCache:
        """Adopt an engine's K and V tensors without copying.

        Strided views are accepted (e.g. K and V halves of one packed tensor) as long as each
        head vector is contiguous (stride 1 in the last dim). An MLA layout takes the latent
        cache as ``k`` alone (``v`` None, or the view ``k[..., :kv_lora_rank]``). Raises
        ``InvalidInputError`` naming the tensor, the expected and the found shape, dtype or
        stride.
        """
        if self.mla:
            v = self._latent_view(k, v)
        elif v is None:
            raise InvalidInputError("v", "a torch.Tensor (only an MLA layout has no V)", None)
        for name, t, dim in (("k", k, self.head_dim), ("v", v, self.v_dim)):
            if not isinstance(t, torch.Tensor):
                raise InvalidInputError(name, "a torch.Tensor", type(t).__name__)
            if t.dim() != 4:
                raise InvalidInputError(
                    f"{name}.shape", f"4 dims {self.kv_order.value}", tuple(t.shape)
                )
            expected = self.page_shape(t.shape[0], dim)
            if tuple(t.shape) != expected:
                raise InvalidInputError(
                    f"{name}.shape",
                    f"{expected} ([num_pages, ...] in {self.kv_order.value} order)",
                    tuple(t.shape),
                )
            if t.dtype != self.storage_dtype:
                raise InvalidInputError(f"{name}.dtype", str(self.storage_dtype), t.dtype)
            if t.stride(-1) != 1:
                raise InvalidInputError(
                    f"{name}.stride()",
                    "stride 1 in the last (head_dim) dimension",
                    t.stride(),
                    "Kernels read each head vector as one contiguous run",
                )
            if any(st == 0 and size > 1 for st, size in zip(t.stride(), t.shape)):
                raise InvalidInputError(
                    f"{name}.stride()",
                    "no zero stride (an expanded tensor: its pages or heads share memory)",
                    t.stride(),
                    "A write to one slot would land in every slot that aliases it",
                )
        if k.shape[0] != v.shape[0]:
            raise InvalidInputError("v.shape[0]", f"{k.shape[0]} pages like k", v.shape[0])
        if k.device != v.device:
            raise InvalidInputError("v.device", str(k.device), v.device)
        return KVCache(self, k, v)

    def _latent_view(self, k: torch.Tensor, v: torch.Tensor | None) -> torch.Tensor:
        """V of an MLA cache: ``k[..., :kv_lora_rank]``; a ``v`` passed must be exactly that."""
        if not isinstance(k, torch.Tensor):
            raise InvalidInputError("k", "a torch.Tensor", type(k).__name__)
        latent = k[..., : self.v_dim]
        if v is not None and not _same_view(v, latent):
            raise InvalidInputError(
                "v",
                f"None or k[..., :{self.v_dim}] for an MLA layout (V is the latent part of k)",
                "another tensor" if isinstance(v, torch.Tensor) else type(v).__name__,
            )
        return latent


@dataclass(frozen=True, slots=True)
class KVCache:
    """One layer's paged K and V storage. Build with ``KVCacheLayout.allocate`` or ``.wrap``."""

    layout: KVCacheLayout
    k: torch.Tensor
    """NHD: (N, P, Hkv, D); HND: (N, Hkv, P, D). ``layout.storage_dtype``; may be a strided view."""
    v: torch.Tensor
    """NHD: (N, P, Hkv, Dv); HND: (N, Hkv, P, Dv). ``layout.storage_dtype``; may be a strided view."""

    @property
    def num_pages(self) -> int:
        return self.k.shape[0]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def k_nhd(self) -> torch.Tensor:
        """K as a (N, P, Hkv, D) view whatever the storage order (no copy)."""
        return self.k if self.layout.kv_order is KVOrder.NHD else self.k.transpose(1, 2)

    @property
    def v_nhd(self) -> torch.Tensor:
        """V as a (N, P, Hkv, Dv) view whatever the storage order (no copy)."""
        return self.v if self.layout.kv_order is KVOrder.NHD else self.v.transpose(1, 2)

    def store(
        self,
        k: torch.Tensor,
        v: torch.Tensor | None,
        slot_mapping: torch.Tensor,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write new tokens: row t of ``k``/``v`` goes to slot ``slot_mapping[t]``.

        slot = page * page_size + offset; negative slots are skipped. fp8 caches store
        ``x / scale`` (scale per tensor or per KV head). An MLA cache takes ``k`` alone (latent
        then rope; ``v`` and ``v_scale`` None). This portable version selects the valid slots
        with a boolean mask, which synchronises a CUDA device; GPU backends use their own
        sync-free store.
        """
        if self.layout.mla:
            if v_scale is not None:
                raise InvalidInputError(
                    "v_scale", "None for an MLA cache (k_scale covers the latent)", "a tensor"
                )
            v, v_scale = mla_value(k, v, self.layout), k_scale
        elif v is None:
            raise InvalidInputError("v", "a torch.Tensor (only an MLA cache takes k alone)", None)
        n = self._check_store_args(k, v, slot_mapping)
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        capacity = self.num_pages * self.layout.page_size
        if slots.numel() and int(slots.max()) >= capacity:
            t = int(torch.nonzero(slot_mapping >= capacity)[0])
            raise InvalidMetadataError(
                f"slot_mapping[{t}]",
                f"< num_pages * page_size = {capacity} (or < 0: no write)",
                int(slot_mapping[t]),
                "Nothing was written",
            )
        page = slots // self.layout.page_size
        offset = slots % self.layout.page_size
        # Both quantised first: a bad v_scale must not leave K written.
        k_rows = quantize(k[:n][valid], self.k.dtype, k_scale, "k_scale")
        v_rows = quantize(v[:n][valid], self.v.dtype, v_scale, "v_scale")
        self.k_nhd[page, offset] = k_rows
        self.v_nhd[page, offset] = v_rows

    def _check_store_args(
        self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> int:
        """Host checks of ``store``'s arguments; returns the number of slots."""
        if not is_int_tensor(slot_mapping) or slot_mapping.dim() != 1:
            found = (
                (slot_mapping.dtype, tuple(slot_mapping.shape))
                if isinstance(slot_mapping, torch.Tensor)
                else type(slot_mapping).__name__
            )
            raise InvalidMetadataError("slot_mapping", "a 1-D integer tensor", found)
        if slot_mapping.device != self.device:
            raise InvalidMetadataError("slot_mapping.device", str(self.device), slot_mapping.device)
        n = slot_mapping.shape[0]
        layout = self.layout
        for name, t, dim in (("k", k, layout.head_dim), ("v", v, layout.v_dim)):
            if not isinstance(t, torch.Tensor):
                raise InvalidInputError(name, "a torch.Tensor", type(t).__name__)
            if t.dim() != 3 or t.shape[0] < n or tuple(t.shape[1:]) != (layout.num_kv_heads, dim):
                raise InvalidInputError(
                    f"{name}.shape",
                    f"(>= {n} rows, {layout.num_kv_heads}, {dim}): one row per slot",
                    tuple(t.shape),
                )
            if not t.is_floating_point():
                raise InvalidInputError(f"{name}.dtype", "a floating-point dtype", t.dtype)
            if t.device != self.device:
                raise InvalidInputError(f"{name}.device", str(self.device), t.device)
        return n


def mla_value(k: torch.Tensor, v: torch.Tensor | None, layout: KVCacheLayout) -> torch.Tensor:
    """The V rows an MLA write stores: the latent part of ``k``, since V is a view of K there.
    Storing them beside K writes the same bytes twice, which lets every store serve MLA.
    ``v`` may be None or that very view (what ``BackendBase.forward`` passes on)."""
    if not isinstance(k, torch.Tensor) or k.dim() != 3:
        raise InvalidInputError(
            "k.shape", f"(T, 1, {layout.head_dim})", tuple(getattr(k, "shape", ()))
        )
    latent = k[..., : layout.v_dim]
    if v is not None and not _same_view(v, latent):
        raise InvalidInputError(
            "v", "None for an MLA cache (V is the first kv_lora_rank dims of k)", "a tensor"
        )
    return latent


def _same_view(t: object, view: torch.Tensor) -> bool:
    """``t`` is ``view`` itself or the same view again (data, shape and strides)."""
    return isinstance(t, torch.Tensor) and (t.data_ptr(), t.shape, t.stride()) == (
        view.data_ptr(),
        view.shape,
        view.stride(),
    )


def quantize(
    x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None, field: str = "scale"
) -> torch.Tensor:
    """Cast ``x`` [..., Hkv, D] to the storage dtype; fp8 divides by ``scale`` ([] / [1] / [Hkv])."""
    if dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y / _broadcast_scale(scale, x.shape[-2], field)
    finfo = torch.finfo(dtype)
    return y.clamp(finfo.min, finfo.max).to(dtype)


def _broadcast_scale(scale: torch.Tensor, num_kv_heads: int, field: str) -> torch.Tensor:
    if not isinstance(scale, torch.Tensor):
        raise InvalidInputError(field, "an fp32 tensor", type(scale).__name__)
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s
    if s.numel() != num_kv_heads:
        raise InvalidInputError(field, f"shape (), (1,) or ({num_kv_heads},)", tuple(scale.shape))
    return s.view(num_kv_heads, 1)

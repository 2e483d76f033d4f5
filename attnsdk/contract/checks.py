"""Small argument checks shared by the records (``LayerSpec``, ``KVCacheLayout``, ...).

Each raises ``InvalidInputError`` naming the field, what was expected and what was found. A
``bool`` is never accepted as a number (Python counts it as an int), and floats must be finite.
"""

from __future__ import annotations

import functools
import math
import numbers

import torch

from attnsdk.contract.device import cuda_available
from attnsdk.contract.errors import InvalidInputError

__all__ = [
    "check_bool",
    "check_device",
    "check_int",
    "check_mla_dims",
    "check_positive_float",
    "check_usable_device",
    "is_int_tensor",
]

INT32_MAX = 2**31 - 1


def check_int(field: str, value: object, *, low: int = 1, high: int = INT32_MAX) -> int:
    """``value`` as an int in ``low..high``; bools, floats and strings are refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidInputError(field, f"an int in {low}..{high}", repr(value))
    if not low <= int(value) <= high:
        raise InvalidInputError(field, f"an int in {low}..{high}", int(value))
    return int(value)


def check_bool(field: str, value: object) -> bool:
    """``value`` if it is a bool (``causal="no"`` would otherwise read as True)."""
    if not isinstance(value, bool):
        raise InvalidInputError(field, "True or False", repr(value))
    return value


def check_positive_float(field: str, value: object, *, allow_zero: bool = False) -> float:
    """A finite real number > 0 (>= 0 with ``allow_zero``); inf, NaN and bools are refused."""
    ok = (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
        and (float(value) >= 0 if allow_zero else float(value) > 0)
    )
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise InvalidInputError(field, f"a finite number {bound}", repr(value))
    return float(value)  # type: ignore[arg-type]


def check_mla_dims(record: str, num_kv_heads: int, head_dim: int, v_head_dim: int | None) -> None:
    """An MLA record (``mla=True``): one KV head, and a latent (``v_head_dim``) no longer than
    ``head_dim``, whose rest is the rope key (none: rope_dim 0). ``for_mla`` builds one from
    the two dims."""
    hint = f"Build it with {record}.for_mla(..., kv_lora_rank=512, rope_dim=64)"
    if num_kv_heads != 1:
        raise InvalidInputError(
            f"{record}.num_kv_heads", "1 for MLA (one latent per token)", num_kv_heads, hint
        )
    if v_head_dim is None or not v_head_dim <= head_dim:
        raise InvalidInputError(
            f"{record}.v_head_dim",
            f"kv_lora_rank, at most head_dim={head_dim} (kv_lora_rank + rope_dim) for MLA",
            v_head_dim,
            hint,
        )


def check_device(field: str, value: object) -> torch.device:
    """``value`` as a ``torch.device``; a malformed device string or another type is refused,
    and so is an index torch cannot hold: it keeps device indices in 8 bits, so "cuda:1000"
    would silently become cuda:-24 and "cuda:256" cuda:0."""
    dev = None
    try:
        if isinstance(value, torch.device):
            dev = value
        elif isinstance(value, (str, int)) and not isinstance(value, bool):
            dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        pass
    if dev is None:
        raise InvalidInputError(
            field, "a torch.device or a device string ('cpu', 'cuda:0')", repr(value)
        )
    given = _given_index(value)
    if (given is not None and given != dev.index) or (dev.index is not None and dev.index < 0):
        raise InvalidInputError(field, "a device index in 0..127", repr(value))
    return dev


def _given_index(value: object) -> int | None:
    """The device index ``value`` spells out (``"cuda:3"``, or a bare int), before torch parses
    it; None when it names none."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and ":" in value:
        try:
            return int(value.rpartition(":")[2])
        except ValueError:
            return None
    return None


def check_usable_device(field: str, value: object) -> torch.device:
    """``check_device``, for a device the caller is about to make tensors on: one this machine
    cannot reach is refused here, named, instead of torch's AssertionError ("Torch not compiled
    with CUDA enabled") or RuntimeError. CUDA needs ``torch.cuda.is_available()`` and an index
    below the GPU count; ``cpu`` and ``meta`` (shape-only tensors) always pass."""
    dev = check_device(field, value)
    why = _unreachable(dev)
    if why is not None:
        raise InvalidInputError(field, "a device this machine has", f"{str(dev)!r}: {why}")
    return dev


def _unreachable(dev: torch.device) -> str | None:
    """Why torch cannot make a tensor on ``dev`` here, or None."""
    if dev.type in ("cpu", "meta"):
        return None
    if dev.type != "cuda":
        return _other_unreachable(dev)
    if not cuda_available():
        return "no CUDA device here (no GPU is visible, or this torch build is CPU-only)"
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        return f"this machine has {count} CUDA device(s)"
    return None


@functools.cache
def _other_unreachable(dev: torch.device) -> str | None:
    """A device of another type (mps, xpu, ...): asked once, by making an empty tensor there."""
    try:
        torch.empty(0, device=dev)
    except Exception as exc:  # torch raises RuntimeError, AssertionError, ... by backend
        return f"torch cannot make a tensor there ({type(exc).__name__}: {exc})"
    return None


def is_int_tensor(t: object) -> bool:
    """A tensor of integers: not floating point, not complex, not bool (which torch counts as
    an integer dtype, and which would silently read as 0 / 1 slots or lengths)."""
    return (
        isinstance(t, torch.Tensor)
        and not t.is_floating_point()
        and not t.is_complex()
        and t.dtype != torch.bool
    )

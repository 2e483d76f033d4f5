"""Cached device probes that answer "no" on a machine without a GPU instead of crashing."""

from __future__ import annotations

import functools

import torch


def cuda_available() -> bool:
    return _cuda_available()


@functools.cache
def _cuda_available() -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver is reported as "no GPU", not a crash
        return False


def compute_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None when there is no usable CUDA device."""
    if not cuda_available():
        return None
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():  # "cuda:7" on a machine of fewer GPUs
        return None
    return _capability(index)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor)


def device_name() -> str:
    if not cuda_available():
        return "cpu"
    return torch.cuda.get_device_name()

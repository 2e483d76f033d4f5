"""Hardware markers, skipped with what is missing: ``gpu`` needs a CUDA GPU, ``sm90`` a Hopper
GPU, ``fa3`` the FlashAttention-3 kernels the fa3 backend calls, ``flashinfer`` FlashInfer on a
GPU of compute capability 8.0 or newer.

The CPU suite runs torch on one thread: its tensors are tiny, and on a loaded two-core machine
OpenMP's spinning worker threads made it many times slower (test_random_batches: 143 s).
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from attnsdk.backends.fa3.kernels import INSTALL_COMMAND, PROVIDERS, find_provider
from attnsdk.kernels.probes import module_present

torch.set_num_threads(1)


@functools.cache
def _hardware() -> tuple[tuple[int, int] | None, str | None]:
    """(compute capability of GPU 0 or None, the FA3 provider found or None)."""
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return capability, find_provider()


def _skip_reason(item: pytest.Item) -> str | None:
    markers = {m for m in ("gpu", "sm90", "fa3") if item.get_closest_marker(m)}
    if not markers:
        return None
    capability, provider = _hardware()
    needs = "an sm90 GPU (Hopper)" if markers & {"sm90", "fa3"} else "a CUDA GPU"
    if "fa3" in markers:
        needs += f" with FlashAttention-3 kernels (flash_attn_interface: {INSTALL_COMMAND})"
    if capability is None:
        return f"needs {needs}; no CUDA GPU is visible"
    if markers & {"sm90", "fa3"} and capability[0] != 9:
        return f"needs {needs}; found sm {capability[0]}{capability[1]}"
    if "fa3" in markers and provider is None:
        return f"needs {needs}; found none of {', '.join(PROVIDERS.values())}"
    return None


def _flashinfer_skip_reason(item: pytest.Item) -> str | None:
    if not item.get_closest_marker("flashinfer"):
        return None
    capability, _ = _hardware()
    needs = "a GPU of compute capability >= 8.0 with FlashInfer (pip install flashinfer-python)"
    if capability is None:
        return f"needs {needs}; no CUDA GPU is visible"
    if capability < (8, 0):
        return f"needs {needs}; found sm {capability[0]}{capability[1]}"
    if not module_present("flashinfer"):
        return f"needs {needs}; the flashinfer module is not installed"
    return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "flashinfer: needs FlashInfer (flashinfer-python) on a GPU of compute capability >= 8.0",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = _skip_reason(item) or _flashinfer_skip_reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def mini_engine() -> Any:
    """examples/mini_engine.py as a module (an example script, not part of the package)."""
    path = Path(__file__).resolve().parents[1] / "examples" / "mini_engine.py"
    spec = importlib.util.spec_from_file_location("mini_engine", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module

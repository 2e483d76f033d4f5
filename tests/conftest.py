"""Hardware markers: ``gpu`` needs CUDA, ``sm90`` needs Hopper; both skip with the reason."""

from __future__ import annotations

import pytest
import torch


def _skip_reason(item: pytest.Item) -> str | None:
    wants_gpu = item.get_closest_marker("gpu") or item.get_closest_marker("sm90")
    if not wants_gpu:
        return None
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none visible); run tests/gpu on the H200"
    if item.get_closest_marker("sm90") and torch.cuda.get_device_capability()[0] != 9:
        major, minor = torch.cuda.get_device_capability()
        return f"needs compute capability 9.x (Hopper), found {major}.{minor}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        reason = _skip_reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))

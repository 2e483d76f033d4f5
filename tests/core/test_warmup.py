"""``BackendBase.warmup`` (attnsdk/backends/warmup.py): its two scratch steps run at every page size and
pool size; bad arguments are refused up front (tests/core/test_bad_input_matrix.py, "warmup/")."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attnsdk import KVCacheLayout, LayerSpec
from attnsdk.backends.reference import ReferenceBackend


class Recording(ReferenceBackend):
    """The reference backend, noting each warm-up step: (cache pages, seq_lens)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[tuple[int, list[int]]] = []

    def forward(self, q: Any, k: Any, v: Any, cache: Any, plan: Any, layer: Any, **kw: Any) -> Any:
        self.steps.append((cache.num_pages, plan.metadata.seq_lens_cpu.tolist()))
        return super().forward(q, k, v, cache, plan, layer, **kw)


@pytest.mark.parametrize("page_size", [1, 2, 3, 16])
@pytest.mark.parametrize("num_pages", [1, 2, 3, 4, 5, 8])
def test_warmup_runs_at_any_page_size(page_size: int, num_pages: int) -> None:
    """Page size 1 with up to 4 pages used to fail on the warm-up's own mixed step (a decode
    row after a one-token prompt needs two pages). The scratch cache has ``num_pages`` pages,
    or the 1 + 2 * ceil(2 / page_size) the two steps need."""
    backend = Recording()
    backend.prepare([LayerSpec(4, 2, 16)], KVCacheLayout(2, 16, page_size, dtype=torch.float32))
    backend.warmup("cpu", num_pages=num_pages)
    pages = max(num_pages, 1 + 2 * -(-2 // page_size))
    assert [n for n, _ in backend.steps] == [pages, pages]
    (_, prefill), (_, mixed) = backend.steps
    assert prefill[0] >= 1
    assert mixed[0] == prefill[0] + 1  # the decode row after the prompt

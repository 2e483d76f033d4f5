"""Test kit for integrators: random paged batches and reference comparisons.

Hypothesis strategies live in ``attnsdk.testing.strategies`` (needs ``hypothesis``: the ``testing``
extra).
"""

from attnsdk.testing._batch import Batch, PageOrder, assign_pages, make_batch
from attnsdk.testing._spec import BatchSpec
from attnsdk.testing._sync import forbid_device_sync
from attnsdk.testing._tolerance import assert_close_to_reference, tolerance

__all__ = [
    "Batch",
    "BatchSpec",
    "PageOrder",
    "assert_close_to_reference",
    "assign_pages",
    "forbid_device_sync",
    "make_batch",
    "tolerance",
]

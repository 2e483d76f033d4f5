"""A guard that turns every CUDA device synchronisation inside a block into an error."""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Iterator


@contextmanager
def forbid_device_sync() -> Iterator[None]:
    """Inside the block, an operation that synchronises the CUDA device raises ``RuntimeError``
    (torch's sync debug mode; its "prototype feature" warning is silenced). Work queued before
    the block is synchronised on entry, so only the block's own operations are judged. Without
    CUDA there is no device to synchronise and the block runs as it is.

    Torch documents that the mode does not catch every synchronising operation; what it catches
    (``.item()``, ``.cpu()``, ``.tolist()``, nonzero, blocking copies) is what a plan or a forward
    on the serving path must never do.
    """
    if not torch.cuda.is_available():
        yield
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Synchronization debug mode", category=UserWarning
        )
        try:
            torch.cuda.set_sync_debug_mode("error")
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")

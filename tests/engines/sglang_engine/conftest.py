"""SGLang's own code, importable on a CPU: fakes first, then the engine (tests/engines/fakes.py)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest
from fakes import install_sglang

install_sglang()
# The tests import their shared helper, real_sglang.py, from this folder.
sys.path.insert(0, str(Path(__file__).resolve().parent))

SGLANG_VERSION = importlib.metadata.version("sglang")
NEW_HOOKS = not SGLANG_VERSION.startswith("0.5.12")
"""SGLang 0.5.13+: pools on the backend, init_forward_metadata_out_graph / _in_graph."""


def pytest_report_header() -> str:
    return (
        f"sglang {SGLANG_VERSION} from {importlib.metadata.distribution('sglang').locate_file('')}"
    )


@pytest.fixture(autouse=True)
def _no_grad():
    # SGLang's CPU KV store (k_cache[loc] = k on views of one buffer) fails under autograd.
    import torch

    with torch.no_grad():
        yield

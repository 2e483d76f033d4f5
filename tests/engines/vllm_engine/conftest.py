"""vLLM's own code on a CPU: its platform patched before anything reads it (tests/engines/fakes.py).

attnsdk's drop-in, bound to the reference backend (``vllm_engine.attnsdk_ref.Ref``), is vLLM's
``AttentionBackendEnum.CUSTOM`` for every test; ``use_custom_backend`` swaps it for one test.
"""

from __future__ import annotations

import importlib.metadata
from typing import TYPE_CHECKING

import pytest
from fakes import install_vllm

install_vllm()

from vllm.v1.attention import selector  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm_engine.attnsdk_ref import REF, Ref  # noqa: E402

import attnsdk.adapters.vllm as attnsdk_vllm  # noqa: E402

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

VLLM_VERSION = importlib.metadata.version("vllm")
CUSTOM = attnsdk_vllm.register(REF)
assert CUSTOM is AttentionBackendEnum.CUSTOM


def pytest_report_header() -> str:
    return f"vllm {VLLM_VERSION} from {importlib.metadata.distribution('vllm').locate_file('')}"


@pytest.fixture(autouse=True)
def _custom_is_ref() -> Iterator[None]:
    """Every test starts with CUSTOM -> Ref and an empty selector cache (vLLM memoises it)."""
    attnsdk_vllm.register(REF)
    selector._cached_get_attn_backend.cache_clear()
    assert AttentionBackendEnum.CUSTOM.get_class() is Ref
    yield
    attnsdk_vllm.register(REF)
    selector._cached_get_attn_backend.cache_clear()


@pytest.fixture
def use_custom_backend() -> Callable[[str], type]:
    """Register another class path as CUSTOM for the rest of the test; returns its class."""

    def use(class_path: str) -> type:
        attnsdk_vllm.register(class_path)
        selector._cached_get_attn_backend.cache_clear()
        return AttentionBackendEnum.CUSTOM.get_class()

    return use

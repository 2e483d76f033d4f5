"""The public API is exactly ``__all__``: a change to it is a deliberate edit of this file."""

from __future__ import annotations

from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import attnsdk
import attnsdk.testing

if TYPE_CHECKING:
    from types import ModuleType

PUBLIC = [
    "AttentionConfig",
    "AttentionMetadata",
    "AttnSDKError",
    "AutoOptions",
    "Backend",
    "BackendBase",
    "BackendClass",
    "BackendUnavailableError",
    "Capabilities",
    "Feature",
    "GraphBuffers",
    "GraphHooks",
    "GraphRunner",
    "GraphSupport",
    "InvalidInputError",
    "InvalidMetadataError",
    "KVCache",
    "KVCacheLayout",
    "KVOrder",
    "LayerSpec",
    "NoOptions",
    "Plan",
    "Reason",
    "ReasonKind",
    "Registration",
    "Request",
    "UnsupportedConfigError",
    "backend_names",
    "create_backend",
    "explain",
    "merge_states",
    "register_backend",
    "tree_mask_from_parents",
]

TESTING_PUBLIC = [
    "Batch",
    "BatchSpec",
    "PageOrder",
    "assert_close_to_reference",
    "assign_pages",
    "forbid_device_sync",
    "make_batch",
    "tolerance",
]


@pytest.mark.parametrize(
    ("module", "expected"), [(attnsdk, PUBLIC), (attnsdk.testing, TESTING_PUBLIC)]
)
def test_all_is_pinned_and_sorted(module: ModuleType, expected: list[str]) -> None:
    names = list(module.__all__)
    assert names == expected
    assert names == sorted(names)
    assert len(set(names)) == len(names)


@pytest.mark.parametrize(
    ("module", "name"),
    [(attnsdk, n) for n in PUBLIC] + [(attnsdk.testing, n) for n in TESTING_PUBLIC],
)
def test_every_public_name_resolves(module: ModuleType, name: str) -> None:
    assert getattr(module, name) is not None


def test_star_import_gives_exactly_all() -> None:
    namespace: dict[str, object] = {}
    exec("from attnsdk import *", namespace)
    assert sorted(k for k in namespace if k != "__builtins__") == PUBLIC


def test_error_tree() -> None:
    assert issubclass(attnsdk.UnsupportedConfigError, attnsdk.AttnSDKError)
    assert issubclass(attnsdk.UnsupportedConfigError, ValueError)
    assert issubclass(attnsdk.BackendUnavailableError, attnsdk.AttnSDKError)
    assert issubclass(attnsdk.BackendUnavailableError, ImportError)
    assert issubclass(attnsdk.InvalidMetadataError, attnsdk.AttnSDKError)
    assert issubclass(attnsdk.InvalidMetadataError, ValueError)
    assert issubclass(attnsdk.InvalidInputError, attnsdk.AttnSDKError)
    assert issubclass(attnsdk.InvalidInputError, ValueError)


def test_version_matches_distribution() -> None:
    assert attnsdk.__version__ == version("attnsdk")


def test_py_typed_is_shipped() -> None:
    assert (Path(attnsdk.__file__).parent / "py.typed").is_file()

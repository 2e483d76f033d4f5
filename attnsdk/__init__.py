"""attnsdk: one backend-neutral paged-attention contract for LLM serving engines.

Read docs/architecture.md for how the pieces fit. The public API is exactly ``__all__``.
"""

from attnsdk.backends.base import BackendBase, GraphHooks
from attnsdk.backends.graphs import GraphRunner
from attnsdk.contract.backend import Backend, BackendClass, NoOptions
from attnsdk.contract.capabilities import Capabilities, Feature, GraphSupport, Request
from attnsdk.contract.errors import (
    AttnSDKError,
    BackendUnavailableError,
    InvalidInputError,
    InvalidMetadataError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.contract.kv import KVCache, KVCacheLayout, KVOrder
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.contract.plan import GraphBuffers, Plan
from attnsdk.features.tree import tree_mask_from_parents
from attnsdk.kernels.merge import merge_states
from attnsdk.selection.config import AttentionConfig, AutoOptions
from attnsdk.selection.create import create_backend, explain
from attnsdk.selection.registry import Registration, backend_names, register_backend

__version__ = "0.1.0"

__all__ = [
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

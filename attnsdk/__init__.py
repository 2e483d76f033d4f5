"""attnsdk: one backend-neutral paged-attention contract for LLM serving engines.

Read docs/architecture.md for how the pieces fit. The public API is exactly ``__all__``.
"""

from attnsdk._backend import Backend, Plan
from attnsdk._base import BackendBase, BackendClass, NoOptions
from attnsdk._capabilities import Capabilities, Feature, GraphSupport, Reason, ReasonKind
from attnsdk._config import AttentionConfig, AutoOptions
from attnsdk._create import create_backend, explain
from attnsdk._errors import (
    AttnSDKError,
    BackendUnavailableError,
    InvalidInputError,
    InvalidMetadataError,
    UnsupportedConfigError,
)
from attnsdk._graph import GraphBuffers, GraphHooks
from attnsdk._kv import KVCache, KVCacheLayout, KVOrder
from attnsdk._layer import LayerSpec
from attnsdk._merge import merge_states
from attnsdk._metadata import AttentionMetadata
from attnsdk._registry import Registration, backend_names, register_backend
from attnsdk._tree import tree_mask_from_parents
from attnsdk.graphs import GraphRunner

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
    "UnsupportedConfigError",
    "backend_names",
    "create_backend",
    "explain",
    "merge_states",
    "register_backend",
    "tree_mask_from_parents",
]

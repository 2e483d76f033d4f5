"""Declarative backend capabilities, the ``Request`` every "can it serve this?" question is,
and the one generic check that turns a request and the capabilities into reasons.

One refusal path: ``explain``, "auto", ``routed``, ``prepare`` and the checks ``forward`` /
``forward_ragged`` run before writing anything all ask a backend ``refusals(Request(...))``
(``BackendBase.refusals``: the environment, ``capability_reasons``, the feature modules'
rules, then the backend's own), so the answer to a question is the same whoever asks it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.device import compute_capability, cuda_available
from attnsdk.contract.errors import Reason, ReasonKind
from attnsdk.contract.kv import FP8_KV_DTYPES, KVCacheLayout, KVOrder

if TYPE_CHECKING:
    from pydantic import BaseModel

    from attnsdk.contract.layer import LayerSpec
    from attnsdk.contract.metadata import AttentionMetadata

__all__ = [
    "STEP_FEATURES",
    "Capabilities",
    "Feature",
    "GraphSupport",
    "Request",
    "capability_reasons",
    "missing_features",
    "step_uses",
]


class Feature(str, enum.Enum):
    """Optional semantics of DESIGN §2 that a backend may or may not implement.

    All but the ``STEP_FEATURES`` are properties of a layer (``capability_reasons`` checks them
    against a ``LayerSpec``). Those four are asked for by a call or a step, and a ``Request``
    lists them in ``uses``: ``LSE`` by passing ``lse=``, ``RAGGED`` by calling
    ``forward_ragged``, ``TREE_MASK`` and ``CROSS_ATTENTION`` by a step whose metadata has a
    ``tree_mask`` or ``cross_attention`` (``step_uses``).
    """

    GQA = "gqa"
    SLIDING_WINDOW = "sliding_window"
    SOFTCAP = "softcap"
    SINKS = "sinks"
    NON_CAUSAL = "non_causal"
    FP8_KV = "fp8_kv"
    DIFFERENT_V_HEAD_DIM = "different_v_head_dim"
    LSE = "lse"
    """``forward(..., lse=)`` fills the per-head log-sum-exp of each query row."""
    CHUNKED_LOCAL = "chunked_local"
    """``LayerSpec.attention_chunk_size``: queries see only keys of their own chunk."""
    TREE_MASK = "tree_mask"
    """``AttentionMetadata.tree_mask``: speculative-tree verify steps (``attnsdk.features.tree``)."""
    CROSS_ATTENTION = "cross_attention"
    """``AttentionMetadata.cross_attention``: steps over an encoder's keys (``attnsdk.features.cross``)."""
    MLA = "mla"
    """``LayerSpec.mla`` over a ``KVCacheLayout.mla`` latent cache (V is part of K)."""
    RAGGED = "ragged"
    """``forward_ragged``: attention over K/V given in the call, no cache (``attnsdk.features.ragged``)."""


class GraphSupport(enum.IntEnum):
    """How much of a step a backend can run inside a captured CUDA graph."""

    NONE = 0
    """Not capturable."""
    DECODE_ONLY = 1
    """Uniform one-token-per-sequence batches."""
    UNIFORM_BATCH = 2
    """Uniform query lengths (decode, speculative verify)."""
    ANY_BATCH = 3
    """Mixed prefill / decode batches too."""


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, as data. ``capability_reasons`` checks a request against it."""

    devices: frozenset[str]
    """Device types it runs on ("cpu", "cuda")."""
    dtypes: frozenset[torch.dtype]
    """Compute dtypes of q / k / v / output."""
    kv_dtypes: frozenset[torch.dtype]
    """Extra cache storage dtypes beyond the compute dtype (fp8 needs ``Feature.FP8_KV``)."""
    max_head_dim: int
    head_dim_multiple: int = 1
    min_page_size: int = 1
    page_size_multiple: int = 1
    orders: frozenset[KVOrder] = frozenset({KVOrder.NHD})
    min_compute_capability: tuple[int, int] | None = None
    """For CUDA devices: lowest (major, minor) supported."""
    max_compute_capability: tuple[int, int] | None = None
    """For CUDA devices: highest (major, minor) supported."""
    features: frozenset[Feature] = field(default_factory=frozenset)
    graph_support: GraphSupport = GraphSupport.NONE
    mla_dims: frozenset[tuple[int, int]] | None = None
    """With ``Feature.MLA``: the (kv_lora_rank, rope_dim) pairs its MLA kernels take, which
    then replace the ``max_head_dim`` check for MLA layers (they split q and K in two). None:
    MLA layers are checked against ``max_head_dim`` like any other."""


STEP_FEATURES = frozenset({Feature.LSE, Feature.RAGGED, Feature.TREE_MASK, Feature.CROSS_ATTENTION})
"""The features a call or a step asks for (``Request.uses``), not a layer."""


@dataclass(frozen=True, slots=True)
class Request:
    """What a backend is asked to serve: a layer over a cache layout on a device, with the
    backend's options and the step features the call uses. Any field may be None (not asked):
    ``Request(device=...)`` asks whether the backend runs there at all.

    >>> Request(uses=frozenset({Feature.LSE})).uses == {Feature.LSE}
    True
    """

    layer: LayerSpec | None = None
    layout: KVCacheLayout | None = None
    """The cache the layer reads; None in a ragged call (``Feature.RAGGED``: no cache)."""
    device: torch.device | None = None
    """None: where the backend runs by default (``default_device``)."""
    options: BaseModel | None = None
    """The backend's options model instance; None: its defaults."""
    uses: frozenset[Feature] = frozenset()
    """Step features asked for (a subset of ``STEP_FEATURES``)."""
    dtype: torch.dtype | None = None
    """The compute dtype when there is no layout to carry it (a ragged call: q's dtype)."""

    @property
    def mla(self) -> bool:
        """Whether the layer or the layout asks for MLA."""
        return is_mla(self.layer, self.layout)

    def named(self, prefix: str, reasons: list[Reason]) -> list[Reason]:
        """``reasons`` with each field prefixed (``layers[3].softcap``, ``decode.lse``)."""
        return [Reason(r.kind, f"{prefix}.{r.field}", r.message) for r in reasons]


def step_uses(
    meta: AttentionMetadata, *, lse: bool = False, ragged: bool = False
) -> frozenset[Feature]:
    """The step features a forward over ``meta`` uses: its tree mask and cross-attention flag,
    and ``lse=`` / ``forward_ragged`` as the call says."""
    uses = set()
    if meta.tree_mask is not None:
        uses.add(Feature.TREE_MASK)
    if meta.cross_attention:
        uses.add(Feature.CROSS_ATTENTION)
    if lse:
        uses.add(Feature.LSE)
    if ragged:
        uses.add(Feature.RAGGED)
    return frozenset(uses)


def is_mla(layer: LayerSpec | None, layout: KVCacheLayout | None) -> bool:
    """Whether the layer or the layout (either may be None) asks for MLA."""
    return (layer is not None and layer.mla) or (layout is not None and layout.mla)


def default_device(caps: Capabilities) -> torch.device:
    """Where a backend runs when no device is named: CUDA when it can use CUDA and this machine
    has a GPU (or it runs nowhere else), else the CPU."""
    if "cuda" in caps.devices and (cuda_available() or "cpu" not in caps.devices):
        return torch.device("cuda")
    return torch.device("cpu")


def device_reasons(caps: Capabilities, device: torch.device | str | None) -> list[Reason]:
    """Environment reasons: the device type and its compute capability."""
    env = ReasonKind.ENVIRONMENT
    dev = torch.device(device) if device is not None else default_device(caps)
    if dev.type not in caps.devices:
        return [Reason(env, "device", f"must be one of {sorted(caps.devices)}, found {dev.type!r}")]
    if dev.type != "cuda":
        return []
    cc = compute_capability(dev)
    if cc is None:
        count = torch.cuda.device_count() if cuda_available() else 0
        if count:  # an index past the GPUs this machine has
            return [Reason(env, "device", f"must be one of the {count} CUDA devices, found {dev}")]
        return [Reason(env, "device", "needs a CUDA GPU, but none is visible")]
    reasons = []
    if caps.min_compute_capability is not None and cc < caps.min_compute_capability:
        reasons.append(
            Reason(
                env,
                "compute_capability",
                f"must be >= {_cc(caps.min_compute_capability)}, found {_cc(cc)}",
            )
        )
    if caps.max_compute_capability is not None and cc > caps.max_compute_capability:
        reasons.append(
            Reason(
                env,
                "compute_capability",
                f"must be <= {_cc(caps.max_compute_capability)}, found {_cc(cc)}",
            )
        )
    return reasons


def capability_reasons(caps: Capabilities, request: Request) -> list[Reason]:
    """Every way ``request`` exceeds ``caps``, environment first: the device, the layout's
    dtypes, page size and order, the dims, the layer's features, and each step feature in
    ``request.uses`` (cross-attention is also served by ragged attention alone, for ragged
    calls)."""
    cfg = ReasonKind.CONFIGURATION
    layer, layout = request.layer, request.layout
    reasons = device_reasons(caps, request.device)
    f = caps.features
    if layout is not None:
        if layout.dtype not in caps.dtypes:
            reasons.append(
                Reason(cfg, "dtype", f"must be one of {_names(caps.dtypes)}, found {layout.dtype}")
            )
        if layout.storage_dtype != layout.dtype:
            if layout.storage_dtype not in caps.kv_dtypes:
                reasons.append(
                    Reason(
                        cfg,
                        "kv_dtype",
                        f"must be one of {_names(caps.kv_dtypes)}, found {layout.storage_dtype}",
                    )
                )
            elif layout.storage_dtype in FP8_KV_DTYPES and Feature.FP8_KV not in f:
                reasons.append(Reason(cfg, "kv_dtype", "fp8 KV storage is not supported"))
        if layout.page_size < caps.min_page_size or layout.page_size % caps.page_size_multiple:
            reasons.append(
                Reason(
                    cfg,
                    "page_size",
                    f"must be >= {caps.min_page_size} and a multiple of {caps.page_size_multiple}, "
                    f"found {layout.page_size}",
                )
            )
        if layout.kv_order not in caps.orders:
            orders = sorted(o.value for o in caps.orders)
            reasons.append(
                Reason(cfg, "order", f"must be one of {orders}, found {layout.kv_order.value!r}")
            )
    elif request.dtype is not None and request.dtype not in caps.dtypes:
        reasons.append(
            Reason(cfg, "dtype", f"must be one of {_names(caps.dtypes)}, found {request.dtype}")
        )
    dims: dict[str, int] = {}
    if layer is not None:
        dims.update(head_dim=layer.head_dim, v_head_dim=layer.v_dim)
    if layout is not None:
        dims.update(head_dim=layout.head_dim, v_head_dim=layout.v_dim)
    mla = request.mla
    if mla:
        reasons += _mla_reasons(caps, layer, layout, dims)
    for name, d in dims.items() if not (mla and caps.mla_dims is not None) else ():
        if d > caps.max_head_dim or d % caps.head_dim_multiple:
            reasons.append(
                Reason(
                    cfg,
                    name,
                    f"must be <= {caps.max_head_dim} and a multiple of {caps.head_dim_multiple}, found {d}",
                )
            )
    if dims and dims["head_dim"] != dims["v_head_dim"] and Feature.DIFFERENT_V_HEAD_DIM not in f:
        reasons.append(
            Reason(cfg, "v_head_dim", f"must equal head_dim, found {dims['v_head_dim']}")
        )
    if layer is not None:
        wants = {
            Feature.GQA: layer.num_heads != layer.num_kv_heads,
            Feature.SLIDING_WINDOW: layer.sliding_window is not None,
            Feature.SOFTCAP: layer.has_softcap,
            Feature.SINKS: layer.has_sinks,
            Feature.NON_CAUSAL: not layer.causal,
            Feature.CHUNKED_LOCAL: layer.attention_chunk_size is not None,
        }
        for feat, wanted in wants.items():
            if wanted and feat not in f:
                name = _FEATURE_FIELDS.get(feat, feat.value)
                reasons.append(Reason(cfg, name, "is not supported by this backend"))
    if layer is not None and layout is not None:
        # The cache must hold what the layer attends over (forward checks the same).
        for name, mine, theirs in (
            ("num_kv_heads", layer.num_kv_heads, layout.num_kv_heads),
            ("head_dim", layer.head_dim, layout.head_dim),
            ("v_head_dim", layer.v_dim, layout.v_dim),
        ):
            if mine != theirs:
                reasons.append(
                    Reason(cfg, name, f"layer has {mine} but the KV layout has {theirs}")
                )
    reasons += missing_features(caps, request.uses)
    return sorted(reasons)


def missing_features(caps: Capabilities, uses: frozenset[Feature]) -> list[Reason]:
    """The step features in ``uses`` that ``caps`` does not declare (a cross-attention step
    of a ragged call needs only ``Feature.RAGGED``: its keys come with the call)."""
    reasons = []
    for feat in sorted(uses - caps.features, key=lambda x: x.value):
        if feat is Feature.CROSS_ATTENTION and Feature.RAGGED in uses:
            continue
        reasons.append(Reason(_STEP_KIND[feat], feat.value, _STEP_WHY[feat]))
    return reasons


def _mla_reasons(
    caps: Capabilities,
    layer: LayerSpec | None,
    layout: KVCacheLayout | None,
    dims: dict[str, int],
) -> list[Reason]:
    """An MLA layer or layout: the feature, the pair of dims, and both sides saying MLA."""
    cfg = ReasonKind.CONFIGURATION
    if Feature.MLA not in caps.features:
        return [Reason(cfg, "mla", "is not supported by this backend")]
    reasons = []
    if layer is not None and layout is not None and layer.mla != layout.mla:
        reasons.append(
            Reason(cfg, "mla", f"layer has {layer.mla} but the KV layout has {layout.mla}")
        )
    pair = (dims["v_head_dim"], dims["head_dim"] - dims["v_head_dim"])
    if caps.mla_dims is not None and pair not in caps.mla_dims:
        reasons.append(
            Reason(
                cfg,
                "mla",
                f"(kv_lora_rank, rope_dim) must be one of {sorted(caps.mla_dims)}, found {pair}",
            )
        )
    return reasons


_STEP_KIND = {
    Feature.LSE: ReasonKind.CONFIGURATION,
    Feature.RAGGED: ReasonKind.CONFIGURATION,
    Feature.TREE_MASK: ReasonKind.BATCH,
    Feature.CROSS_ATTENTION: ReasonKind.BATCH,
}
_STEP_WHY = {
    Feature.LSE: "is not supported by this backend",
    Feature.RAGGED: "forward_ragged (K/V given in the call) is not supported by this backend",
    Feature.TREE_MASK: "is not supported by this backend",
    Feature.CROSS_ATTENTION: "is not supported by this backend",
}
"""How a step feature a backend lacks is refused (field: the feature's name)."""

_FEATURE_FIELDS = {Feature.CHUNKED_LOCAL: "attention_chunk_size"}
"""Features a reason names by the ``LayerSpec`` field that asks for them (the others by their
own value, as they always were)."""


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


def _names(dtypes: frozenset[torch.dtype]) -> list[str]:
    return sorted(str(d) for d in dtypes)

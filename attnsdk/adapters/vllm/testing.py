"""Test doubles of vLLM's batch objects, built from an attnsdk ``BatchSpec`` (no vLLM needed).

They follow vLLM 0.33/0.34's conventions (the engine tier, tests/engines, checks them field by
field against vLLM's own classes): block 0 is the null block, every request's blocks are
shuffled over 1..N-1, the block table is wider than needed (zero-filled), CUDA-graph padding
requests have query length 0, seq_len 0 and a row of null blocks, padding token rows have slot
-1, and one layer's cache is the ``[num_blocks, Hkv, block_size, 2 * head_size]`` view (K‖V)
over a buffer in one of vLLM's six physical layouts. ``BatchSpec`` padding rows (``padded``)
keep their lengths, read the null block and write nothing.

>>> from attnsdk.testing import BatchSpec
>>> batch = mock_vllm_batch(BatchSpec.decode(batch_size=2), pad_requests=1)
>>> tuple(batch.kv_cache.shape[1:]), batch.common_attn_metadata.num_reqs
((2, 16, 128), 3)

What a builder reads at start-up (its KV-cache group's spec, and the ``VllmConfig`` whose
``static_forward_context`` maps layer names to layers and their impls) has doubles too:
``FullAttentionSpec``, ``EncoderOnlyAttentionSpec`` (named as vLLM's: builders tell the kind
of a group by its spec's class) and ``mock_vllm_config``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from attnsdk.adapters.vllm._layout import VLLMKVLayout, as_kv_layout, fp8_storage_dtype
from attnsdk.contract.errors import InvalidInputError
from attnsdk.contract.kv import quantize
from attnsdk.testing import BatchSpec, assign_pages

__all__ = [
    "PHYSICAL_LAYOUTS",
    "VLLM_BATCH_SPECS",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "MockAttention",
    "MockAttentionLayer",
    "MockCommonAttentionMetadata",
    "MockCompilationConfig",
    "MockModelConfig",
    "MockVllmConfig",
    "VLLMMockBatch",
    "make_kv_cache",
    "mock_common_attn_metadata",
    "mock_vllm_batch",
    "mock_vllm_config",
]

VLLM_BATCH_SPECS: dict[str, BatchSpec] = {
    spec.name: spec
    for spec in (
        BatchSpec((1, 1), (32, 40), "small_decode"),
        BatchSpec((8, 8), (32, 40), "small_prefill"),
        BatchSpec((1, 1, 5, 5), (32, 40, 48, 56), "mixed_small"),
        BatchSpec((1,) * 8, (128, 256, 512, 1024) * 2, "medium_decode"),
        BatchSpec((16,) * 4, (256, 512, 1024, 2048), "medium_prefill"),
        BatchSpec((1, 1, 1, 7, 7, 7), (512, 1024, 2048) * 2, "mixed_medium"),
        BatchSpec((1,) * 32, (2048,) * 32, "large_decode"),
        BatchSpec((32,) * 8, (4096,) * 8, "large_prefill"),
        BatchSpec((1, 1, 1, 32, 32, 32), (1024, 2048, 4096) * 2, "mixed_large"),
        BatchSpec((1,), (1024,), "single_decode"),
        BatchSpec((64,), (1024,), "single_prefill"),
        BatchSpec((32, 64, 128, 256), (32, 64, 128, 256), "small_encoder_prefill"),
        BatchSpec((256, 512, 1024, 2048), (256, 512, 1024, 2048), "medium_encoder_prefill"),
    )
}
"""The 13 batch shapes of vLLM's own attention-backend tests (tests/v1/attention), by name.

``*_prefill`` with seq_len > query_len are chunked prefills over a cached context; the encoder
prefill is run non-causally (``causal=False``)."""

PHYSICAL_LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
"""vLLM's ``KVCacheLayout`` members: memory order of the logical [L, B, H, N, C] axes (layers,
blocks, KV heads, tokens in a block, K‖V content). LBNHC (token-major, "NHD") is vLLM's
default; the B-first ones interleave layers inside a block."""


@dataclass
class MockCommonAttentionMetadata:
    """vLLM 0.33/0.34's ``CommonAttentionMetadata`` fields that attention backends read (a
    mutable dataclass, as vLLM's is: its runners set ``causal`` and more on it)."""

    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    causal: bool | torch.Tensor = True
    seq_lens_cpu_upper_bound: torch.Tensor | None = None
    """Host copy of ``seq_lens`` (exact outside async speculative decoding)."""


@dataclass
class MockAttentionLayer:
    """The attributes vLLM's ``Attention`` layer exposes to an impl: fp32 scales and their
    host mirrors."""

    _k_scale: torch.Tensor
    _v_scale: torch.Tensor
    _q_scale: torch.Tensor
    _k_scale_float: float = 1.0
    _v_scale_float: float = 1.0
    _q_scale_float: float = 1.0


@dataclass(frozen=True)
class FullAttentionSpec:
    """vLLM's ``FullAttentionSpec`` (a KV-cache group of decoder layers), the fields a builder
    reads: ``block_size`` is the kernel block size vLLM hands the builder."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec:
    """vLLM's ``EncoderOnlyAttentionSpec``: the group of encoder-only layers (no KV cache)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


@dataclass
class MockAttention:
    """A ``static_forward_context`` entry: vLLM's ``Attention`` layer, with its impl."""

    impl: Any
    kv_sharing_target_layer_name: str | None = None


@dataclass
class MockModelConfig:
    dtype: torch.dtype
    """The model's compute dtype (vLLM resolves "auto" to a ``torch.dtype``)."""


@dataclass
class MockCompilationConfig:
    static_forward_context: dict[str, Any] = field(default_factory=dict)
    """Layer name -> layer, as vLLM's layers register themselves when they are built."""


@dataclass
class MockVllmConfig:
    """The ``VllmConfig`` fields a builder reads."""

    model_config: MockModelConfig
    compilation_config: MockCompilationConfig
    speculative_config: Any = None


def mock_vllm_config(impls: dict[str, Any], dtype: torch.dtype = torch.float32) -> MockVllmConfig:
    """A ``VllmConfig`` whose ``static_forward_context`` holds a layer per name of ``impls``,
    with that impl (e.g. ``AttnSDKAttentionImpl`` instances)."""
    context = {name: MockAttention(impl) for name, impl in impls.items()}
    return MockVllmConfig(MockModelConfig(dtype), MockCompilationConfig(context))


@dataclass(frozen=True, slots=True)
class VLLMMockBatch:
    """One step as vLLM hands it to an attention backend, plus what tests need to check it."""

    spec: BatchSpec
    common_attn_metadata: MockCommonAttentionMetadata
    kv_cache: torch.Tensor
    """One layer's cache in ``layout`` (uint8 storage for fp8, like vLLM)."""
    layout: VLLMKVLayout
    block_size: int
    query: torch.Tensor
    """(T + pad_tokens, Hq, D) in the compute dtype."""
    key: torch.Tensor
    """(T + pad_tokens, Hkv, D)."""
    value: torch.Tensor
    layer: MockAttentionLayer
    sinks: torch.Tensor | None
    """(Hq,) fp32 when asked for."""
    block_table: torch.Tensor
    """Host copy of the block table (num_reqs, W)."""


def make_kv_cache(
    k_nhd: torch.Tensor,
    v_nhd: torch.Tensor,
    layout: VLLMKVLayout | str = VLLMKVLayout.PACKED,
    physical: str = "LBNHC",
    *,
    num_layers: int = 1,
    layer: int = 0,
) -> torch.Tensor:
    """One layer's cache tensor holding K and V ([N, P, Hkv, D] each).

    ``PACKED`` (vLLM 0.29+): the ``[N, Hkv, P, 2D]`` view of layer ``layer`` in a buffer of
    ``num_layers`` layers stored in the ``physical`` order (``PHYSICAL_LAYOUTS``), as vLLM's
    ``create_kv_cache_views`` makes it. ``KV_BLOCKS`` / ``BLOCKS_KV``: the older 5-D layouts,
    contiguous (forks that still use them). fp8 inputs are stored as uint8, as vLLM allocates.
    """
    layout = as_kv_layout(layout)
    n, p, h, d = k_nhd.shape
    dev, dt = k_nhd.device, k_nhd.dtype
    if layout is VLLMKVLayout.KV_BLOCKS:
        t = torch.stack([k_nhd, v_nhd])
    elif layout is VLLMKVLayout.BLOCKS_KV:
        t = torch.stack([k_nhd, v_nhd], dim=1)
    else:
        if physical not in PHYSICAL_LAYOUTS:
            raise InvalidInputError("physical", f"one of {sorted(PHYSICAL_LAYOUTS)}", physical)
        order = PHYSICAL_LAYOUTS[physical]
        logical = (num_layers, n, h, p, 2 * d)
        memory = torch.zeros(tuple(logical[i] for i in order), dtype=dt, device=dev)
        full = memory.permute(*(order.index(i) for i in range(5)))  # back to [L, B, H, N, C]
        t = full[layer]
        t[..., :d] = k_nhd.transpose(1, 2)
        t[..., d:] = v_nhd.transpose(1, 2)
    return t.view(torch.uint8) if dt in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def mock_vllm_batch(
    spec: BatchSpec,
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    layout: VLLMKVLayout | str = VLLMKVLayout.PACKED,
    physical: str = "LBNHC",
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
    pad_requests: int = 0,
    pad_tokens: int = 0,
    causal: bool = True,
    host_seq_lens: bool = True,
    sinks: bool = False,
    spare_blocks: int = 3,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> VLLMMockBatch:
    """A random step for ``spec`` as vLLM would hand it over (see the module docstring).

    ``pad_requests`` appends CUDA-graph padding requests; ``pad_tokens`` appends query rows past
    ``num_actual_tokens`` (slot -1). Every cache slot starts random, so stray reads show up.
    """
    gen = torch.Generator().manual_seed(seed)
    layout = as_kv_layout(layout)
    cm, table, num_blocks = _metadata(
        spec, block_size, pad_requests, pad_tokens, causal, host_seq_lens, spare_blocks, gen, device
    )
    fp8 = fp8_storage_dtype(kv_cache_dtype)
    scales = (0.5 + torch.rand(2, generator=gen)) if fp8 is not None else torch.ones(2)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_nhd = quantize(torch.randn(shape, generator=gen), fp8 or dtype, scales[0] if fp8 else None)
    v_nhd = quantize(torch.randn(shape, generator=gen), fp8 or dtype, scales[1] if fp8 else None)
    rows = spec.num_tokens + pad_tokens

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(device, dtype)

    return VLLMMockBatch(
        spec=spec,
        common_attn_metadata=cm,
        # Layer 1 of a two-layer buffer: in the B-first layouts its blocks interleave with
        # another layer's, as in vLLM's cross-layer layouts.
        kv_cache=make_kv_cache(
            k_nhd.to(device), v_nhd.to(device), layout, physical, num_layers=2, layer=1
        ),
        layout=layout,
        block_size=block_size,
        query=randn(rows, num_heads, head_size),
        key=randn(rows, num_kv_heads, head_size),
        value=randn(rows, num_kv_heads, head_size),
        layer=MockAttentionLayer(
            _k_scale=scales[0].reshape(()).to(device),
            _v_scale=scales[1].reshape(()).to(device),
            _q_scale=torch.ones((), device=device),
            _k_scale_float=float(scales[0]),
            _v_scale_float=float(scales[1]),
        ),
        sinks=torch.randn(num_heads, generator=gen).to(device) if sinks else None,
        block_table=table,
    )


def mock_common_attn_metadata(
    spec: BatchSpec,
    *,
    block_size: int = 16,
    pad_requests: int = 0,
    pad_tokens: int = 0,
    causal: bool = True,
    host_seq_lens: bool = True,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> MockCommonAttentionMetadata:
    """Only the ``CommonAttentionMetadata`` of ``mock_vllm_batch`` (same arguments)."""
    gen = torch.Generator().manual_seed(seed)
    cm, _, _ = _metadata(
        spec, block_size, pad_requests, pad_tokens, causal, host_seq_lens, 3, gen, device
    )
    return cm


def _metadata(
    spec: BatchSpec,
    block_size: int,
    pad_requests: int,
    pad_tokens: int,
    causal: bool,
    host: bool,
    spare_blocks: int,
    gen: torch.Generator,
    device: torch.device | str,
) -> tuple[MockCommonAttentionMetadata, torch.Tensor, int]:
    p = block_size
    query_lens = [*spec.query_lens, *([0] * pad_requests)]
    seq_lens = [*spec.seq_lens, *([0] * pad_requests)]
    padded = [*spec.padded, *([True] * pad_requests)]
    blocks_per_req = [0 if pad else -(-s // p) for s, pad in zip(seq_lens, padded)]
    num_blocks = sum(blocks_per_req) + 1 + spare_blocks
    assigned = assign_pages(blocks_per_req, num_blocks, "shuffled", gen)
    # vLLM's table has max_num_blocks_per_req columns; unused ones hold the null block 0.
    width = max([1, *(-(-s // p) for s in seq_lens)]) + 2
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, row in enumerate(assigned):
        table[b, : len(row)] = torch.tensor(row, dtype=torch.int32)
    slots: list[int] = []
    for b, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s - q, s):
            slots.append(-1 if padded[b] else int(table[b, pos // p]) * p + pos % p)
    slots += [-1] * pad_tokens
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(query_lens, dtype=torch.int32), 0, out=qsl[1:])
    s_cpu = torch.tensor(seq_lens, dtype=torch.int32)
    cm = MockCommonAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=s_cpu.to(device),
        num_reqs=len(seq_lens),
        num_actual_tokens=spec.num_tokens,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_table_tensor=table.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64).to(device),
        causal=causal,
        seq_lens_cpu_upper_bound=s_cpu.clone() if host else None,
    )
    return cm, table, num_blocks

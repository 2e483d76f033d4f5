"""SGLang's engine objects as test doubles: ``ForwardMode``, a ``RadixAttention``, the pools, the
model, the ``ModelRunner`` and the ``ForwardBatch``, with SGLang 0.5.23's attribute names, dtypes
and conventions (public through ``attnsdk.adapters.sglang.testing``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    import torch

    from attnsdk.contract.layer import LayerSpec

__all__ = [
    "AttentionType",
    "ForwardMode",
    "MockForwardBatch",
    "MockKVPool",
    "MockModel",
    "MockModelConfig",
    "MockModelRunner",
    "MockRadixAttention",
    "MockReqToTokenPool",
    "VerifyInput",
]


class ForwardMode(enum.IntEnum):
    """SGLang's ``ForwardMode`` (0.5.23 ``forward_batch_info.py``): members and predicates."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()
    PREBUILT = enum.auto()
    SPLIT_PREFILL = enum.auto()
    DLLM_EXTEND = enum.auto()

    def is_prefill(self, include_draft_extend_v2: bool = False) -> bool:
        return self.is_extend(include_draft_extend_v2=include_draft_extend_v2)

    def is_extend(self, include_draft_extend_v2: bool = False) -> bool:
        # As in SGLang: true for every mode whose rows carry several new tokens.
        return self in (
            self.EXTEND,
            self.MIXED,
            self.TARGET_VERIFY,
            self.SPLIT_PREFILL,
            self.DLLM_EXTEND,
        ) or (include_draft_extend_v2 and self is self.DRAFT_EXTEND_V2)

    def is_decode(self) -> bool:
        return self is self.DECODE

    def is_mixed(self) -> bool:
        return self is self.MIXED

    def is_idle(self) -> bool:
        return self is self.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (self.DECODE, self.IDLE)

    def is_target_verify(self) -> bool:
        return self is self.TARGET_VERIFY

    def is_draft_extend_v2(self) -> bool:
        return self is self.DRAFT_EXTEND_V2

    def is_extend_or_draft_extend_or_mixed(self, include_draft_extend_v2: bool = False) -> bool:
        return self in (self.EXTEND, self.MIXED, self.SPLIT_PREFILL) or (
            include_draft_extend_v2 and self is self.DRAFT_EXTEND_V2
        )

    def is_context_parallel_extend(self, include_draft_extend_v2: bool = False) -> bool:
        return self in (self.EXTEND, self.MIXED) or (
            include_draft_extend_v2 and self is self.DRAFT_EXTEND_V2
        )

    def is_extend_without_speculative(self) -> bool:
        return self.is_extend() and not self.is_target_verify()

    def is_cuda_graph(self) -> bool:
        return self in (self.DECODE, self.TARGET_VERIFY, self.IDLE, self.DLLM_EXTEND)

    def is_cpu_graph(self) -> bool:
        return self is self.DECODE

    def is_dllm_extend(self) -> bool:
        return self is self.DLLM_EXTEND

    def is_split_prefill(self) -> bool:
        return self is self.SPLIT_PREFILL

    def is_prebuilt(self) -> bool:
        return self is self.PREBUILT


class AttentionType(enum.Enum):
    """SGLang's ``radix_attention.AttentionType``."""

    DECODER = "decoder"
    DECODER_BIDIRECTIONAL = "decoder_bidirectional"
    ENCODER_ONLY = "encoder_only"


@dataclass(slots=True)
class MockRadixAttention:
    """The attributes SGLang backends read from a ``RadixAttention`` layer (its names; the real
    constructor takes ``num_heads`` / ``num_kv_heads`` and resolves ``v_head_dim=-1``)."""

    tp_q_head_num: int
    tp_k_head_num: int
    tp_v_head_num: int
    head_dim: int
    qk_head_dim: int
    v_head_dim: int
    scaling: float
    layer_id: int = 0
    logit_cap: float = 0.0
    logit_capping_method: str = "tanh"
    sliding_window_size: int = -1
    """SGLang's convention: W - 1 (FlashAttention's left window); -1 = none."""
    is_cross_attention: bool = False
    attn_type: AttentionType = AttentionType.DECODER
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_scale_float: float | None = None
    v_scale_float: float | None = None
    use_irope: bool = False
    """Llama 4's chunked layers: the model runner's ``attention_chunk_size`` applies."""

    @classmethod
    def from_layer_spec(cls, spec: LayerSpec, layer_id: int = 0) -> MockRadixAttention:
        """The RadixAttention SGLang would build for ``spec`` (window W becomes W - 1; a chunked
        ``spec`` sets ``use_irope``, its chunk size belongs to the model runner)."""
        return cls(
            tp_q_head_num=spec.num_heads,
            tp_k_head_num=spec.num_kv_heads,
            tp_v_head_num=spec.num_kv_heads,
            head_dim=spec.head_dim,
            qk_head_dim=spec.head_dim,
            v_head_dim=spec.v_dim,
            scaling=spec.softmax_scale,
            layer_id=layer_id,
            logit_cap=float(spec.softcap or 0.0),
            sliding_window_size=-1 if spec.sliding_window is None else spec.sliding_window - 1,
            use_irope=spec.attention_chunk_size is not None,
            attn_type=AttentionType.DECODER if spec.causal else AttentionType.ENCODER_ONLY,
        )


@dataclass(slots=True)
class VerifyInput:
    """The ``EagleVerifyInput`` fields a verify reads: a chain (``topk`` 1) or a tree
    (``topk`` > 1) whose ``custom_mask`` holds, per row b, D x (seq_lens[b] + D) booleans,
    row-major, rows after one another."""

    draft_token_num: int
    topk: int = 1
    custom_mask: torch.Tensor | None = None


class MockKVPool:
    """``MHATokenToKVPool``: per-layer K/V buffers ``[slots, Hkv, D]``; slots 0..P-1 = padding."""

    def __init__(self, k_buffer: list[torch.Tensor], v_buffer: list[torch.Tensor]) -> None:
        self.k_buffer = k_buffer
        self.v_buffer = v_buffer
        self.start_layer = 0

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id - self.start_layer]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id - self.start_layer]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(
        self,
        layer: Any,
        loc_info: torch.Tensor,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        layer_id_override: int | None = None,
        dcp_kv_mask: torch.Tensor | None = None,
    ) -> None:
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        loc = loc_info
        for buf, new, scale in (
            (self.get_key_buffer(layer_id), cache_k, k_scale),
            (self.get_value_buffer(layer_id), cache_v, v_scale),
        ):
            new = new.reshape(loc.shape[0], *buf.shape[1:])
            if new.dtype != buf.dtype and scale is not None:
                new = new.float() / scale
            buf[loc.long()] = new.to(buf.dtype)

    def clone(self) -> MockKVPool:
        return MockKVPool([k.clone() for k in self.k_buffer], [v.clone() for v in self.v_buffer])


@dataclass(frozen=True, slots=True)
class MockReqToTokenPool:
    req_to_token: torch.Tensor
    """(rows, context_len) int32: row 0 is SGLang's dummy row (zeros)."""


@dataclass(frozen=True, slots=True)
class MockModelConfig:
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    context_len: int

    def get_total_num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def get_num_kv_heads(self, tensor_parallel_size: int, dcp_size: int = 1) -> int:
        return max(1, self.num_key_value_heads // (tensor_parallel_size // dcp_size))


class MockModel:
    """The loaded model (``ModelRunner.model``, a ``torch.nn.Module``) as far as attention
    backends read it: ``modules()``, here its RadixAttention layers."""

    def __init__(self, layers: Sequence[MockRadixAttention]) -> None:
        self.layers = list(layers)

    def modules(self) -> Iterator[object]:
        yield self
        yield from self.layers


@dataclass(frozen=True, slots=True)
class MockModelRunner:
    """The ``ModelRunner`` attributes an attention backend reads (the pools live here: since
    SGLang 0.5.13 a ``ForwardBatch`` carries none)."""

    model_config: MockModelConfig
    req_to_token_pool: MockReqToTokenPool
    token_to_kv_pool: MockKVPool
    page_size: int
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    kv_index_translator: Any = None
    is_draft_worker: bool = False
    attention_chunk_size: int | None = None
    """The model config's chunk size (Llama 4), applied to layers with ``use_irope``."""
    model: MockModel | None = None
    """The model whose RadixAttention layers the drop-in declares at start-up; None: none
    (the drop-in then checks the model config's shape)."""


@dataclass(slots=True)
class MockForwardBatch:
    """The ``ForwardBatch`` fields attention backends read (SGLang's names, dtypes and
    mutability: SGLang's runners rewrite fields of a batch in place)."""

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor | None
    seq_lens_sum: int | None
    out_cache_loc: torch.Tensor
    extend_seq_lens: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    spec_info: Any = None
    encoder_lens: torch.Tensor | None = None

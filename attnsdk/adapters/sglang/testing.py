"""Test doubles of SGLang's batch objects, built from an ``attnsdk.testing.BatchSpec``.

They carry SGLang's attribute names and conventions, so adapter code that passes here reads a
real ``ForwardBatch`` the same way: req_to_token row 0 is the dummy row, page 0 the padding page,
pages hold contiguous slots of one request, CUDA-graph padding rows have seq_len 1 and write
slot 0. ``MockCudaGraphRunner`` pads batches like SGLang's graph runners (without graphs), with
either release's hooks. The engine tier (tests/engines) checks these doubles field by field
against SGLang's own classes.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch

from attnsdk.adapters.sglang._backend import SEQ_LEN_FILL_VALUE
from attnsdk.contract.errors import InvalidInputError
from attnsdk.testing import PageOrder, assign_pages

if TYPE_CHECKING:
    from collections.abc import Sequence

    from attnsdk.contract.layer import LayerSpec
    from attnsdk.testing import BatchSpec

__all__ = [
    "AttentionType",
    "ForwardMode",
    "MockCudaGraphRunner",
    "MockForwardBatch",
    "MockKVPool",
    "MockModelConfig",
    "MockModelRunner",
    "MockRadixAttention",
    "MockReqToTokenPool",
    "SGLangBatch",
    "VerifyInput",
    "make_sglang_batch",
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


@dataclass(frozen=True, slots=True)
class SGLangBatch:
    """A mock SGLang step: runner, forward batch, and one layer's q/k/v as SGLang passes them."""

    spec: BatchSpec
    layer: MockRadixAttention
    model_runner: MockModelRunner
    forward_batch: MockForwardBatch
    q: torch.Tensor
    """(T, Hq * D) in the model dtype."""
    k: torch.Tensor
    """(T, Hkv * D): this step's new keys, written at ``out_cache_loc``."""
    v: torch.Tensor
    """(T, Hkv * Dv)."""
    real_tokens: torch.Tensor
    """(T,) bool on the CPU: False for tokens of CUDA-graph padding rows."""

    def clone(self) -> SGLangBatch:
        """The same step over copies of the KV buffers, so several runs start from one state."""
        pool = self.model_runner.token_to_kv_pool.clone()
        runner = dataclasses.replace(self.model_runner, token_to_kv_pool=pool)
        fb = dataclasses.replace(self.forward_batch)
        return dataclasses.replace(self, model_runner=runner, forward_batch=fb)

    def first_rows(self, n: int) -> SGLangBatch:
        """The step of the first ``n`` rows only, on the same pools (a smaller later batch)."""
        t = sum(self.spec.query_lens[:n])
        spec = self.spec
        sub = type(spec)(spec.query_lens[:n], spec.seq_lens[:n], spec.name, spec.padded[:n])
        fb = self.forward_batch

        def cut(x: Any, size: int) -> Any:
            return None if x is None else x[:size]

        fb = dataclasses.replace(
            fb,
            batch_size=n,
            req_pool_indices=fb.req_pool_indices[:n],
            seq_lens=fb.seq_lens[:n],
            seq_lens_cpu=cut(fb.seq_lens_cpu, n),
            seq_lens_sum=int(fb.seq_lens[:n].sum()),
            out_cache_loc=fb.out_cache_loc[:t],
            extend_seq_lens=cut(fb.extend_seq_lens, n),
            extend_seq_lens_cpu=cut(fb.extend_seq_lens_cpu, n),
            extend_prefix_lens=cut(fb.extend_prefix_lens, n),
            extend_prefix_lens_cpu=cut(fb.extend_prefix_lens_cpu, n),
        )
        return dataclasses.replace(
            self,
            spec=sub,
            forward_batch=fb,
            q=self.q[:t],
            k=self.k[:t],
            v=self.v[:t],
            real_tokens=self.real_tokens[:t],
        )


def make_sglang_batch(
    spec: BatchSpec,
    layer: LayerSpec,
    mode: ForwardMode,
    *,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    pages: PageOrder = "shuffled",
    seed: int = 0,
    device: torch.device | str = "cpu",
    spare_pages: int = 3,
    tree_mask: torch.Tensor | None = None,
) -> SGLangBatch:
    """A mock SGLang step for ``spec`` in ``mode``; the KV buffers hold random context.

    TARGET_VERIFY needs equal query lengths (the draft count); its ``seq_lens`` exclude them.
    With ``tree_mask`` ((B * D, D) bool, attnsdk's ``AttentionMetadata.tree_mask`` of the
    drafts, e.g. from ``attnsdk.tree_mask_from_parents``) it is an EAGLE tree verify (topk 2)
    whose ``custom_mask`` is laid out as SGLang's. Rows flagged ``spec.padded`` become SGLang's
    graph padding rows (req row 0, seq_len 1, slot 0), allowed in DECODE, IDLE and TARGET_VERIFY.
    """
    _check_spec(spec, mode)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    p = page_size
    b = spec.num_seqs
    verify = mode is ForwardMode.TARGET_VERIFY
    drafts = spec.query_lens[0] if verify and b else 0
    real = [not pad for pad in spec.padded]
    pages_per_seq = [-(-s // p) if r else 0 for s, r in zip(spec.seq_lens, real)]
    num_pages = sum(pages_per_seq) + 1 + spare_pages
    assigned = assign_pages(pages_per_seq, num_pages, pages, gen)
    context_len = (max([1, *spec.seq_lens]) // p + 2) * p
    # Row 0 is SGLang's dummy row; real requests take shuffled rows after it.
    rows = (torch.randperm(b + 2, generator=gen) + 1).tolist()[:b]
    req_to_token = torch.zeros(b + 3, context_len, dtype=torch.int32)
    out_cache_loc, rpi, seq_lens = [], [], []
    for i in range(b):
        q_len, s_len = spec.query_lens[i], spec.seq_lens[i]
        if not real[i]:
            rpi.append(0)
            seq_lens.append(SEQ_LEN_FILL_VALUE)
            out_cache_loc += [0] * q_len
            continue
        pos = torch.arange(s_len)
        page_ids = torch.tensor(assigned[i], dtype=torch.int64)
        req_to_token[rows[i], :s_len] = (page_ids[pos // p] * p + pos % p).to(torch.int32)
        rpi.append(rows[i])
        seq_lens.append(s_len - drafts)
        out_cache_loc += req_to_token[rows[i], s_len - q_len : s_len].tolist()
    hq, hkv, d, dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_dim
    slots = num_pages * p
    k_buf = torch.randn(slots, hkv, d, generator=gen).to(dev, dtype)
    v_buf = torch.randn(slots, hkv, dv, generator=gen).to(dev, dtype)
    pool = MockKVPool([k_buf], [v_buf])
    r2t_pool = MockReqToTokenPool(req_to_token.to(dev))
    runner = MockModelRunner(
        model_config=MockModelConfig(hq, hkv, d, context_len),
        req_to_token_pool=r2t_pool,
        token_to_kv_pool=pool,
        page_size=p,
        device=dev,
        dtype=dtype,
        kv_cache_dtype=dtype,
        attention_chunk_size=layer.attention_chunk_size,
    )
    extend = mode.is_extend_or_draft_extend_or_mixed(include_draft_extend_v2=True)
    prefix = list(spec.context_lens)
    fb = MockForwardBatch(
        forward_mode=mode,
        batch_size=b,
        req_pool_indices=torch.tensor(rpi, dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        out_cache_loc=torch.tensor(out_cache_loc, dtype=torch.int64, device=dev),
        extend_seq_lens=(
            torch.tensor(spec.query_lens, dtype=torch.int32, device=dev) if extend else None
        ),
        extend_seq_lens_cpu=list(spec.query_lens) if extend else None,
        extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev) if extend else None,
        extend_prefix_lens_cpu=prefix if extend else None,
        spec_info=_verify_input(drafts, seq_lens, tree_mask, dev) if verify else None,
    )
    t = spec.num_tokens
    return SGLangBatch(
        spec=spec,
        layer=MockRadixAttention.from_layer_spec(layer),
        model_runner=runner,
        forward_batch=fb,
        q=torch.randn(t, hq * d, generator=gen).to(dev, dtype),
        k=torch.randn(t, hkv * d, generator=gen).to(dev, dtype),
        v=torch.randn(t, hkv * dv, generator=gen).to(dev, dtype),
        real_tokens=torch.repeat_interleave(
            torch.tensor(real, dtype=torch.bool), torch.tensor(spec.query_lens, dtype=torch.int64)
        ),
    )


def _verify_input(
    drafts: int, prefix_lens: list[int], tree_mask: torch.Tensor | None, device: torch.device
) -> VerifyInput:
    """A chain, or an EAGLE tree whose ``custom_mask`` is SGLang's layout of ``tree_mask``."""
    if tree_mask is None:
        return VerifyInput(drafts)
    b = len(prefix_lens)
    if tuple(tree_mask.shape) != (b * drafts, drafts) or tree_mask.dtype != torch.bool:
        found = (tree_mask.dtype, tuple(tree_mask.shape))
        raise InvalidInputError("tree_mask", f"a ({b * drafts}, {drafts}) bool tensor", found)
    rows = tree_mask.cpu().view(b, drafts, drafts)
    blocks = [
        torch.cat([torch.ones(drafts, prefix, dtype=torch.bool), rows[i]], dim=1).flatten()
        for i, prefix in enumerate(prefix_lens)
    ]
    mask = torch.cat(blocks) if blocks else torch.zeros(0, dtype=torch.bool)
    return VerifyInput(drafts, topk=2, custom_mask=mask.to(device))


def _check_spec(spec: BatchSpec, mode: ForwardMode) -> None:
    q = set(spec.query_lens)
    if mode.is_idle() and spec.num_seqs and not all(spec.padded):
        raise InvalidInputError("spec", "no real rows in IDLE (only graph padding)", spec.name)
    if mode.is_decode_or_idle() and q - {1}:
        raise InvalidInputError("spec.query_lens", "all 1 in DECODE", sorted(q))
    if mode.is_target_verify() and len(q) > 1:
        raise InvalidInputError("spec.query_lens", "one draft count in TARGET_VERIFY", sorted(q))
    if mode.is_extend_or_draft_extend_or_mixed(True) and any(spec.padded):
        raise InvalidInputError("spec.padded", f"no padding rows in {mode.name}", spec.padded)


class MockCudaGraphRunner:
    """SGLang's decode CUDA-graph runner's input handling, minus the graphs.

    ``hooks="out_graph"`` follows SGLang 0.5.13+ (``DecodeCudaGraphRunner``): capture calls
    ``init_forward_metadata_out_graph(fb, in_capture=True)`` then ``..._in_graph(fb)`` for
    each size, largest first, on static inputs reset to padding (request row 0, seq_len 1,
    slot 0); a replay pads the same way and passes a view of the static inputs (the captured
    ``forward_mode``, the live ``out_cache_loc``). ``hooks="legacy"`` follows 0.5.12's
    ``CudaGraphRunner``: the capture/replay hooks, and padding rows keep whatever request row
    the static buffer last held. The returned ``MockForwardBatch`` views the static buffers,
    like the batch a captured graph reads.
    """

    def __init__(
        self,
        backend: Any,
        model_runner: MockModelRunner,
        capture_bs: Sequence[int],
        mode: ForwardMode = ForwardMode.DECODE,
        spec_info: VerifyInput | None = None,
        *,
        hooks: Literal["out_graph", "legacy"] = "out_graph",
    ) -> None:
        if hooks not in ("out_graph", "legacy"):
            raise InvalidInputError("hooks", "'out_graph' or 'legacy'", repr(hooks))
        self.backend, self.model_runner, self.mode = backend, model_runner, mode
        self.spec_info = spec_info
        self.hooks = hooks
        self.capture_bs = sorted(capture_bs)
        self.per_row = spec_info.draft_token_num if mode.is_target_verify() and spec_info else 1
        max_bs = self.capture_bs[-1]
        dev = model_runner.device
        fill = backend.get_cuda_graph_seq_len_fill_value()
        self.fill = fill
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), fill, dtype=torch.int64, device=dev)
        self.seq_lens_cpu = torch.full((max_bs,), fill, dtype=torch.int64)
        self.out_cache_loc = torch.zeros(max_bs * self.per_row, dtype=torch.int64, device=dev)
        backend.init_cuda_graph_state(max_bs, max_bs * self.per_row)
        for bs in reversed(self.capture_bs):
            if hooks == "legacy":
                backend.init_forward_metadata_capture_cuda_graph(
                    bs,
                    bs * self.per_row,
                    self.req_pool_indices[:bs],
                    self.seq_lens[:bs],
                    None,
                    mode,
                    spec_info,
                )
            else:
                self._reset()
                fb = self.static_batch(bs)
                backend.init_forward_metadata_out_graph(fb, in_capture=True)
                backend.init_forward_metadata_in_graph(fb)

    def _reset(self) -> None:
        self.req_pool_indices.zero_()
        self.out_cache_loc.zero_()
        self.seq_lens.fill_(self.fill)
        self.seq_lens_cpu.fill_(self.fill)

    def static_batch(self, bs: int) -> MockForwardBatch:
        """The forward batch a graph captured for ``bs`` rows reads (views of static buffers)."""
        return MockForwardBatch(
            forward_mode=self.mode,
            batch_size=bs,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            seq_lens_sum=int(self.seq_lens_cpu[:bs].sum()),
            out_cache_loc=self.out_cache_loc[: bs * self.per_row],
            spec_info=self.spec_info,
        )

    def replay_prepare(self, fb: MockForwardBatch) -> MockForwardBatch:
        """Copy ``fb`` into the static inputs, pad to a captured size, run the replay hook."""
        raw = fb.batch_size
        bs = next((c for c in self.capture_bs if c >= raw), None)
        if bs is None:
            raise InvalidInputError("batch_size", f"<= {self.capture_bs[-1]} (captured)", raw)
        if fb.seq_lens_cpu is None or fb.seq_lens_sum is None:
            raise InvalidInputError("fb.seq_lens_cpu", "host lengths", None)
        if self.hooks == "out_graph":
            self._reset()  # SGLang 0.5.13+: padding rows read request row 0
        elif bs != raw:
            self.seq_lens.fill_(self.fill)
            self.seq_lens_cpu.fill_(self.fill)
            self.out_cache_loc.zero_()
        self.req_pool_indices[:raw].copy_(fb.req_pool_indices)
        self.seq_lens[:raw].copy_(fb.seq_lens)
        self.seq_lens_cpu[:raw].copy_(fb.seq_lens_cpu)
        self.out_cache_loc[: fb.out_cache_loc.shape[0]].copy_(fb.out_cache_loc)
        if self.hooks == "legacy":
            self.backend.init_forward_metadata_replay_cuda_graph(
                bs,
                self.req_pool_indices,
                self.seq_lens,
                fb.seq_lens_sum + (bs - raw) * self.fill,
                None,
                self.mode,
                fb.spec_info,
                self.seq_lens_cpu,
            )
        else:
            view = SimpleNamespace(
                batch_size=bs,
                forward_mode=self.mode,
                actual_forward_mode=fb.forward_mode,
                req_pool_indices=self.req_pool_indices[:bs],
                seq_lens=self.seq_lens[:bs],
                seq_lens_cpu=self.seq_lens_cpu[:bs],
                seq_lens_sum=fb.seq_lens_sum + (bs - raw) * self.fill,
                num_padding=bs - raw,
                encoder_lens=None,
                out_cache_loc=fb.out_cache_loc,
                spec_info=fb.spec_info,
            )
            self.backend.init_forward_metadata_out_graph(view)
        return self.static_batch(bs)

    def pad_tokens(self, x: torch.Tensor, bs: int) -> torch.Tensor:
        """``x`` (real tokens first) padded with zero rows to the ``bs * per_row`` graph rows."""
        out = x.new_zeros(bs * self.per_row, *x.shape[1:])
        out[: x.shape[0]] = x
        return out

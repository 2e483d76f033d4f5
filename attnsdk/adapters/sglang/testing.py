"""Test doubles of SGLang's batch objects, built from an ``attnsdk.testing.BatchSpec``.

They carry SGLang's attribute names and conventions, so adapter code that passes here reads a
real ``ForwardBatch`` the same way: req_to_token row 0 is the dummy row, page 0 the padding page,
pages hold contiguous slots of one request, CUDA-graph padding rows have seq_len 1 and write
slot 0. ``MockCudaGraphRunner`` pads batches like SGLang's graph runners (without graphs), with
either release's hooks. The engine tier (tests/engines) checks these doubles field by field
against SGLang's own classes.

This module is their public home: the engine objects are defined in ``_mock_objects``, the graph
runner in ``_mock_graphs``; the batch builder ``make_sglang_batch`` is here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.adapters.sglang._graphs import SEQ_LEN_FILL_VALUE
from attnsdk.adapters.sglang._mock_graphs import MockCudaGraphRunner
from attnsdk.adapters.sglang._mock_objects import (
    AttentionType,
    ForwardMode,
    MockForwardBatch,
    MockKVPool,
    MockModel,
    MockModelConfig,
    MockModelRunner,
    MockRadixAttention,
    MockReqToTokenPool,
    VerifyInput,
)
from attnsdk.contract.errors import InvalidInputError
from attnsdk.testing import PageOrder, assign_pages

if TYPE_CHECKING:
    from attnsdk.contract.layer import LayerSpec
    from attnsdk.testing import BatchSpec

__all__ = [
    "AttentionType",
    "ForwardMode",
    "MockCudaGraphRunner",
    "MockForwardBatch",
    "MockKVPool",
    "MockModel",
    "MockModelConfig",
    "MockModelRunner",
    "MockRadixAttention",
    "MockReqToTokenPool",
    "SGLangBatch",
    "VerifyInput",
    "make_sglang_batch",
]


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
    The runner's model holds the step's layer (``SGLangBatch.layer``, layer 0).
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
    radix = MockRadixAttention.from_layer_spec(layer)
    runner = MockModelRunner(
        model_config=MockModelConfig(hq, hkv, d, context_len),
        req_to_token_pool=r2t_pool,
        token_to_kv_pool=pool,
        page_size=p,
        device=dev,
        dtype=dtype,
        kv_cache_dtype=dtype,
        attention_chunk_size=layer.attention_chunk_size,
        model=MockModel([radix]),
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
        layer=radix,
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

"""Cross-engine conformance: one BatchSpec through the SGLang and the vLLM drop-in backends.

Both engines' mocks describe the same logical step (same q/k/v, same cached context per
position) with their own conventions: SGLang's req_to_token slots and per-layer [slots, Hkv, D]
buffers, vLLM's shuffled block table and each of its three cache layouts. The outputs must be
the same, and each engine's cache must end up holding the new K/V at every new position.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnsdk import LayerSpec
from attnsdk.adapters.sglang import SGLangAttentionBackend
from attnsdk.adapters.sglang.testing import ForwardMode, make_sglang_batch
from attnsdk.adapters.vllm import AttnSDKAttentionBackend, VLLMKVLayout
from attnsdk.adapters.vllm.testing import make_kv_cache, mock_vllm_batch
from attnsdk.testing import BatchSpec

P = 16
HQ, HKV, D = 4, 2, 32

CASES = {
    "decode": (BatchSpec.decode(batch_size=6, seed=3), ForwardMode.DECODE, None),
    "prefill": (BatchSpec.prefill(batch_size=3, seed=3), ForwardMode.EXTEND, None),
    "chunked_prefill": (BatchSpec.chunked_prefill(seed=3), ForwardMode.EXTEND, None),
    "mixed": (BatchSpec.mixed(batch_size=6, seed=3), ForwardMode.MIXED, None),
    "mixed+window": (BatchSpec.mixed(batch_size=6, seed=4), ForwardMode.MIXED, 24),
}


def _positions(spec: BatchSpec, b: int, *, new: bool) -> range:
    s, q = spec.seq_lens[b], spec.query_lens[b]
    return range(s - q, s) if new else range(s - q)


@pytest.mark.parametrize("layout", list(VLLMKVLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_sglang_and_vllm_agree(case: str, layout: VLLMKVLayout) -> None:
    spec, mode, window = CASES[case]
    layer = LayerSpec(num_heads=HQ, num_kv_heads=HKV, head_dim=D, sliding_window=window)
    sg = make_sglang_batch(spec, layer, mode, page_size=P, seed=11)
    k_buf, v_buf = sg.model_runner.token_to_kv_pool.get_kv_buffer(0)
    r2t = sg.model_runner.req_to_token_pool.req_to_token
    rpi = sg.forward_batch.req_pool_indices.tolist()

    # The vLLM step: its own shuffled blocks, filled with SGLang's context K/V position by position.
    vb = mock_vllm_batch(spec, num_heads=HQ, num_kv_heads=HKV, head_size=D, block_size=P, seed=5)
    table = vb.block_table
    num_blocks = int(table.max()) + 4
    k_nhd = torch.randn(num_blocks, P, HKV, D)
    v_nhd = torch.randn(num_blocks, P, HKV, D)
    for b in range(spec.num_seqs):
        for pos in _positions(spec, b, new=False):
            slot = int(r2t[rpi[b], pos])
            k_nhd[table[b, pos // P], pos % P] = k_buf[slot]
            v_nhd[table[b, pos // P], pos % P] = v_buf[slot]
    vb = dataclasses.replace(
        vb,
        kv_cache=make_kv_cache(k_nhd, v_nhd, layout),
        layout=layout,
        query=sg.q.view(-1, HQ, D),
        key=sg.k.view(-1, HKV, D),
        value=sg.v.view(-1, HKV, D),
    )

    dropin = SGLangAttentionBackend(sg.model_runner, "reference")
    dropin.init_forward_metadata(sg.forward_batch)
    sg_out = dropin.forward(sg.q, sg.k, sg.v, sg.layer, sg.forward_batch, True)

    backend_cls = type(
        "RefBackend",
        (AttnSDKAttentionBackend,),
        {"attnsdk_backend": "reference", "kv_cache_layout": layout},
    )
    builder = backend_cls.get_builder_cls()(None, ["layers.0"], None, torch.device("cpu"))
    impl = backend_cls.get_impl_cls()(HQ, D, layer.softmax_scale, HKV, None, window)
    vllm_out = torch.full((spec.num_tokens, HQ * D), float("nan"))
    impl.forward(
        vb.layer,
        vb.query,
        vb.key,
        vb.value,
        vb.kv_cache,
        builder.build(0, vb.common_attn_metadata),
        vllm_out,
    )

    torch.testing.assert_close(vllm_out, sg_out.reshape(vllm_out.shape), atol=1e-6, rtol=1e-6)
    # Both caches now hold each new token's K/V at that token's position.
    cache = impl._kv(vb.kv_cache, torch.float32)
    t = 0
    for b in range(spec.num_seqs):
        for pos in _positions(spec, b, new=True):
            sg_slot = int(r2t[rpi[b], pos])
            page = int(table[b, pos // P])
            assert torch.equal(cache.k[page, pos % P], k_buf[sg_slot])
            assert torch.equal(cache.v[page, pos % P], v_buf[sg_slot])
            assert torch.equal(k_buf[sg_slot], vb.key[t])
            t += 1

"""Cross-attention (vLLM's ENCODER_DECODER) on the drop-in, through vLLM's own code.

vLLM's ``CrossAttention`` layer asks the selector for a backend (CUSTOM: ours) and wraps it with
``create_cross_attention_backend``: a ``CrossAttentionBuilder`` that subclasses our builder
(``seq_lens`` become the encoder lengths, the encoder tokens' slots are assigned after our
``build``) and an impl subclass. The KV cache spec, the cache tensors and the builder come from
vLLM's worker utilities, as in mini_engine.py. Two steps: the decoder's first (its prompts, one
longer than its encoder, and the encoder's K/V written to the cache), then a decode step that
passes no K/V. Every row must equal dense attention over the request's encoder K/V.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from tests.v1.attention.utils import BatchSpec, create_common_attn_metadata, create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import CrossAttention
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
from vllm.v1.kv_cache_interface import CrossAttentionSpec
from vllm.v1.worker.gpu import attn_utils
from vllm_engine.attnsdk_ref import Ref
from vllm_engine.mini_engine import BS, CPU, HKV, D, H, attention

ENCODER = [5, 20]
"""Encoder tokens per request."""
PROMPT = [9, 3]
"""Decoder prompt tokens per request: request 0 has more queries than encoder keys."""
NAME = "layers.0.cross_attn"  # vLLM 0.33 wants one layer index in the name


def test_cross_attention_layer_over_the_encoders_cache() -> None:
    vc = create_vllm_config(dtype=torch.float32, max_model_len=128, block_size=BS)
    vc.attention_config.backend = AttentionBackendEnum.CUSTOM
    vc.scheduler_config.max_num_encoder_input_tokens = 64
    with set_current_vllm_config(vc):
        layer = CrossAttention(
            H, D, D**-0.5, num_kv_heads=HKV, cache_config=vc.cache_config, prefix=NAME
        )
        assert issubclass(layer.get_attn_backend(), Ref)  # vLLM's CrossAttention_ subclass
        specs = attn_utils.get_kv_cache_spec(vc)
        assert isinstance(specs[NAME], CrossAttentionSpec)
        groups = get_global_kv_cache_groups(vc, [specs])
        (config,) = get_kv_cache_configs(vc, [specs], [1 << 30], groups)
        attn_groups, _, block_sizes = attn_utils.init_attn_backend(config, vc, CPU)
        attn_utils.init_kv_cache(
            vc.compilation_config.static_forward_context, config, CPU, block_sizes, vc,
            attn_groups=[g for grp in attn_groups for g in grp],
        )  # fmt: skip
    builder = attn_groups[0][0].get_metadata_builder()
    gen = torch.Generator().manual_seed(3)
    enc = [
        (torch.randn(n, HKV, D, generator=gen), torch.randn(n, HKV, D, generator=gen))
        for n in ENCODER
    ]
    table = torch.tensor([[1, 0], [2, 3]], dtype=torch.int32)  # encoder blocks per request

    def step(query_lens: list[int], computed: list[int], first: bool) -> None:
        spec = BatchSpec(
            seq_lens=[c + q for c, q in zip(computed, query_lens)], query_lens=query_lens
        )
        cm = create_common_attn_metadata(spec, BS, CPU)
        cm = dataclasses.replace(
            cm,
            block_table_tensor=table,
            encoder_seq_lens=torch.tensor(ENCODER, dtype=torch.int32),
            encoder_seq_lens_cpu=np.array(ENCODER, dtype=np.int32),
        )
        metadata = builder.build(0, cm)
        expected_slots = sum(ENCODER) if first else 0
        assert metadata.slot_mapping.shape[0] == expected_slots  # vLLM's cross slots
        assert metadata.plan.metadata.cross_attention
        t = sum(query_lens)
        q = torch.randn(t, H * D, generator=gen)
        k = torch.cat([e[0] for e in enc]).view(-1, HKV * D) if first else None
        v = torch.cat([e[1] for e in enc]).view(-1, HKV * D) if first else None
        with set_forward_context({NAME: metadata}, vc, num_tokens=t):
            out = layer(q, k, v)
        start = 0
        for b, n in enumerate(query_lens):
            want = attention(
                q[start : start + n].view(n, H, D), enc[b][0].double(), enc[b][1].double(),
                causal=False, window=None, sinks=None,
            )  # fmt: skip
            got = out[start : start + n].view(n, H, D).double()
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            start += n

    step(PROMPT, [0, 0], first=True)  # the prompts; the encoder's K/V are written
    step([1, 1], PROMPT, first=False)  # a decode step reads them from the cache

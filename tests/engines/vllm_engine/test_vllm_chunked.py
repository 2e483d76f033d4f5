"""Llama 4's chunked local attention in vLLM, through the drop-in.

vLLM serves ``ChunkedLocalAttention`` layers by wrapping the attention backend it selected:
``create_chunked_local_attention_backend`` subclasses the backend's metadata builder so that
``build`` receives vLLM's own virtual batch (``make_local_attention_virtual_batches``: one
request per chunk a request's queries touch), and the layer's impl is built with the ordinary
``Attention`` arguments, without the chunk size. So the drop-in must attend over that batch
with ``attention_chunk_size=None``: applying the chunks again would be wrong twice over.

Checked here with vLLM's own code: its correctness harness on the drop-in wrapped by vLLM's
wrapper, against the harness's flex reference with a chunked causal mask; the real
``ChunkedLocalAttention`` layer on CUSTOM (which backend, which builder, which ``LayerSpec``).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
from tests.v1.attention import test_attention_backends as harness
from tests.v1.attention.utils import BatchSpec
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention.chunked_local_attention import (
    ChunkedLocalAttention,
    create_chunked_local_attention_backend,
)
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm_engine import attnsdk_ref
from vllm_engine.attnsdk_ref import Ref
from vllm_engine.test_vllm_engine_paths import engine_config

from attnsdk.adapters.vllm import AttnSDKMetadataBuilder

MODEL = "Qwen/Qwen3-0.6B"

SPECS = {
    # Decode on a chunk's first and last position, an extend across a boundary, a prefill over
    # several chunks, a long context: chunks of 16 and 64 (multiples of the block size 16).
    "edges": BatchSpec(seq_lens=[17, 32, 40, 70, 200], query_lens=[1, 1, 9, 70, 1]),
    "mixed_small": harness.BATCH_SPECS["mixed_small"],
    "medium_prefill": harness.BATCH_SPECS["medium_prefill"],
    "mixed_medium": harness.BATCH_SPECS["mixed_medium"],
}


def chunked_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any, *, context_len: int, chunk: int) -> Any:
    q_pos = q_idx + context_len
    return (q_pos >= kv_idx) & (q_pos // chunk == kv_idx // chunk)


@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_vllms_virtual_batch_on_the_dropin(
    spec_name: str, chunk: int, use_custom_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrapped = create_chunked_local_attention_backend(Ref, chunk)
    monkeypatch.setattr(attnsdk_ref, "RefChunked", wrapped, raising=False)
    assert use_custom_backend("vllm_engine.attnsdk_ref.RefChunked") is wrapped
    mask = functools.partial(chunked_causal, chunk=chunk)
    with set_current_vllm_config(VllmConfig()):
        harness._test_backend_correctness(
            SPECS[spec_name], MODEL, [AttentionBackendEnum.CUSTOM], mask
        )


def test_the_harness_sees_chunks() -> None:
    """The chunked mask is not the plain one on these specs: the drop-in without vLLM's
    wrapper (plain causal attention over the whole batch) fails the chunked reference."""
    mask = functools.partial(chunked_causal, chunk=16)
    with set_current_vllm_config(VllmConfig()), pytest.raises(AssertionError, match="differs"):
        harness._test_backend_correctness(
            SPECS["edges"], MODEL, [AttentionBackendEnum.CUSTOM], mask
        )


def test_a_chunked_layer_runs_the_dropin_without_a_chunk_size() -> None:
    vllm_config = engine_config()
    with set_current_vllm_config(vllm_config):
        layer = ChunkedLocalAttention(
            8, 64, 0.125, attention_chunk_size=64, num_kv_heads=2,
            cache_config=vllm_config.cache_config, prefix="model.layers.0.self_attn.attn",
        )  # fmt: skip
    backend = layer.get_attn_backend()
    assert issubclass(backend, Ref)
    builder = backend.get_builder_cls()
    assert issubclass(builder, AttnSDKMetadataBuilder)
    assert builder is not Ref.get_builder_cls(), "vLLM's chunking builder wraps ours"
    assert builder.get_cudagraph_support(vllm_config, None) == AttentionCGSupport.NEVER
    assert layer.impl.layer_spec.attention_chunk_size is None

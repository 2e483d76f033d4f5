"""vLLM's own attention correctness harness, run on attnsdk's drop-in (reference backend).

``tests/v1/attention/test_attention_backends.py::_test_backend_correctness`` (from vLLM's sdist)
builds the model config (Qwen/Qwen3-0.6B: 16 query / 8 KV heads, head size 128, bf16), a paged
cache prepopulated in a physical layout with shuffled blocks, vLLM's ``CommonAttentionMetadata``
and a reference (eager flex_attention, or an explicit fp32 softmax with sinks); it then builds
our metadata with our builder, constructs our impl and compares its output. Our backend is
``AttentionBackendEnum.CUSTOM``. vLLM's pytest functions hardcode their backend lists, so the
helper is called directly under ``set_current_vllm_config(VllmConfig())`` (what vLLM's
``default_vllm_config`` fixture does). Matrix (each case is one harness call, 128 in all):

* all 13 ``BATCH_SPECS`` at the default config (block 16, kv_cache_dtype auto, LBNHC); decoder
  specs causal, the two encoder specs ``causal=False`` with ``AttentionType.ENCODER_ONLY`` and a
  bidirectional mask (vLLM runs them with embeddinggemma's window, whose config is not offline);
* vLLM's ``test_causal_backend_correctness`` matrix in full: its ten specs x
  tensor_parallel_size 1, 2, 4 (the harness cuts the head counts) x kv_cache_dtype auto, fp8,
  fp8_e4m3 (the harness rounds q, k and v through fp8 for its reference and widens the
  tolerance; our q stays in the model dtype by design);
* sinks on all 13 specs; block size 128 on two specs (the harness allocates 8192 blocks:
  ~4.3 GB here, so not more); every physical layout (``layout=``) with auto and fp8; vLLM's
  non-causal decoder test (DFlash); fp16 and fp32 models; a speculative-decoding config; an
  unquantised cache that must ignore the layer's k/v scales;
* one deliberately wrong backend (softmax scale doubled) that the harness must reject.

Not run: ``use_cuda_graph`` (needs CUDA); fp8 with encoder specs (vLLM's FlashAttention refuses
quantised encoder attention, and the harness's reference rounds q/k/v through fp8 while encoder
attention has no cache to quantise); the sliding-window harness tests (their model configs are
not available offline; test_vllm_lifecycle.py covers windows through the real layer).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tests.v1.attention import test_attention_backends as harness
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.attention.backend import AttentionImpl, AttentionType
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import KVCacheLayout
from vllm_engine.attnsdk_ref import MISSCALED, Ref

from attnsdk.adapters.vllm import AttnSDKAttentionImpl

MODEL = "Qwen/Qwen3-0.6B"
ENCODER_SPECS = ("small_encoder_prefill", "medium_encoder_prefill")
DECODER_SPECS = [name for name in harness.BATCH_SPECS if name not in ENCODER_SPECS]


def causal_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any, *, context_len: int) -> Any:
    return (q_idx + context_len) >= kv_idx  # vLLM's causal_mask_mod


def bidirectional_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any, *, context_len: int) -> Any:
    return q_idx >= 0  # vLLM's bidirectional_mask_mod


def run(spec_name: str, **kwargs: Any) -> None:
    """One harness case on CUSTOM; encoder specs run as vLLM's encoder-only attention."""
    assert AttentionBackendEnum.CUSTOM.get_class() is Ref
    assert issubclass(Ref.get_impl_cls(), AttnSDKAttentionImpl)
    assert issubclass(Ref.get_impl_cls(), AttentionImpl)  # what the harness asserts too
    if spec_name in ENCODER_SPECS:
        kwargs = {"causal": False, "attn_type": AttentionType.ENCODER_ONLY, **kwargs}
    mask = causal_mask if kwargs.get("causal", True) else bidirectional_mask
    with set_current_vllm_config(VllmConfig()):
        harness._test_backend_correctness(
            harness.BATCH_SPECS[spec_name], MODEL, [AttentionBackendEnum.CUSTOM], mask, **kwargs
        )


@pytest.mark.parametrize("spec_name", list(harness.BATCH_SPECS))
def test_every_batch_spec(spec_name: str) -> None:
    run(spec_name)


CAUSAL_MATRIX = [
    (spec_name, tp, kv_cache_dtype)
    for kv_cache_dtype in ("auto", "fp8", "fp8_e4m3")
    for tp in (1, 2, 4)
    for spec_name in DECODER_SPECS
    if spec_name != "mixed_large" and (tp, kv_cache_dtype) != (1, "auto")
]
"""vLLM's test_causal_backend_correctness: its ten specs x tensor_parallel_size 1, 2, 4 x
kv_cache_dtype auto, fp8, fp8_e4m3 (tp 1 / auto is test_every_batch_spec)."""


@pytest.mark.parametrize(("spec_name", "tensor_parallel_size", "kv_cache_dtype"), CAUSAL_MATRIX)
def test_causal_matrix(spec_name: str, tensor_parallel_size: int, kv_cache_dtype: str) -> None:
    # The harness silently skips a backend that says it cannot store this dtype.
    assert Ref.supports_kv_cache_dtype(kv_cache_dtype)
    run(spec_name, tensor_parallel_size=tensor_parallel_size, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("spec_name", list(harness.BATCH_SPECS))
def test_sinks(spec_name: str) -> None:
    run(spec_name, use_sinks=True)


@pytest.mark.parametrize("spec_name", ["mixed_small", "medium_prefill"])
def test_block_size_128(spec_name: str) -> None:
    run(spec_name, block_size=128)


@pytest.mark.parametrize(
    ("spec_name", "kv_cache_dtype"), [("mixed_small", "auto"), ("mixed_medium", "fp8")]
)
@pytest.mark.parametrize("layout", [m.name for m in KVCacheLayout])
def test_physical_layout(layout: str, spec_name: str, kv_cache_dtype: str) -> None:
    # The harness copies the cache into a layout the backend declares if it declares others.
    assert Ref.supported_kv_cache_layouts() is None
    run(spec_name, layout=KVCacheLayout[layout], kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("spec_name", ["small_decode", "small_prefill", "mixed_small"])
def test_non_causal_decoder(spec_name: str) -> None:
    """vLLM's test_non_causal_backend_correctness (DFlash): causal=False on a decoder cache."""
    run(spec_name, causal=False)


@pytest.mark.parametrize(
    "config",
    [
        {"model_dtype": torch.float16},
        {"model_dtype": torch.float32},
        {"num_speculative_tokens": 2},
        {"layer_k_scale": 0.25, "layer_v_scale": 0.5},  # an unquantised cache ignores them
    ],
    ids=["fp16", "fp32", "spec-decode", "layer-scales"],
)
def test_model_configs(config: dict[str, Any]) -> None:
    run("mixed_small", **config)


def test_harness_rejects_a_wrong_backend(use_custom_backend: Any) -> None:
    """The harness can fail: a backend with a doubled softmax scale does not pass it."""
    use_custom_backend(MISSCALED)
    with set_current_vllm_config(VllmConfig()), pytest.raises(AssertionError, match="differs"):
        harness._test_backend_correctness(
            harness.BATCH_SPECS["small_prefill"],
            MODEL,
            [AttentionBackendEnum.CUSTOM],
            causal_mask,
        )

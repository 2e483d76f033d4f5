"""Requests through vLLM's real ``Attention`` layers, KV cache and metadata path, step by step.

``mini_engine.MiniEngine`` runs a five-layer model the way vLLM's engine core and GPU worker do
(see its docstring): a full-attention layer, a sliding-window layer (W=24), a sinks layer, a
sliding-window + sinks layer and a KV-sharing layer (reads layer 0's cache), in two KV cache
groups (hybrid manager) over one allocation, in each of vLLM's six physical layouts, for
kv_cache_dtype auto and fp8 (uint8 storage, per-layer ``_k_scale`` / ``_v_scale`` != 1), with
fp32 and bf16 models.

At every step the whole KV allocation is compared byte for byte with the oracle's (new K/V at
their slots in vLLM's logical [N, Hkv, P, 2D] view, nothing else touched: padding rows, the
KV-sharing layer and freed blocks included) and every layer's output for every real row with a
float64 reference over the request's full K/V history (causal or not, window, sinks, fp8
dequantisation). The steps: prefills, a chunked prefill, mixed batches in any order, decodes,
a speculative-verify-style 3-token step, a request finishing and a new one reusing its (NaN
poisoned) blocks, sliding-window blocks freed and replaced by the null block, CUDA-graph
padding (requests with query and seq_len 0, token rows with slot -1) and a non-causal step.

Variants: fp8_e5m2; per-KV-head scales; attnsdk's debug mode (it validates every plan and
forward) with one KV cache group (hybrid manager off: window layers keep their blocks) and with
the hybrid manager's freed sliding-window blocks (the null block 0 in place of pages wholly
below the window); vLLM's KV-sharing fast prefill (the sharing layer gets a builder and
metadata class subclassing ours and runs on the logits rows only), also under debug mode.

vLLM's encoder-only layers (``EncoderOnlyAttention``, no KV cache) run with metadata built by
vLLM's own ``EncoderOnlyModelState._build_encoder_attn_metadata`` (dummy block table and slot
mapping), eager and FULL-graph padded, with a bidirectional window and sinks: their builder
plans the step once as ragged attention over its own K/V (``forward_ragged``).

Not covered: vLLM's FLEX_ATTENTION as a second control through these layers (on CPU its
compiled flex_attention fails to lower here, and it serves neither sinks nor KV sharing).
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from tests.v1.attention.utils import create_vllm_config
from vllm.config import set_current_vllm_config
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import EncoderOnlyAttention
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec, KVCacheLayout
from vllm.v1.worker.gpu.model_states.encoder_only import EncoderOnlyModelState
from vllm.v1.worker.utils import AttentionGroup
from vllm_engine.attnsdk_ref import REF_DEBUG, Ref, RefDebug
from vllm_engine.mini_engine import BS, CPU, HKV, LAYERS, D, H, MiniEngine, attention, name

LAYOUTS = [m.name for m in KVCacheLayout]


def run_lifecycle(engine: MiniEngine) -> None:
    a, b, c = engine.add(20), engine.add(40), engine.add(5)
    engine.step([(a, 20), (b, 16)])  # a prefill, a first prefill chunk
    engine.step([(c, 5), (a, 1), (b, 16)])  # mixed, prefill first: any order is fine
    engine.step([(a, 1), (b, 8), (c, 1)], pad_requests=2, pad_tokens=3)  # CUDA-graph padding
    a_blocks = {blk for blocks in a.blocks for blk in blocks}
    engine.finish(a)
    d = engine.add(30)
    engine.step([(d, 30), (b, 3), (c, 1)])  # d reuses a's blocks; b: 3-token verify step
    assert a_blocks & {blk for blocks in d.blocks for blk in blocks}, "no block was reused"
    for _ in range(4):
        engine.step([(b, 1), (c, 1), (d, 1)], pad_requests=1, pad_tokens=1)
    if engine.sliding[engine.group_of[name(1)]]:  # hybrid manager: window blocks are freed
        assert b.blocks[engine.group_of[name(1)]][0] == 0, "no sliding-window block was freed"
    else:  # one group: the window layers keep every block
        assert 0 not in b.blocks[0]
    engine.step([(d, 2), (b, 1)], causal=False)  # a non-causal step (DFlash-style drafts)
    e = engine.add(3)
    engine.finish(c)
    engine.step([(b, 1), (e, 3), (d, 1)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lifecycle(layout: str, kv_cache_dtype: str, dtype: torch.dtype) -> None:
    engine = MiniEngine(layout, kv_cache_dtype, dtype)
    assert engine.backend_cls is Ref
    assert len(engine.kv_cache_config.kv_cache_groups) == 2  # full and sliding window
    expected = torch.uint8 if kv_cache_dtype == "fp8" else dtype
    assert all(cache.dtype == expected for cache in engine.caches.values())
    assert engine.caches[name(4)].data_ptr() == engine.caches[name(0)].data_ptr()
    run_lifecycle(engine)


@pytest.mark.parametrize(
    ("layout", "kv_cache_dtype", "per_head"),
    [("BHLNC", "fp8_e5m2", False), ("LBHNC", "fp8_e4m3", True), ("BLHNC", "auto", True)],
)
def test_lifecycle_fp8_variants(layout: str, kv_cache_dtype: str, per_head: bool) -> None:
    """fp8_e5m2 storage, and per-KV-head scales (a checkpoint's "attn_head" KV scheme)."""
    engine = MiniEngine(layout, kv_cache_dtype, torch.float32, per_head_scales=per_head)
    assert engine.layers[name(0)]._k_scale.shape == ((HKV,) if per_head else ())
    run_lifecycle(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_lifecycle_bf16_single_group_debug_mode(use_custom_backend, kv_cache_dtype: str) -> None:
    """A bf16 model without the hybrid manager (one KV cache group, window layers keep their
    blocks), attnsdk's debug mode validating every plan and forward against the cache."""
    assert use_custom_backend(REF_DEBUG) is RefDebug
    engine = MiniEngine("BLNHC", kv_cache_dtype, torch.bfloat16, hybrid=False)
    assert engine.backend_cls is RefDebug
    assert len(engine.kv_cache_config.kv_cache_groups) == 1
    run_lifecycle(engine)


@pytest.mark.parametrize("debug", [False, True], ids=["hybrid", "single-group-debug"])
def test_lifecycle_kv_sharing_fast_prefill(use_custom_backend, debug: bool) -> None:
    """The trailing KV-sharing layer on vLLM's fast-prefill path (its builder and metadata
    class subclass ours; in prefill steps it runs on each request's last row only)."""
    if debug:
        use_custom_backend(REF_DEBUG)
    engine = MiniEngine("LHBNC", "fp8", torch.float32, hybrid=not debug, fast_prefill=True)
    assert engine.fast_layers == {name(4)}
    run_lifecycle(engine)


def test_debug_mode_accepts_freed_sliding_window_blocks(use_custom_backend) -> None:
    use_custom_backend(REF_DEBUG)
    run_lifecycle(MiniEngine("LBNHC", "auto", torch.float32))


# ---- encoder-only layers ----------------------------------------------------------------------

ENCODER_LAYERS = {"model.layers.0.attn": {}, "model.layers.1.attn": {"window": 6, "sinks": True}}


def encoder_state(vllm_config, layers: dict[str, EncoderOnlyAttention]) -> types.SimpleNamespace:
    """What EncoderOnlyModelState.__init__ sets up: one attention group, dummy tables."""
    spec = EncoderOnlyAttentionSpec(
        block_size=BS, num_kv_heads=HKV, head_size=D, dtype=torch.float32
    )
    group = AttentionGroup(layers[next(iter(layers))].get_attn_backend(), list(layers), spec, 0)
    group.create_metadata_builders(vllm_config, CPU)
    for layer in layers.values():
        layer.kv_cache = torch.empty(0, dtype=torch.float32)
    return types.SimpleNamespace(
        encoder_attn_groups=[group],
        _dummy_block_table=torch.zeros(8, 1, dtype=torch.int32),
        _dummy_slot_mapping=torch.zeros(128, dtype=torch.int64),
        max_model_len=vllm_config.model_config.max_model_len,
    )


@pytest.mark.parametrize("mode", [CUDAGraphMode.NONE, CUDAGraphMode.FULL])
def test_encoder_only_layers(mode: CUDAGraphMode) -> None:
    vllm_config = create_vllm_config(dtype=torch.float32, max_model_len=128)
    vllm_config.attention_config.backend = AttentionBackendEnum.CUSTOM
    gen = torch.Generator().manual_seed(1)
    sinks = {
        n: torch.randn(H, generator=gen) if o.get("sinks") else None
        for n, o in ENCODER_LAYERS.items()
    }
    with set_current_vllm_config(vllm_config):
        layers = {
            n: EncoderOnlyAttention(
                H, D, D**-0.5, num_kv_heads=HKV, cache_config=vllm_config.cache_config,
                prefix=n, per_layer_sliding_window=o.get("window"),
                **({"sinks": sinks[n]} if sinks[n] is not None else {}),
            )
            for n, o in ENCODER_LAYERS.items()
        }  # fmt: skip
    assert all(layer.get_kv_cache_spec(vllm_config) is None for layer in layers.values())
    assert issubclass(next(iter(layers.values())).get_attn_backend(), Ref)
    lens = [5, 1, 17, 40]
    pad_reqs, pad_tokens = (2, 3) if mode == CUDAGraphMode.FULL else (0, 0)
    num_reqs, real = len(lens) + pad_reqs, sum(lens)
    qsl = np.array([0, *np.cumsum(lens), *([real] * pad_reqs)], dtype=np.int32)
    seq = torch.tensor(lens + [0] * pad_reqs, dtype=torch.int32)
    batch = types.SimpleNamespace(
        num_reqs=len(lens), num_reqs_after_padding=num_reqs,
        num_tokens=real, num_tokens_after_padding=real + pad_tokens,
        max_query_len=max(lens), num_scheduled_tokens=np.array(lens),
        query_start_loc=torch.from_numpy(qsl.copy()), query_start_loc_np=qsl,
        seq_lens=seq, seq_lens_cpu_upper_bound=seq.clone(), positions=None,
    )  # fmt: skip
    state = encoder_state(vllm_config, layers)
    metadata = EncoderOnlyModelState._build_encoder_attn_metadata(state, batch, mode, False)  # type: ignore[arg-type]
    for n in layers:  # the group's builder planned the step as ragged attention, once
        assert metadata[n].ragged is metadata[n].plan
        assert metadata[n].plan.metadata.page_table.shape[1] == 0
    rows = real + pad_tokens
    for n, layer in layers.items():
        q, k, v = (torch.randn(rows, h * D, generator=gen) for h in (H, HKV, HKV))
        with set_forward_context(metadata, vllm_config, num_tokens=rows):
            out = layer(q, k, v)
        for b in range(len(lens)):
            r = slice(int(qsl[b]), int(qsl[b + 1]))
            want = attention(
                q[r].view(-1, H, D), k[r].view(-1, HKV, D).double(), v[r].view(-1, HKV, D).double(),
                causal=False, window=ENCODER_LAYERS[n].get("window"), sinks=sinks[n],
            )  # fmt: skip
            got = out[r].view(-1, H, D).double()
            torch.testing.assert_close(
                got, want, atol=1e-4, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}"
            )


def test_model_has_every_layer_kind() -> None:
    """LAYERS keeps a window layer, a sinks layer, both, and a KV-sharing layer."""
    kinds = {(d.window is not None, d.sinks, d.shares is not None) for d in LAYERS.values()}
    assert {(True, False, False), (False, True, False), (True, True, False)} <= kinds
    assert any(d.shares for d in LAYERS.values())

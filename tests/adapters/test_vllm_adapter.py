"""VLLMAdapter: CommonAttentionMetadata → AttentionMetadata, and KV-layout detection."""

from __future__ import annotations

import dataclasses
import importlib.util
import subprocess
import sys

import pytest
import torch

from attnsdk import BackendUnavailableError, InvalidInputError, InvalidMetadataError
from attnsdk.adapters.vllm import VLLMAdapter, VLLMKVLayout, detect_kv_layout
from attnsdk.adapters.vllm.testing import (
    PHYSICAL_LAYOUTS,
    make_kv_cache,
    mock_common_attn_metadata,
    mock_vllm_batch,
)
from attnsdk.testing import BatchSpec

ADAPTER = VLLMAdapter()
N, P, H, D = 5, 16, 2, 8


# ---- metadata ----------------------------------------------------------------------------


def test_fields_map_one_to_one() -> None:
    spec = BatchSpec((1, 7, 3), (40, 7, 19))
    cm = mock_common_attn_metadata(spec, block_size=16, pad_tokens=2)
    meta = ADAPTER.build_metadata(cm)
    assert meta.query_start_loc_cpu.tolist() == [0, 1, 8, 11]
    assert meta.seq_lens_cpu.tolist() == [40, 7, 19]
    assert meta.num_tokens == 11
    assert meta.max_query_len == 7
    assert meta.max_seq_len == 40
    # The block table and slot mapping are vLLM's own tensors, not copies.
    assert meta.page_table.data_ptr() == cm.block_table_tensor.data_ptr()
    assert meta.slot_mapping.data_ptr() == cm.slot_mapping.data_ptr()
    assert meta.slot_mapping.shape[0] == 11  # the 2 padding token rows are cut off
    # Slots follow the block table: token j of request b lives at table[b, j // P] * P + j % P.
    table = cm.block_table_tensor
    assert int(meta.slot_mapping[0]) == int(table[0, 39 // 16]) * 16 + 39 % 16
    assert int(meta.slot_mapping[1]) == int(table[1, 0]) * 16
    meta.validate(ADAPTER.kv_cache(torch.zeros(2, 64, 16, 2, 8), 2, 8))


def test_padded_requests_pass_through() -> None:
    """vLLM's graph padding: query length 0 (repeated query_start_loc), seq_len 0, null block."""
    cm = mock_common_attn_metadata(BatchSpec((1, 4), (9, 4)), pad_requests=3, pad_tokens=4)
    meta = ADAPTER.build_metadata(cm)
    assert meta.num_seqs == 5
    assert meta.query_start_loc_cpu.tolist() == [0, 1, 5, 5, 5, 5]
    assert meta.seq_lens_cpu.tolist() == [9, 4, 0, 0, 0]
    assert meta.page_table[2:].eq(0).all()
    meta.validate(ADAPTER.kv_cache(torch.zeros(2, 8, 16, 2, 8), 2, 8))


def test_numpy_host_ints_are_host_ints() -> None:
    """vLLM's chunked-local virtual batch (make_local_attention_virtual_batches) sets
    ``max_query_len`` to a numpy int; a bool is still no int."""
    np = pytest.importorskip("numpy")
    cm = mock_common_attn_metadata(BatchSpec((1, 7), (40, 7)))
    meta = ADAPTER.build_metadata(dataclasses.replace(cm, max_query_len=np.int32(7)))
    assert meta.max_query_len == 7
    assert type(meta.max_query_len) is int
    with pytest.raises(InvalidMetadataError, match="max_query_len"):
        ADAPTER.build_metadata(dataclasses.replace(cm, max_query_len=True))


def test_num_reqs_slices_wider_buffers() -> None:
    """vLLM hands views of persistent buffers; only the first num_reqs rows are this step's."""
    cm = mock_common_attn_metadata(BatchSpec((2, 1), (2, 30)))
    wide = dataclasses.replace(
        cm,
        query_start_loc=torch.cat([cm.query_start_loc, torch.full((3,), 3, dtype=torch.int32)]),
        query_start_loc_cpu=torch.cat(
            [cm.query_start_loc_cpu, torch.full((3,), 3, dtype=torch.int32)]
        ),
        seq_lens=torch.cat([cm.seq_lens, torch.zeros(3, dtype=torch.int32)]),
        block_table_tensor=torch.cat(
            [
                cm.block_table_tensor,
                torch.zeros(3, cm.block_table_tensor.shape[1], dtype=torch.int32),
            ]
        ),
        seq_lens_cpu_upper_bound=torch.cat([cm.seq_lens, torch.zeros(3, dtype=torch.int32)]),
    )
    meta = ADAPTER.build_metadata(wide)
    assert meta.num_seqs == 2
    assert meta.page_table.shape[0] == 2
    assert meta.query_start_loc.tolist() == [0, 2, 3]


def test_host_seq_lens_without_sync() -> None:
    """Device seq_lens are never read on the host: vLLM's upper bound is taken as it is."""
    spec = BatchSpec((1, 3, 2), (12, 3, 40))
    cm = mock_common_attn_metadata(spec)
    # A meta tensor has no data: reading it on the host would fail loudly.
    on_device = dataclasses.replace(cm, seq_lens=torch.empty(3, dtype=torch.int32, device="meta"))
    got = ADAPTER.host_seq_lens(on_device, 3)
    assert got.tolist() == [12, 3, 40]
    assert cm.seq_lens_cpu_upper_bound is not None
    assert got.data_ptr() == cm.seq_lens_cpu_upper_bound.data_ptr()


def test_missing_host_seq_lens_is_a_clear_error() -> None:
    cm = mock_common_attn_metadata(BatchSpec((1,), (5,)), host_seq_lens=False)
    on_device = dataclasses.replace(cm, seq_lens=torch.empty(1, dtype=torch.int32, device="meta"))
    with pytest.raises(InvalidMetadataError, match=r"override VLLMAdapter\.host_seq_lens"):
        ADAPTER.host_seq_lens(on_device, 1)


def test_subclass_hook_overrides_one_field() -> None:
    class Fork(VLLMAdapter):
        def page_table(self, cm: object, num_reqs: int) -> torch.Tensor:
            return super().page_table(cm, num_reqs) + 100

    cm = mock_common_attn_metadata(BatchSpec((1,), (5,)))
    assert int(Fork().build_metadata(cm).page_table[0, 0]) == int(cm.block_table_tensor[0, 0]) + 100


def test_causal_flag() -> None:
    cm = mock_common_attn_metadata(BatchSpec((3,), (3,)), causal=False)
    assert ADAPTER.causal(cm) is False
    uniform = dataclasses.replace(cm, causal=torch.tensor([True, True]))
    assert ADAPTER.causal(uniform) is True
    with pytest.raises(InvalidMetadataError, match="same value for every request"):
        ADAPTER.causal(dataclasses.replace(cm, causal=torch.tensor([True, False])))


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_reqs", None, "num_reqs: expected a host int"),
        ("seq_lens", [3], "seq_lens: expected a torch.Tensor"),
        (
            "block_table_tensor",
            torch.zeros(4, dtype=torch.int32),
            "block_table_tensor: expected 2 dims",
        ),
        ("query_start_loc_cpu", torch.zeros(1, dtype=torch.int32), "num_reqs \\+ 1"),
    ],
)
def test_malformed_metadata_names_the_field(field: str, value: object, match: str) -> None:
    cm = mock_common_attn_metadata(BatchSpec((1, 1), (4, 9)))
    with pytest.raises(InvalidMetadataError, match=match):
        ADAPTER.build_metadata(dataclasses.replace(cm, **{field: value}))


def test_layer_spec_follows_vllm_conventions() -> None:
    layer = ADAPTER.layer_spec(8, 64, 0.1, 2, sliding_window=128, logits_soft_cap=0.0)
    assert layer.sliding_window == 128
    assert layer.window_left == 127
    assert layer.softcap is None
    assert layer.causal
    assert layer.scale == 0.1
    encoder = ADAPTER.layer_spec(8, 64, 0.1, 2, sliding_window=16, attn_type="encoder_only")
    assert not encoder.causal  # a symmetric (W-1, W-1) window, as vLLM gives FA
    with pytest.raises(InvalidInputError, match="sliding_window"):
        ADAPTER.layer_spec(8, 64, 0.1, 2, sliding_window=0)


# ---- KV layouts --------------------------------------------------------------------------


def _kv(
    layout: str, physical: str = "LBNHC", n: int = N, num_layers: int = 1, layer: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = torch.randn(n, P, H, D)
    v = torch.randn(n, P, H, D)
    t = make_kv_cache(k, v, layout, physical, num_layers=num_layers, layer=layer)
    return t, k, v


LAYOUT_CASES = [
    *((VLLMKVLayout.PACKED, physical, 3) for physical in PHYSICAL_LAYOUTS),
    (VLLMKVLayout.KV_BLOCKS, "LBNHC", 1),
    (VLLMKVLayout.BLOCKS_KV, "LBNHC", 1),
]


@pytest.mark.parametrize(
    ("layout", "physical", "num_layers"),
    LAYOUT_CASES,
    ids=[f"{c[0].name}-{c[1]}" for c in LAYOUT_CASES],
)
def test_layouts_are_detected_and_viewed_without_copy(
    layout: VLLMKVLayout, physical: str, num_layers: int
) -> None:
    # The middle layer of a multi-layer buffer: in the B-first layouts its blocks interleave
    # with the other layers' blocks.
    t, k, v = _kv(layout.name, physical, num_layers=num_layers, layer=num_layers // 2)
    assert detect_kv_layout(t, H, D) is layout
    cache = ADAPTER.kv_cache(t, H, D)
    assert torch.equal(cache.k, k)
    assert torch.equal(cache.v, v)
    assert cache.layout.page_size == P
    assert cache.num_pages == N
    # Zero-copy: both views live inside vLLM's storage, and writes land there.
    lo, hi = t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()
    assert lo <= cache.k.data_ptr() < hi
    assert lo <= cache.v.data_ptr() < hi
    cache.store(torch.full((1, H, D), 7.0), torch.full((1, H, D), -7.0), torch.tensor([3 * P + 5]))
    assert (t == 7.0).sum() == H * D
    assert (t == -7.0).sum() == H * D
    assert torch.equal(cache.k[3, 5], torch.full((H, D), 7.0))


def test_two_blocks_is_ambiguous_unless_told() -> None:
    t, k, _ = _kv("BLOCKS_KV", n=2)
    with pytest.raises(InvalidInputError, match="reads as both"):
        ADAPTER.kv_cache(t, H, D)
    cache = ADAPTER.kv_cache(t, H, D, layout=VLLMKVLayout.BLOCKS_KV)
    assert torch.equal(cache.k, k)
    assert ADAPTER.kv_cache(t, H, D, layout="KV_BLOCKS").k.data_ptr() == t.data_ptr()


@pytest.mark.parametrize(
    ("shape", "match"),
    [
        (
            (3, N, P, H, D),
            "one of \\[2, N, P, Hkv, D\\], \\[N, 2, P, Hkv, D\\], \\[N, Hkv, P, 2D\\]",
        ),
        ((2, N, P, H + 1, D), "Hkv=2, D=8"),
        ((N, P, H, 2 * D), "physical \\[N, P, Hkv, 2D\\] memory"),
        ((N, H, P, D), "found \\(5, 2, 16, 8\\)"),
        ((N * P, H, D), "kv_cache.shape"),
    ],
)
def test_other_shapes_are_rejected_with_the_reason(shape: tuple[int, ...], match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        ADAPTER.kv_cache(torch.zeros(shape), H, D)


def test_layout_hint_must_match_the_shape() -> None:
    t, _, _ = _kv("PACKED")
    with pytest.raises(InvalidInputError, match="the layout passed"):
        ADAPTER.kv_cache(t, H, D, layout=VLLMKVLayout.KV_BLOCKS)
    with pytest.raises(InvalidInputError, match="layout: expected a VLLMKVLayout"):
        ADAPTER.kv_cache(t, H, D, layout="NHD")


def test_head_dim_must_be_contiguous() -> None:
    t = torch.zeros(2, N, P, D, H).transpose(3, 4)  # [2, N, P, H, D] with stride 2 in D
    with pytest.raises(InvalidInputError, match="stride 1 in the head dim"):
        ADAPTER.kv_cache(t, H, D)


def test_fp8_storage_is_reinterpreted_not_copied() -> None:
    batch = mock_vllm_batch(
        BatchSpec((1,), (4,)), num_kv_heads=H, head_size=D, kv_cache_dtype="fp8"
    )
    t = batch.kv_cache
    assert t.dtype == torch.uint8
    cache = ADAPTER.kv_cache(t, H, D, dtype=torch.bfloat16, kv_cache_dtype="fp8")
    assert cache.k.dtype == torch.float8_e4m3fn
    assert cache.layout.dtype == torch.bfloat16
    assert cache.k.data_ptr() == t.data_ptr()
    with pytest.raises(InvalidInputError, match="kv_cache_dtype: expected 'fp8'"):
        ADAPTER.kv_cache(t, H, D, dtype=torch.bfloat16)
    with pytest.raises(InvalidInputError, match="compute dtype"):
        ADAPTER.kv_cache(t, H, D, kv_cache_dtype="fp8")
    with pytest.raises(InvalidInputError, match="kv_cache_dtype: expected 'auto'"):
        ADAPTER.kv_cache(t, H, D, kv_cache_dtype="int4")


# ---- package surface ---------------------------------------------------------------------


def test_public_names_are_pinned() -> None:
    import attnsdk.adapters.vllm as vllm_adapter

    assert vllm_adapter.__all__ == [
        "VLLM_VERSIONS",
        "AttnSDKAttentionBackend",
        "AttnSDKAttentionImpl",
        "AttnSDKMLABackend",
        "AttnSDKMLAImpl",
        "AttnSDKMLAMetadataBuilder",
        "AttnSDKMLAPrefillBackend",
        "AttnSDKMetadataBuilder",
        "BackendSpec",
        "VLLMAdapter",
        "VLLMAttentionMetadata",
        "VLLMCudaGraphSupport",
        "VLLMKVLayout",
        "detect_kv_layout",
        "register",
        "register_mla_prefill",
    ]
    for name in vllm_adapter.__all__:
        if name.startswith("AttnSDKMLA") and importlib.util.find_spec("vllm") is None:
            with pytest.raises(BackendUnavailableError):  # vLLM subclasses: vLLM needed
                getattr(vllm_adapter, name)
        else:
            assert hasattr(vllm_adapter, name), name


def test_importing_the_adapter_never_imports_vllm() -> None:
    code = (
        "import sys, attnsdk.adapters.vllm, attnsdk.adapters.vllm.testing\n"
        "loaded = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)

"""attnsdk's SGLang mocks (``attnsdk.adapters.sglang.testing``) against SGLang's own classes.

The unit tests in tests/adapters run the adapter on these mocks only, so each mock must say what
the real class says: every MockForwardBatch field is a ForwardBatch field of the same kind; the
mock ForwardMode has 0.5.23's members, values and predicates (0.5.12.post1 differs only where
documented); MockRadixAttention.from_layer_spec builds what RadixAttention's constructor builds;
MockKVPool, MockModelConfig, VerifyInput and MockModelRunner use real names; and
MockCudaGraphRunner pads a replay like the installed release's graph runner.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
import torch
from real_sglang import NEW_HOOKS, Pools
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.speculative.eagle_info import EagleVerifyInput

from attnsdk import LayerSpec, UnsupportedConfigError
from attnsdk.adapters.sglang import SGLangAttentionBackend, step_kind
from attnsdk.adapters.sglang import testing as mocks
from attnsdk.testing import BatchSpec

ONLY_0_5_12 = {"DRAFT_EXTEND"}
"""Members 0.5.12.post1 has and the mock (0.5.23's enum) does not."""


def kind(annotation: object) -> str:
    text = str(annotation)
    for name in ("Tensor", "ForwardMode", "List", "list", "int"):
        if name in text:
            return {"List": "list"}.get(name, name)
    return "any"


def test_forward_batch_fields_are_real_fields():
    real = {f.name: f for f in dataclasses.fields(ForwardBatch)}
    for f in dataclasses.fields(mocks.MockForwardBatch):
        assert f.name in real, f"MockForwardBatch.{f.name} is not a ForwardBatch field"
        if kind(f.type) != "any":
            assert kind(f.type) == kind(real[f.name].type), (f.name, f.type, real[f.name].type)


def predicates(cls: type) -> dict[str, inspect.Signature]:
    return {
        n: inspect.signature(fn)
        for n, fn in vars(cls).items()
        if n.startswith("is_") and callable(fn)
    }


def calls(sig: inspect.Signature) -> list[dict[str, bool]]:
    flags = [n for n in sig.parameters if n != "self"]
    return [{}] + [{n: True} for n in flags]


def test_forward_mode_members_and_predicates():
    mock_members = {m.name: m for m in mocks.ForwardMode}
    real_members = {m.name: m for m in ForwardMode}
    if NEW_HOOKS:
        assert {n: m.value for n, m in mock_members.items()} == {
            n: m.value for n, m in real_members.items()
        }
        assert predicates(mocks.ForwardMode).keys() == predicates(ForwardMode).keys()
    else:
        # The mock models 0.5.23: 0.5.12.post1 also has DRAFT_EXTEND (value 6), which shifts
        # the values of the members declared after it by one.
        assert real_members.keys() - mock_members.keys() == ONLY_0_5_12
        assert mock_members.keys() <= real_members.keys()
        cut = real_members["DRAFT_EXTEND"].value
        for name, m in mock_members.items():
            assert real_members[name].value == m.value + (m.value >= cut), name
        only_real = predicates(ForwardMode).keys() - predicates(mocks.ForwardMode).keys()
        assert only_real == {"is_draft_extend"}, "0.5.12-only predicate (of DRAFT_EXTEND)"
        assert predicates(mocks.ForwardMode).keys() <= predicates(ForwardMode).keys()
    for name, sig in predicates(mocks.ForwardMode).items():
        assert sig.parameters.keys() == predicates(ForwardMode)[name].parameters.keys(), name
        for member, m in mock_members.items():
            for kwargs in calls(sig):
                want = getattr(real_members[member], name)(**kwargs)
                assert getattr(m, name)(**kwargs) == want, (member, name, kwargs)


@pytest.mark.parametrize("member", [m.name for m in ForwardMode])
def test_adapter_classifies_real_and_mock_modes_alike(member):
    real = ForwardMode[member]
    if member in ONLY_0_5_12:
        assert not NEW_HOOKS
        assert step_kind(real).value == "extend", "0.5.12's DRAFT_EXTEND is an extend"
        return
    try:
        want = step_kind(mocks.ForwardMode[member])
    except UnsupportedConfigError:
        with pytest.raises(UnsupportedConfigError):
            step_kind(real)
    else:
        assert step_kind(real) is want


LAYERS = [
    LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64),
    LayerSpec(num_heads=4, num_kv_heads=4, head_dim=32, sliding_window=128),
    LayerSpec(num_heads=4, num_kv_heads=1, head_dim=32, softcap=30.0, scale=0.1),
    LayerSpec(num_heads=4, num_kv_heads=2, head_dim=64, v_head_dim=32, causal=False),
    LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64, attention_chunk_size=8192),
]


@pytest.mark.parametrize("spec", LAYERS, ids=["gqa", "window", "softcap", "encoder_dv", "irope"])
def test_radix_attention_from_layer_spec(spec):
    mock = mocks.MockRadixAttention.from_layer_spec(spec, layer_id=3)
    real = RadixAttention(
        spec.num_heads,
        spec.head_dim,
        spec.softmax_scale,
        spec.num_kv_heads,
        3,
        logit_cap=spec.softcap or 0.0,
        v_head_dim=spec.v_dim,
        sliding_window_size=spec.window_left,
        attn_type=AttentionType.DECODER if spec.causal else AttentionType.ENCODER_ONLY,
        use_irope=spec.attention_chunk_size is not None,
    )
    for f in dataclasses.fields(mock):
        value = getattr(mock, f.name)
        assert hasattr(real, f.name), f"RadixAttention has no {f.name}"
        found = getattr(real, f.name)
        if isinstance(value, mocks.AttentionType):
            value, found = value.value, found.value
        assert found == value, (f.name, found, value)


def test_kv_pool_methods_have_real_parameters():
    real_pool = Pools(16, torch.float32).kv_pool
    for attr in ("k_buffer", "v_buffer", "start_layer"):
        assert hasattr(real_pool, attr), attr
    for name in ("get_key_buffer", "get_value_buffer", "get_kv_buffer", "set_kv_buffer"):
        mine = list(inspect.signature(getattr(mocks.MockKVPool, name)).parameters)
        real = list(inspect.signature(getattr(MHATokenToKVPool, name)).parameters)
        if name == "set_kv_buffer" and not NEW_HOOKS:
            # The mock models 0.5.23: 0.5.12.post1 names the slots `loc` and has no DCP mask.
            assert real == [
                "self",
                "layer",
                "loc",
                "cache_k",
                "cache_v",
                "k_scale",
                "v_scale",
                "layer_id_override",
            ]
            mine = [{"loc_info": "loc"}.get(n, n) for n in mine if n != "dcp_kv_mask"]
        assert mine == real, name


def test_model_config_and_verify_input_use_real_names():
    for name in ("get_total_num_kv_heads", "get_num_kv_heads"):
        mine = list(inspect.signature(getattr(mocks.MockModelConfig, name)).parameters)
        real = list(inspect.signature(getattr(ModelConfig, name)).parameters)
        if name == "get_num_kv_heads" and not NEW_HOOKS:
            assert real == ["self", "tensor_parallel_size"], "0.5.12.post1: no DCP"
            mine = mine[:2]
        assert mine == real, name
    source = inspect.getsource(ModelConfig)
    for f in dataclasses.fields(mocks.MockModelConfig):
        assert f"self.{f.name} =" in source, f"ModelConfig never sets {f.name}"
    eagle = {f.name for f in dataclasses.fields(EagleVerifyInput)}
    assert {f.name for f in dataclasses.fields(mocks.VerifyInput)} <= eagle
    assert hasattr(Pools(1, torch.float32).req_to_token_pool, "req_to_token")


def test_model_runner_fields_are_set_by_the_real_runner():
    source = "".join(inspect.getsource(c) for c in ModelRunner.__mro__ if c is not object)
    assigned = set(re.findall(r"self\.(\w+)\s*(?::[^=\n]+)?=[^=]", source))
    missing = {f.name for f in dataclasses.fields(mocks.MockModelRunner)} - assigned
    # kv_index_translator (unified KV memory) arrived after 0.5.12.post1.
    assert missing == (set() if NEW_HOOKS else {"kv_index_translator"})


def test_graph_runner_pads_like_the_release():
    """Two replays (5 rows, then 3) through MockCudaGraphRunner and through the static buffers
    of the installed release's decode graph runner leave the same graph inputs."""
    layer = LayerSpec(num_heads=4, num_kv_heads=2, head_dim=16)
    M = mocks.ForwardMode
    big = mocks.make_sglang_batch(
        BatchSpec((1,) * 5, (9, 17, 3, 30, 12)), layer, M.DECODE, page_size=4
    )
    small = big.first_rows(3)
    runner = big.model_runner
    dropin = SGLangAttentionBackend(runner, "reference")
    hooks = "out_graph" if NEW_HOOKS else "legacy"
    mock = mocks.MockCudaGraphRunner(dropin, runner, [2, 4, 8], hooks=hooks)
    real = RealStaticInputs(max_bs=8, fill=dropin.get_cuda_graph_seq_len_fill_value())
    for batch, bs in ((big, 8), (small, 4)):
        static = mock.replay_prepare(batch.forward_batch)
        real.fill(batch.forward_batch, bs)
        assert static.batch_size == bs
        for name in ("req_pool_indices", "seq_lens", "seq_lens_cpu", "out_cache_loc"):
            assert getattr(static, name).tolist() == real.get(name, bs).tolist(), name
    # The padding row of the second replay: 0.5.12 leaves the first replay's request row there,
    # 0.5.13+ resets it to row 0.
    stale = int(big.forward_batch.req_pool_indices[3])
    assert stale != 0
    assert int(real.get("req_pool_indices", 4)[3]) == (0 if NEW_HOOKS else stale)


class RealStaticInputs:
    """The decode graph runner's static inputs, filled by the release's own code."""

    def __init__(self, max_bs: int, fill: int) -> None:
        self.fill_value = fill
        if NEW_HOOKS:
            from sglang.srt.model_executor.cuda_graph_buffer_registry import (
                build_decode_registry,
            )

            self.registry = build_decode_registry(
                device=torch.device("cpu"),
                max_bs=max_bs,
                max_num_token=max_bs,
                seq_len_fill_value=fill,
                cache_loc_dtype=torch.int64,
                share_pool=False,
            )
        else:
            from sglang.srt.model_executor.cuda_graph_runner import DecodeInputBuffers

            self.buffers = DecodeInputBuffers.create(
                device="cpu",
                max_bs=max_bs,
                max_num_token=max_bs,
                hidden_size=8,
                vocab_size=8,
                dtype=torch.float32,
                dp_size=1,
                pp_size=1,
                is_encoder_decoder=False,
                require_mlp_tp_gather=False,
                seq_len_fill_value=fill,
                encoder_len_fill_value=0,
                num_tokens_per_bs=1,
                cache_loc_dtype=torch.int64,
                enable_mamba_track=False,
            )

    def fill(self, mock_fb: mocks.MockForwardBatch, bs: int) -> None:
        raw = mock_fb.batch_size
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=raw,
            input_ids=torch.zeros(raw, dtype=torch.int64),
            req_pool_indices=mock_fb.req_pool_indices,
            seq_lens=mock_fb.seq_lens,
            seq_lens_cpu=mock_fb.seq_lens_cpu,
            out_cache_loc=mock_fb.out_cache_loc,
            seq_lens_sum=mock_fb.seq_lens_sum,
            positions=mock_fb.seq_lens - 1,
        )
        if NEW_HOOKS:  # DecodeCudaGraphRunner.load_batch
            self.registry.fill_from(
                fb, raw_bs=raw, padded_bs=bs, raw_num_tokens=raw, padded_num_tokens=bs
            )
        else:  # CudaGraphRunner.replay_prepare
            self.buffers.populate_from_forward_batch(
                forward_batch=fb,
                raw_bs=raw,
                raw_num_token=raw,
                bs=bs,
                seq_len_fill_value=self.fill_value,
                require_gathered_buffer=False,
                num_tokens_per_bs=1,
                nsa_enable_prefill_cp=False,
                enable_num_token_non_padded_flag=False,
            )

    def get(self, name: str, bs: int) -> torch.Tensor:
        if NEW_HOOKS:
            return self.registry.get_slot(name).buffer[:bs]
        return getattr(self.buffers, name)[:bs]

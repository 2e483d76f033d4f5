"""SGLang 0.5.23's own attention test kit (``sglang.test.kits.attention_unittest``) on the drop-in.

The drop-in is registered as ``"attnsdk"`` (real_sglang.py); the kit builds it through
``ATTENTION_BACKENDS[case.backend](runner)`` with its ``MockModelRunner`` (a real ``ModelRunner``
subclass) and compares with its own reference: every dense case (``make_dense_cases`` and the
sliding-window cases) in fp16 and bf16, its CUDA-graph decode flow (capture, warm-up,
``on_after_cuda_graph_warmup``, a padded replay, against reference and eager), and its
speculative verify flows: EAGLE chains, DFlash, frozen-KV MTP, EAGLE trees (topk 2) and NGRAM
trees, against the kit's own reference with its custom masks. A case the kit would skip fails
here. 0.5.12.post1 ships no kit: there each test asserts its absence.
"""

from __future__ import annotations

import importlib.util
import unittest

import pytest
import torch
from real_sglang import DROPIN, NEW_HOOKS
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from attnsdk.adapters.sglang import SGLangAttentionBackend

KIT = "sglang.test.kits.attention_unittest"


class StrictCase(unittest.TestCase):
    """The kit skips a case whose backend fails to build: here that is a failure."""

    __test__ = False  # a helper the kit calls, not a test of its own

    def runTest(self) -> None:
        pass

    def skipTest(self, reason: str) -> None:
        raise AssertionError(f"the kit skipped the case: {reason}")


def kit_cases() -> list:
    if not NEW_HOOKS:
        return [None]  # 0.5.12.post1 ships no kit; the test asserts that
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as da

    return [
        *da.make_dense_cases(DROPIN),
        *da.make_swa_no_prefix_input_config_cases(DROPIN),
        *da.make_swa_prefix_input_config_cases(DROPIN),
    ]


CASES = kit_cases()
IDS = [c.name if c else "no-kit-in-0.5.12" for c in CASES]


@pytest.fixture
def built(monkeypatch):
    """Every backend the kit builds from SGLang's registry (``ATTENTION_BACKENDS[name]``)."""
    made, factory = [], ATTENTION_BACKENDS[DROPIN]

    def build(runner):
        made.append(factory(runner))
        return made[-1]

    monkeypatch.setitem(ATTENTION_BACKENDS, DROPIN, build)
    return made


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kit_dense_case(case, dtype, built):
    if case is None:
        assert importlib.util.find_spec(KIT) is None, "0.5.12.post1 has no attention kit"
        return
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as da

    da.run_dense_attention_case(StrictCase(), case, device="cpu", dtype=dtype)
    assert [type(b) for b in built] == [SGLangAttentionBackend]


DECODE_CASES = [c for c in CASES if c is None or c.forward_mode.is_decode()]


@pytest.mark.parametrize("case", DECODE_CASES, ids=[IDS[CASES.index(c)] for c in DECODE_CASES])
def test_kit_cuda_graph_decode(case, built):
    if case is None:
        assert importlib.util.find_spec(KIT) is None, "0.5.12.post1 has no attention kit"
        return
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg

    assert case.batch_size < cg.DENSE_CUDA_GRAPH_CAPTURE_BATCH_SIZE, "the replay must be padded"
    cg.run_dense_cuda_graph_decode_case(StrictCase(), case, device="cpu", dtype=torch.bfloat16)
    assert [type(b) for b in built] == [SGLangAttentionBackend] * 2  # eager, then graph


VERIFY = [("eagle", 1), ("dflash", 1), ("frozen_kv_mtp", 1), ("eagle", 2), ("ngram", 1)]
"""(kind, topk): topk 2 and NGRAM are draft trees."""


@pytest.mark.parametrize(
    ("kind", "topk"),
    VERIFY if NEW_HOOKS else [(None, 0)],
    ids=[f"{k}-topk{t}" for k, t in VERIFY] if NEW_HOOKS else ["no-kit-in-0.5.12"],
)
def test_kit_spec_verify(kind, topk, built):
    if kind is None:
        assert importlib.util.find_spec(KIT) is None, "0.5.12.post1 has no attention kit"
        return
    from sglang.test.kits.attention_unittest.attention_methods.dense_attention import (
        DenseAttentionCase,
    )
    from sglang.test.kits.attention_unittest.runner_modes import (
        speculative_target_verify_runner as sv,
    )

    case = DenseAttentionCase(
        name=f"verify_{kind}_{topk}",
        backend=DROPIN,
        forward_mode=ForwardMode.TARGET_VERIFY,
        num_heads=4,
        num_kv_heads=2,
        page_size=16,
        prefix_lens=(7, 20),
        extend_lens=(3, 3),
    )
    kwargs = dict(topk=topk, spec_kind=kind, device="cpu", dtype=torch.bfloat16)
    sv.run_dense_spec_verify_case(StrictCase(), case, **kwargs)
    assert built
    assert all(type(b) is SGLangAttentionBackend for b in built)


def mla_cases() -> list:
    if importlib.util.find_spec(KIT) is None:
        return [None]
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as ma

    return list(ma.make_mla_cases(DROPIN))


MLA_CASES = mla_cases()
MLA_IDS = [c.name if c else "no-kit-in-0.5.12" for c in MLA_CASES]
MLA_DIMS = [(32, 0), (32, 16), (512, 64)]
"""(kv_lora_rank, rope): the kit's default (no rope: K is the latent), one with a rope part
(the kit's q = [q_nope W_UK, q_rope] path), DeepSeek's (on the cases of at most two requests:
CPU time)."""
MLA_RUNS = [
    (case, rank, rope)
    for case in MLA_CASES
    for rank, rope in MLA_DIMS
    if case is None or rank < 512 or case.batch_size <= 2
]


@pytest.mark.parametrize(
    ("case", "rank", "rope"),
    MLA_RUNS,
    ids=[f"{MLA_IDS[MLA_CASES.index(c)]}-r{r}-rope{p}" for c, r, p in MLA_RUNS],
)
def test_kit_mla_case(case, rank, rope, built):
    """The kit's MLA model (``MLATokenToKVPool``, its absorbed ``attn_mqa``) on the drop-in,
    every extend and decode case, against the kit's own latent-space reference."""
    if case is None:
        assert importlib.util.find_spec(KIT) is None, "0.5.12.post1 has no attention kit"
        return
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as ma

    ma.run_mla_attention_case(
        StrictCase(), case, kv_lora_rank=rank, qk_rope_head_dim=rope, device="cpu",
        dtype=torch.bfloat16,
    )  # fmt: skip
    assert built
    assert all(type(b) is SGLangAttentionBackend for b in built)


MLA_DECODE = [c for c in MLA_CASES if c is None or c.forward_mode.is_decode()]


@pytest.mark.parametrize("case", MLA_DECODE, ids=[MLA_IDS[MLA_CASES.index(c)] for c in MLA_DECODE])
def test_kit_mla_cuda_graph_decode(case, built):
    """The kit's MLA CUDA-graph decode flow (capture, warm-up, padded replay) on the drop-in:
    inside the graph the latent is written through the pool's ``set_kv_buffer``."""
    if case is None:
        assert importlib.util.find_spec(KIT) is None, "0.5.12.post1 has no attention kit"
        return
    from sglang.test.kits.attention_unittest.runner_modes import cuda_graph_decode_runner as cg

    cg.run_mla_cuda_graph_decode_case(
        StrictCase(), case, qk_rope_head_dim=16, device="cpu", dtype=torch.bfloat16
    )
    assert [type(b) for b in built] == [SGLangAttentionBackend] * 2

"""``merge_states`` on the CPU (its PyTorch path; tests/gpu/test_merge_states.py checks the
Triton kernel against it): two attention parts merged equal one pass over all their keys."""

from __future__ import annotations

import math

import pytest
import torch

import attnsdk as A
from attnsdk.testing import assert_close_to_reference

NEG_INF = float("-inf")


def attend(
    scores: torch.Tensor, values: torch.Tensor, sink: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 attention of each (row, head) over its own keys: scores (T, H, L), values
    (T, H, L, Dv), an optional per-head sink logit (H,). Returns (out, natural-log lse)."""
    logits = scores
    if sink is not None:
        column = sink.view(1, -1, 1).expand(scores.shape[0], -1, 1)
        logits = torch.cat([scores, column], dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("thl,thld->thd", probs, values), lse


def parts(
    seed: int, t: int = 5, h: int = 3, length: int = 40, dv: int = 16
) -> tuple[torch.Tensor, torch.Tensor, int]:
    gen = torch.Generator().manual_seed(seed)
    scores = 3.0 * torch.randn(t, h, length, generator=gen, dtype=torch.float64)
    values = torch.randn(t, h, length, dv, generator=gen, dtype=torch.float64)
    split = int(torch.randint(1, length, (), generator=gen))
    return scores, values, split


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink-in-one-part"])
@pytest.mark.parametrize("seed", range(4))
def test_two_parts_merge_to_one_pass(dtype: torch.dtype, sink: bool, seed: int) -> None:
    scores, values, split = parts(seed)
    sinks = 2.0 * torch.randn(scores.shape[1], dtype=torch.float64) if sink else None
    full, full_lse = attend(scores, values, sinks)
    out_a, lse_a = attend(scores[..., :split], values[:, :, :split], sinks)  # the sink: here only
    out_b, lse_b = attend(scores[..., split:], values[:, :, split:])
    out, lse = A.merge_states(out_a.to(dtype), lse_a.float(), out_b.to(dtype), lse_b.float())
    assert out.dtype == dtype
    assert lse.dtype == torch.float32
    assert_close_to_reference(out, full.to(dtype))
    assert_close_to_reference(lse, full_lse.float(), atol=1e-5, rtol=1e-5)


def test_three_parts_merge_in_any_order() -> None:
    scores, values, _ = parts(7, length=60)
    full, full_lse = attend(scores, values)
    cuts = [(0, 11), (11, 37), (37, 60)]
    (a, la), (b, lb), (c, lc) = (
        tuple(x.float() for x in attend(scores[..., i:j], values[:, :, i:j])) for i, j in cuts
    )
    for first, second in (((a, la), (b, lb)), ((b, lb), (a, la))):
        ab, lab = A.merge_states(*first, *second)
        out, lse = A.merge_states(c, lc, ab, lab)
        assert_close_to_reference(out, full.float(), atol=1e-5, rtol=1e-5)
        assert_close_to_reference(lse, full_lse.float(), atol=1e-5, rtol=1e-5)


def test_a_part_that_saw_nothing_leaves_the_other_exactly() -> None:
    """lse -inf: the part contributes nothing and its output is not read (NaN stays out)."""
    out_a = torch.randn(4, 3, 8, dtype=torch.bfloat16)
    lse_a = torch.randn(4, 3)
    out_b = torch.full((4, 3, 8), float("nan"), dtype=torch.bfloat16)
    lse_b = torch.full((4, 3), NEG_INF)
    for args in ((out_a, lse_a, out_b, lse_b), (out_b, lse_b, out_a, lse_a)):
        out, lse = A.merge_states(*args)
        assert torch.equal(out, out_a)
        assert torch.equal(lse, lse_a)


def test_both_parts_saw_nothing() -> None:
    garbage = torch.full((2, 2, 4), float("nan"))
    nothing = torch.full((2, 2), NEG_INF)
    out, lse = A.merge_states(garbage, nothing, garbage.clone(), nothing.clone())
    assert torch.equal(out, torch.zeros_like(out))
    assert bool(lse.isneginf().all())


def test_mixed_rows_and_heads() -> None:
    """-inf in some (row, head) pairs only: each pair is merged on its own."""
    out_a, out_b = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    lse_a = torch.tensor([[0.5, NEG_INF], [NEG_INF, NEG_INF], [1.0, 2.0]])
    lse_b = torch.tensor([[NEG_INF, 0.3], [NEG_INF, 1.5], [1.0, -3.0]])
    out, lse = A.merge_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[0, 0], out_a[0, 0])
    assert torch.equal(out[0, 1], out_b[0, 1])
    assert torch.equal(out[1, 0], torch.zeros(4))
    assert torch.equal(out[1, 1], out_b[1, 1])
    assert torch.allclose(out[2, 0], (out_a[2, 0] + out_b[2, 0]) / 2)
    both = [1.0 + math.log(2.0), math.log(math.exp(2.0) + math.exp(-3.0))]
    expected = torch.tensor([[0.5, 0.3], [NEG_INF, 1.5], both])
    assert torch.allclose(lse, expected)


def test_large_log_sum_exps_do_not_overflow() -> None:
    out_a, out_b = torch.ones(1, 1, 2), -torch.ones(1, 1, 2)
    out, lse = A.merge_states(out_a, torch.tensor([[1000.0]]), out_b, torch.tensor([[1000.0]]))
    assert torch.equal(out, torch.zeros(1, 1, 2))
    assert torch.isclose(lse, torch.tensor([[1000.0 + 0.6931472]]))


def test_out_and_lse_out_are_written_and_returned() -> None:
    out_a, out_b = torch.randn(3, 2, 8, dtype=torch.float16), torch.randn(3, 2, 8).half()
    lse_a, lse_b = torch.randn(3, 2), torch.randn(3, 2)
    expected, expected_lse = A.merge_states(out_a, lse_a, out_b, lse_b)
    out, lse_out = torch.empty_like(out_a), torch.empty(3, 2)
    got, got_lse = A.merge_states(out_a, lse_a, out_b, lse_b, out=out, lse_out=lse_out)
    assert got is out
    assert got_lse is lse_out
    assert torch.equal(out, expected)
    assert torch.equal(lse_out, expected_lse)
    # In place: out=out_a, lse_out=lse_a.
    A.merge_states(out_a, lse_a, out_b, lse_b, out=out_a, lse_out=lse_a)
    assert torch.equal(out_a, expected)
    assert torch.equal(lse_a, expected_lse)


def test_views_need_no_copy() -> None:
    """Strided parts (a head slice of a wider buffer) merge like contiguous ones."""
    wide_a, wide_b = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    lse_a, lse_b = torch.randn(4, 6), torch.randn(4, 6)
    got, got_lse = A.merge_states(wide_a[:, ::2], lse_a[:, ::2], wide_b[:, ::2], lse_b[:, ::2])
    want, want_lse = A.merge_states(
        wide_a[:, ::2].contiguous(), lse_a[:, ::2].contiguous(),
        wide_b[:, ::2].contiguous(), lse_b[:, ::2].contiguous(),
    )  # fmt: skip
    assert torch.equal(got, want)
    assert torch.equal(got_lse, want_lse)


def test_empty_batch() -> None:
    out, lse = A.merge_states(torch.empty(0, 4, 8), torch.empty(0, 4), torch.empty(0, 4, 8),
                              torch.empty(0, 4))  # fmt: skip
    assert out.shape == (0, 4, 8)
    assert lse.shape == (0, 4)


def test_bad_inputs_name_the_argument() -> None:
    """One of each kind (tests/core/test_bad_input_matrix.py holds the full set)."""
    x, lse = torch.randn(2, 3, 4), torch.randn(2, 3)
    with pytest.raises(A.InvalidInputError, match=r"^lse_b\.dtype: expected torch\.float32"):
        A.merge_states(x, lse, x, lse.half())
    with pytest.raises(A.InvalidInputError, match=r"^out_b\.shape: expected \(2, 3, 4\)"):
        A.merge_states(x, lse, x[:1], lse)
    with pytest.raises(A.InvalidInputError, match=r"^out\.dtype: expected torch\.float32"):
        A.merge_states(x, lse, x, lse, out=torch.empty(2, 3, 4, dtype=torch.bfloat16))


def test_cuda_without_triton_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnsdk.kernels import merge_triton as _merge_triton

    monkeypatch.setattr(_merge_triton, "triton", None)
    x, lse = torch.zeros(1, 1, 4), torch.zeros(1, 1)
    with pytest.raises(A.BackendUnavailableError, match="pip install triton"):
        _merge_triton.merge_triton(x, lse, x, lse, x.clone(), lse.clone())

"""``merge_states`` on CUDA: the Triton kernel against the PyTorch path (tests/core checks that
path against float64 attention), and captured in a CUDA graph without allocating or syncing."""

from __future__ import annotations

import pytest
import torch

import attnsdk as A
from attnsdk.kernels.merge import merge_states_torch
from attnsdk.testing import forbid_device_sync

pytestmark = [pytest.mark.gpu]

DEV = "cuda"
NEG_INF = float("-inf")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
"""About one rounding step of each dtype: both paths compute in fp32, in a different order."""


def parts(t: int, h: int, dv: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Two random parts with every kind of row: both live, one side -inf (its output NaN
    garbage, which must not be read), both -inf."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    out_a = torch.randn(t, h, dv, generator=gen, device=DEV).to(dtype)
    out_b = torch.randn(t, h, dv, generator=gen, device=DEV).to(dtype)
    lse_a = 4.0 * torch.randn(t, h, generator=gen, device=DEV)
    lse_b = 4.0 * torch.randn(t, h, generator=gen, device=DEV)
    dead_a = torch.rand(t, h, generator=gen, device=DEV) < 0.2
    dead_b = torch.rand(t, h, generator=gen, device=DEV) < 0.2
    lse_a[dead_a], lse_b[dead_b] = NEG_INF, NEG_INF
    out_a[dead_a], out_b[dead_b] = float("nan"), float("nan")
    return [out_a, lse_a, out_b, lse_b]


def check(got: tuple[torch.Tensor, torch.Tensor], args: list[torch.Tensor]) -> None:
    out, lse = got
    want, want_lse = merge_states_torch(*args)
    out_a, lse_a, out_b, lse_b = args
    assert out.dtype == out_a.dtype
    assert not bool(out.isnan().any()), "NaN in the merged output"
    torch.testing.assert_close(out, want, atol=TOL[out.dtype], rtol=TOL[out.dtype])
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)  # -inf where it is -inf
    # A dead part leaves the other exactly (bit for bit); both dead: zeros and -inf.
    only_a, only_b = lse_b.isneginf() & ~lse_a.isneginf(), lse_a.isneginf() & ~lse_b.isneginf()
    assert torch.equal(out[only_a], out_a[only_a])
    assert torch.equal(lse[only_a], lse_a[only_a])
    assert torch.equal(out[only_b], out_b[only_b])
    none = lse_a.isneginf() & lse_b.isneginf()
    assert bool((out[none] == 0).all())
    assert bool(lse[none].isneginf().all())


@pytest.mark.parametrize("dv", [64, 80, 128, 256, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_triton_matches_torch(dtype: torch.dtype, dv: int) -> None:
    for seed, (t, h) in enumerate([(1, 1), (7, 8), (300, 32), (33, 40)]):
        args = parts(t, h, dv, dtype, seed)
        check(A.merge_states(*args), args)


def test_views_and_in_place() -> None:
    """A head slice of wider buffers in, a column block of a wider buffer out, and out=out_a."""
    wide_a, wide_lse_a, wide_b, wide_lse_b = parts(9, 16, 160, torch.bfloat16, 11)
    out_a, lse_a = wide_a[:, ::2, :128], wide_lse_a[:, ::2]
    args = [out_a, lse_a, wide_b[:, ::2, :128], wide_lse_b[:, ::2]]
    target = torch.full((9, 8, 136), 5.0, dtype=torch.bfloat16, device=DEV)
    check(A.merge_states(*args, out=target[..., :128]), args)
    assert bool((target[..., 128:] == 5.0).all()), "wrote past the columns of out"
    expected = A.merge_states(*[x.contiguous() for x in args])
    A.merge_states(*args, out=out_a, lse_out=lse_a)
    torch.testing.assert_close(out_a, expected[0], atol=0, rtol=0)
    torch.testing.assert_close(lse_a, expected[1], atol=0, rtol=0)


def test_eager_call_does_not_sync() -> None:
    args = parts(64, 32, 128, torch.bfloat16, 3)
    out, lse = torch.empty_like(args[0]), torch.empty_like(args[1])
    A.merge_states(*args, out=out, lse_out=lse)  # compile outside the checked call
    with forbid_device_sync():
        A.merge_states(*args, out=out, lse_out=lse)
    check((out, lse), args)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")], ids=["plus-inf", "nan"])
def test_debug_mode_reads_the_lse_values(monkeypatch: pytest.MonkeyPatch, bad: float) -> None:
    """On CUDA the lse values are read only in debug mode (reading them syncs): +inf or NaN,
    no log-sum-exp, is refused naming the entry, before anything is written. Without debug
    mode the merge reads no value (no sync) and that row comes out NaN, as documented."""
    args = parts(6, 4, 64, torch.float32, 9)
    args[3][4, 2] = bad
    out = torch.full_like(args[0], 7.0)
    lse = torch.full_like(args[1], 7.0)
    monkeypatch.setenv("ATTNSDK_DEBUG", "1")
    with pytest.raises(A.InvalidInputError, match=r"^lse_b\[4, 2\]: expected a log-sum-exp"):
        A.merge_states(*args, out=out, lse_out=lse)
    assert bool((out == 7.0).all())
    assert bool((lse == 7.0).all())
    monkeypatch.setenv("ATTNSDK_DEBUG", "0")
    A.merge_states(*args, out=out, lse_out=lse)  # compile outside the checked call
    with forbid_device_sync():
        A.merge_states(*args, out=out, lse_out=lse)
    assert bool(out[4, 2].isnan().all())


def test_graph_capture_allocates_nothing_and_replays_new_values() -> None:
    static = parts(48, 16, 256, torch.float16, 5)
    out = torch.empty_like(static[0])
    lse = torch.empty_like(static[1])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up (the Triton compile) outside capture
        A.merge_states(*static, out=out, lse_out=lse)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # Counted inside the capture: entering it allocates on its own (2 blocks on an H200).
        allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
        A.merge_states(*static, out=out, lse_out=lse)
        allocated = torch.cuda.memory_stats()["allocation.all.allocated"] - allocations
    assert allocated == 0
    for seed in (6, 7):
        fresh = parts(48, 16, 256, torch.float16, seed)
        for s, f in zip(static, fresh):
            s.copy_(f)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check((out, lse), static)


def test_the_sync_guard_catches_a_sync() -> None:
    """``forbid_device_sync`` (used by every "does not sync" test) really raises, and leaves
    the mode as it found it."""
    x = torch.ones(4, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"), forbid_device_sync():
        x.sum().item()
    assert torch.cuda.get_sync_debug_mode() == 0
    x.sum().item()

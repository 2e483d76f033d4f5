"""``forward_ragged`` (K/V in the call, no cache: MLA's expanded prefill and its prefix chunks):
``ragged_step``, a random ragged step that holds the rows where the rules differ, and the case
that runs it."""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch

from attnsdk.contract.capabilities import Feature
from attnsdk.contract.errors import UnsupportedConfigError
from attnsdk.contract.layer import LayerSpec
from attnsdk.contract.metadata import AttentionMetadata
from attnsdk.testing._tolerance import assert_close_to_reference, tolerance
from attnsdk.testing.conformance._cases import (
    FEATURES,
    RAGGED_FEATURES,
    RAGGED_PREFIX_FEATURES,
    edge_rows,
)
from attnsdk.testing.conformance._harness import (
    LSE_TOLERANCE,
    Harness,
    assert_lse_close,
    skip_declared,
)

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend


class RaggedCases(Harness):
    """``forward_ragged`` against the reference's, with ``out=`` and ``lse=``."""

    @pytest.mark.parametrize(
        ("feature", "kind"),
        [(f, k) for f in RAGGED_FEATURES for k in ("prefill", "extend")]
        + [(f, "prefix") for f in RAGGED_PREFIX_FEATURES],
        ids=[f"{f}-{k}" for f in RAGGED_FEATURES for k in ("prefill", "extend")]
        + [f"{f}-prefix" for f in RAGGED_PREFIX_FEATURES],
    )
    def test_ragged(self, subject: Backend, oracle: Backend, feature: str, kind: str) -> None:
        """``forward_ragged`` (K/V in the call, no cache: MLA's expanded prefill and its prefix
        chunks): output and log-sum-exp match the reference; ``out=`` receives the result, and
        asking for the lse leaves the output bit for bit. Each step holds, besides its random
        sequences, those on which the layer's rules differ (``ragged_step``): several queries
        over more keys and over fewer, none (a prefix chunk); the edges of a window or of
        chunks. A backend that does not serve it must raise
        ``UnsupportedConfigError``; the case is then skipped with its reasons."""
        layer, dtype = LayerSpec(**FEATURES[feature].layer), self._dtype(subject)
        dev = torch.device(self.device)
        ragged = (Feature.RAGGED,)
        reasons = subject.unsupported_reasons(layer, None, dev, uses=ragged, dtype=dtype)
        if reasons:
            step = ragged_step(layer, kind, 0, dtype, dev)
            with pytest.raises(UnsupportedConfigError):  # refused before the plan is read
                subject.forward_ragged(
                    step.q, step.k, step.v, oracle.plan(step.metadata), layer, sinks=step.sinks
                )
            skip_declared(reasons)
        with_lse = not subject.unsupported_reasons(
            layer, None, dev, uses=(*ragged, Feature.LSE), dtype=dtype
        )
        atol, rtol = tolerance(dtype)
        for seed in range(self.seeds):
            step = ragged_step(layer, kind, seed, dtype, dev)
            args = (step.q, step.k, step.v)
            plan, ref_plan = subject.plan(step.metadata), oracle.plan(step.metadata)
            out = subject.forward_ragged(*args, plan, layer, sinks=step.sinks)
            lse = torch.full((step.metadata.num_tokens, layer.num_heads), float("nan"), device=dev)
            ref_lse = torch.empty_like(lse)
            ref = oracle.forward_ragged(*args, ref_plan, layer, sinks=step.sinks, lse=ref_lse)
            assert_close_to_reference(out, ref, atol=atol, rtol=rtol)
            given = torch.full_like(out, float("nan"))
            again = subject.forward_ragged(
                *args, plan, layer, sinks=step.sinks, out=given, lse=lse if with_lse else None
            )
            assert torch.equal(given, out), "out= did not receive the output (or lse= changed it)"
            assert torch.equal(again, out), "forward_ragged returned other values than out="
            if with_lse:
                assert_lse_close(lse, ref_lse, atol=LSE_TOLERANCE[0], rtol=LSE_TOLERANCE[1])


@dataclass(frozen=True, slots=True)
class RaggedStep:
    """One random ``forward_ragged`` call: its metadata and inputs."""

    metadata: AttentionMetadata
    q: torch.Tensor
    k: torch.Tensor
    """(sum(seq_lens) + 3, Hkv, D): three rows past the last sequence's, which no key is."""
    v: torch.Tensor
    sinks: torch.Tensor | None


def ragged_step(
    layer: LayerSpec,
    kind: str,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> RaggedStep:
    """A random ragged step of ``kind``: "prefill" (keys are the new tokens), "extend" (keys
    reach further back) or "prefix" (a cross-attention chunk: any number of keys, some none).
    Besides its random sequences, each step holds, in a random place, the ones on which the
    rules differ whatever the seed (``_RAGGED_ROWS`` and ``edge_rows(layer)``). Odd seeds drop
    ``key_start_loc``, which backends then derive. Sinks move rows well past the tolerance, as
    in ``BackendConformance._batch``, and are bf16 values."""
    rng = random.Random(f"ragged-{kind}-{seed}")
    b = rng.randint(1, 6)
    q = [rng.choice([0, 1, rng.randint(2, 40)]) for _ in range(b)]
    if kind == "prefill":
        s = list(q)
    elif kind == "extend":
        s = [n + rng.randint(0, 50) for n in q]
    else:
        s = [rng.choice([0, rng.randint(1, 60)]) for _ in range(b)]
    fixed = _RAGGED_ROWS[kind] + ([] if kind == "prefix" else edge_rows(layer))
    rows = [*zip(q, s), *(r for r in fixed if kind != "prefill" or r[0] == r[1])]
    rng.shuffle(rows)
    q, s = [n for n, _ in rows], [m for _, m in rows]
    meta = AttentionMetadata.for_ragged(q, s, device=device, cross_attention=kind == "prefix")
    if seed % 2:
        meta = dataclasses.replace(meta, key_start_loc=None)
    gen = torch.Generator().manual_seed(seed)
    keys = sum(s) + 3
    q_, k, v = (
        torch.randn(n, h, d, generator=gen).to(device=device, dtype=dtype)
        for n, h, d in (
            (meta.num_tokens, layer.num_heads, layer.head_dim),
            (keys, layer.num_kv_heads, layer.head_dim),
            (keys, layer.num_kv_heads, layer.v_dim),
        )
    )
    # bf16 values: FA3 reads sinks as bf16 (its documented rounding, which the paged cases
    # model with ``reference_batch``); a row of few keys would show the difference.
    sinks = (1.0 + 2.0 * torch.randn(layer.num_heads, generator=gen)).bfloat16().float()
    return RaggedStep(meta, q_, k, v, sinks.to(device) if layer.has_sinks else None)


_RAGGED_ROWS: dict[str, list[tuple[int, int]]] = {
    "prefill": [(5, 5)],
    "extend": [(5, 12)],
    "prefix": [(4, 9), (3, 2), (2, 0)],
}
"""(query_len, seq_len) rows every ragged step of a kind holds: several queries, where causal
and non-causal differ (with keys before them in an extend); in a prefix chunk, several queries
over more keys and over fewer (causal masking would hide keys from all but the last query), and
queries without keys (zeros, lse -inf or the sink)."""

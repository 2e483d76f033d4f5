"""Hypothesis strategies for random batches; needs hypothesis (attnsdk's ``testing`` extra)."""

from __future__ import annotations

try:
    from hypothesis import strategies as st
except ImportError as exc:
    raise ModuleNotFoundError(
        "attnsdk.testing.strategies needs hypothesis, which attnsdk's 'testing' extra brings: "
        'pip install hypothesis (or, from a checkout, pip install -e "/path/to/attnsdk[testing]")',
        name="hypothesis",
    ) from exc

from attnsdk.testing._spec import BatchSpec

__all__ = ["batch_specs", "page_orders"]

page_orders = st.sampled_from(["shuffled", "contiguous", "interleaved"])
"""Every ``PageOrder`` that ``make_batch`` takes."""


@st.composite
def batch_specs(
    draw: st.DrawFn,
    max_batch: int = 6,
    max_context: int = 96,
    max_query_len: int = 40,
    allow_empty_rows: bool = True,
) -> BatchSpec:
    """Mixed batches: each row is decode, extend, prefill or (optionally) empty, in any order."""
    n = draw(st.integers(1, max_batch))
    q, s = [], []
    kinds = ["decode", "extend", "prefill"] + (["empty"] if allow_empty_rows else [])
    for _ in range(n):
        kind = draw(st.sampled_from(kinds))
        ctx = (
            0 if kind == "prefill" else draw(st.integers(0 if kind == "empty" else 1, max_context))
        )
        qi = {"decode": 1, "empty": 0}.get(kind) or draw(st.integers(1, max_query_len))
        q.append(qi)
        s.append(ctx + qi)
    if sum(q) == 0:
        q[0], s[0] = 1, s[0] + 1
    return BatchSpec(tuple(q), tuple(s), "hypothesis")

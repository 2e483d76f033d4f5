"""The float64 oracle (tests/oracle.py) against cases worked out by hand.

Every backend is checked against the oracle, so its own rules are pinned here with literal
expectations rather than with another implementation.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from oracle import Semantics, attention, visible


def sem(*, causal: bool = True, window: int | None = None, chunk: int | None = None) -> Semantics:
    return Semantics(1, 1, scale=1.0, causal=causal, window=window, softcap=None, chunk=chunk)


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("x" if seen else "." for seen in row) for row in mask.tolist()]


# Queries at positions 2..9 over keys 0..9, chunks of 4: [0, 4), [4, 8), [8, 12).
QUERIES, KEYS = torch.arange(2, 10), torch.arange(10)


def test_chunks_causal() -> None:
    assert rows(visible(QUERIES, KEYS, sem(chunk=4))) == [
        "xxx.......",  # p=2: its chunk starts at 0
        "xxxx......",
        "....x.....",  # p=4: first of chunk 1, sees itself only
        "....xx....",
        "....xxx...",
        "....xxxx..",
        "........x.",  # p=8: first of chunk 2
        "........xx",
    ]


def test_chunks_with_a_window_intersect() -> None:
    assert rows(visible(QUERIES, KEYS, sem(chunk=4, window=2))) == [
        ".xx.......",
        "..xx......",
        "....x.....",  # the window would reach key 3, the chunk does not
        "....xx....",
        ".....xx...",
        "......xx..",
        "........x.",
        "........xx",
    ]


def test_chunks_non_causal_see_their_whole_chunk() -> None:
    assert rows(visible(QUERIES, KEYS, sem(causal=False, chunk=4))) == [
        "xxxx......",
        "xxxx......",
        "....xxxx..",
        "....xxxx..",
        "....xxxx..",
        "....xxxx..",
        "........xx",
        "........xx",
    ]


def test_chunk_off_and_chunk_wider_than_the_sequence_change_nothing() -> None:
    plain = visible(QUERIES, KEYS, sem())
    assert torch.equal(visible(QUERIES, KEYS, sem(chunk=10)), plain)
    assert torch.equal(visible(QUERIES, KEYS, sem(chunk=64)), plain)
    assert not torch.equal(visible(QUERIES, KEYS, sem(chunk=9)), plain)


def _mean_of_visible_values(semantics: Semantics, query_lens: list[int]) -> list[Any]:
    """Two sequences of 7 keys on pages of 2 (shuffled), value = position, q = 0: every visible
    key scores the same, so each output is the mean position of the keys its query sees."""
    page_size, length = 2, 7
    table = torch.tensor([[5, 1, 7, 3], [2, 8, 4, 6]])
    k = torch.zeros(9, page_size, 1, 1)
    v = torch.full((9, page_size, 1, 1), float("nan"))  # pages no sequence owns stay NaN
    for row in table:
        for i, page in enumerate(row.tolist()):
            for offset in range(page_size):
                v[page, offset] = float(i * page_size + offset)
    q = torch.zeros(sum(query_lens), 1, 1)
    out, _ = attention(q, k, v, query_lens, [length, length], table, semantics)
    return [pytest.approx(x, abs=1e-12) for x in out.flatten().tolist()]


def test_attention_over_pages_by_hand() -> None:
    # Sequence 0 decodes position 6, sequence 1 extends positions 3..6. Chunks of 4.
    assert _mean_of_visible_values(sem(chunk=4), [1, 4]) == [
        5.0,  # p=6 sees 4..6
        1.5,  # p=3 sees 0..3
        4.0,  # p=4 sees 4
        4.5,
        5.0,
    ]
    assert _mean_of_visible_values(sem(causal=False, chunk=4), [1, 4]) == [5.0, 1.5, 5.0, 5.0, 5.0]
    assert _mean_of_visible_values(sem(chunk=4, window=2), [1, 4]) == [5.5, 2.5, 4.0, 4.5, 5.5]
    assert _mean_of_visible_values(sem(), [1, 4]) == [3.0, 1.5, 2.0, 2.5, 3.0]

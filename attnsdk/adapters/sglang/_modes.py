"""How SGLang's forward modes and speculative inputs lay out a step's query tokens.

SGLang has more ``ForwardMode``s than attention shapes; ``step_kind`` maps each onto one of three
(or refuses it), with SGLang's own predicates; ``draft_token_num`` reads a verify step's draft
count and ``is_tree`` whether its drafts form a tree (EAGLE ``topk > 1``, every NGRAM verify).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

from attnsdk.contract.errors import InvalidMetadataError, Reason, ReasonKind, UnsupportedConfigError

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

__all__ = ["StepKind", "draft_token_num", "is_tree", "step_kind"]


class StepKind(enum.Enum):
    """How a forward mode lays out its query tokens (SGLang has more modes than shapes)."""

    DECODE = "decode"
    """DECODE and IDLE: one new token per row (IDLE has no rows outside CUDA-graph padding)."""
    EXTEND = "extend"
    """EXTEND, MIXED, DRAFT_EXTEND (<= 0.5.12), DRAFT_EXTEND_V2: ``extend_seq_lens`` new tokens
    per row after a prefix."""
    TARGET_VERIFY = "target_verify"
    """``spec_info.draft_token_num`` draft tokens per row, after ``seq_lens``: a chain, or a
    tree whose mask is ``spec_info.custom_mask`` (``is_tree``)."""


def _is(mode: object, predicate: str) -> bool:
    # Predicates differ between SGLang versions; a missing one means "not this mode".
    fn = getattr(mode, predicate, None)
    return bool(fn()) if callable(fn) else False


_UNMAPPED = ("is_dllm_extend", "is_prebuilt", "is_split_prefill")
"""Modes with other attention semantics (diffusion-LM blocks, prebuilt KV, layer-split
prefill): refused rather than guessed."""


def step_kind(mode: ForwardMode) -> StepKind:
    """Classify a ``ForwardMode`` with SGLang's own predicates.

    Order matters: SGLang's ``is_extend()`` is also true for TARGET_VERIFY, DRAFT_EXTEND,
    SPLIT_PREFILL and DLLM_EXTEND. Modes with other attention semantics raise.
    """
    if _is(mode, "is_idle") or _is(mode, "is_decode"):
        return StepKind.DECODE
    if _is(mode, "is_target_verify"):
        return StepKind.TARGET_VERIFY
    if not any(_is(mode, p) for p in _UNMAPPED) and (
        _is(mode, "is_draft_extend_v2")
        or _is(mode, "is_draft_extend")
        or _is(mode, "is_mixed")
        or _is(mode, "is_extend")
    ):
        return StepKind.EXTEND
    expected = "DECODE, IDLE, EXTEND, MIXED, TARGET_VERIFY, DRAFT_EXTEND or DRAFT_EXTEND_V2"
    raise UnsupportedConfigError(
        f"forward_batch.forward_mode: expected {expected}, found {mode!r}",
        [Reason(ReasonKind.BATCH, "forward_mode", f"{mode!r} has no attnsdk mapping")],
    )


def draft_token_num(spec_info: Any) -> int:
    """Draft tokens per row of a TARGET_VERIFY batch (a chain or a tree, ``is_tree``).

    A ragged DFlash layout (per-row draft counts) is refused, never computed as uniform.
    """
    if spec_info is None:
        raise InvalidMetadataError(
            "forward_batch.spec_info", "an EagleVerifyInput-like object in TARGET_VERIFY", None
        )
    kind = type(spec_info).__name__
    if getattr(spec_info, "ragged_verify_layout", None) is not None:
        raise UnsupportedConfigError(
            f"forward_batch.spec_info.ragged_verify_layout: expected None, found a {kind} layout",
            [Reason(ReasonKind.BATCH, "ragged_verify_layout", "per-row draft counts")],
        )
    n = getattr(spec_info, "draft_token_num", None)
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise InvalidMetadataError("forward_batch.spec_info.draft_token_num", "an int > 0", n)
    return n


def is_tree(spec_info: Any) -> bool:
    """Whether a TARGET_VERIFY step's drafts form a tree: EAGLE with ``topk > 1``, or NGRAM
    (``NgramVerifyInput`` has no ``topk``: always a tree of breadth
    ``speculative_ngram_max_bfs_breadth``). Its mask is then ``spec_info.custom_mask``."""
    topk = getattr(spec_info, "topk", None)
    if topk is None:
        return True
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise InvalidMetadataError("forward_batch.spec_info.topk", "an int >= 1 (1: a chain)", topk)
    return topk > 1

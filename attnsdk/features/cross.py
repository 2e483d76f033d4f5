"""Cross-attention: ``AttentionMetadata.cross_attention``, what it means and what it refuses.

An encoder-decoder model (Whisper, T5-style, mllama) attends from the decoder's tokens to the
encoder's output. The encoder's K/V are written once, by an earlier step (``KVCache.store`` or
an engine's own store), into pages of their own; a cross-attention step then describes, per
sequence, the decoder's query rows (``query_start_loc``) and the encoder's keys (``seq_lens``
and ``page_table``). Every query row of sequence b sees all ``seq_lens[b]`` keys of b, whatever
its position: a sequence may have more queries than keys, and one without keys outputs zeros.
The step writes nothing (``forward`` gets k = v = None; ``slot_mapping`` holds -1).

Only non-causal layers without a window or attention chunks: their rules are defined over
positions of one sequence, which queries and keys here do not share (``refusals``). A
CUDA-graph replay refuses a cross-attention step (the graph buffers carry no such flag).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnsdk.contract.capabilities import Feature
from attnsdk.contract.errors import Reason, ReasonKind

if TYPE_CHECKING:
    from attnsdk.contract.capabilities import Request

__all__ = ["refusals"]


def refusals(request: Request) -> list[Reason]:
    """Why ``request``'s layer cannot run in a cross-attention step (``Feature.CROSS_ATTENTION``
    in ``request.uses``): the rules that need queries and keys to share positions."""
    layer = request.layer
    if Feature.CROSS_ATTENTION not in request.uses or layer is None:
        return []
    reasons = []
    if layer.causal:
        reasons.append(
            Reason(ReasonKind.BATCH, "causal", "must be False: cross-attention sees every key")
        )
    for field in ("sliding_window", "attention_chunk_size"):
        if getattr(layer, field) is not None:
            reasons.append(
                Reason(
                    ReasonKind.BATCH,
                    field,
                    "is not defined across an encoder's and a decoder's positions",
                )
            )
    return reasons

"""The ``flashinfer`` backend's MLA path: FlashInfer's ``BatchMLAPagedAttentionWrapper``.

MLA (``LayerSpec.mla``, kv_lora_rank 512 + rope 64): every step of an MLA layer runs
``BatchMLAPagedAttentionWrapper`` over the latent cache as one packed (N, P, 576) tensor and q
as (T, Hq, 576), planned per sequence with each row's KV length and the natural-log
log-sum-exp always on (its lse mode is fixed at plan time; without ``lse=`` it goes to a scratch
buffer). FlashInfer's MLA ``plan()`` reads the range of the page ids, which live on the device:
one device sync per step, not per layer. CUDA graphs capture MLA layers in uniform graphs only
(every row the same query length: decode, verify): the kernel's cluster size, fixed at
capture, follows the average query length.

An MLA layer's e4m3 latent (Hopper only, bf16 q) is read the way fp8 KV is (the backend's
module docstring): its one scale is applied to q and the output on the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attnsdk.backends.flashinfer.plan import FlashInferGraphState
from attnsdk.contract.device import compute_capability
from attnsdk.contract.errors import Reason, ReasonKind, UnsupportedConfigError

if TYPE_CHECKING:
    from attnsdk.backends.flashinfer.plan import FlashInferPlan
    from attnsdk.contract.kv import KVCache
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import GraphBuffers

__all__ = ["attend_mla", "check_mla_capture", "check_mla_replay", "mla_backend"]


def mla_backend(choice: str, device: torch.device) -> str:
    """The FlashInfer backend of an MLA wrapper on ``device`` (``FlashInferOptions.mla_backend``)."""
    if choice != "auto":
        return choice
    # Chosen here, not by FlashInfer's "auto" policy, whose per-run dispatch measured ~45 µs
    # of host time per eager layer on the H200.
    cc = compute_capability(device)
    return "fa3" if cc is not None and cc[0] == 9 else "fa2"


def attend_mla(
    wrapper: Any,
    q: torch.Tensor,
    cache: KVCache,
    rows: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    graph: GraphBuffers | None,
    quantized: bool = False,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """FlashInfer's MLA wrapper: q (rows, Hq, 576) packed, the latent cache (N, P, 576).

    An e4m3 latent (``quantized``) is read with unit scales (FlashInfer takes them as host
    floats) and its ``scale``, if any, applied on the device instead, as for fp8 KV: K and
    V are both the latent times ``scale``, so q is multiplied by it before the kernel (the
    scores, hence the lse, come out exact) and the output after it."""
    q = q[:rows]
    # One KV head, one scale: a 0-dim factor keeps q's dtype (fp32 math, one kernel each).
    factor = None if scale is None else scale.reshape(())
    if factor is not None:
        q = q * factor
    elif not q.is_contiguous():
        q = q.contiguous()
    dest = out[:rows]
    o = dest if dest.is_contiguous() else torch.empty_like(dest)
    if lse is None:
        # Planned with its lse on, the wrapper writes one anyway: a captured step into the
        # graph state's static buffer (a replay writes where the capture did), an eager one
        # into a buffer of its own.
        if isinstance(graph, FlashInferGraphState):
            lse = graph.lse_buffer(q.shape[1])
        else:
            lse = torch.empty(q.shape[0], q.shape[1], device=q.device)
    lse_rows = lse[: q.shape[0]]
    unit = {"ckv_scale": 1.0, "kpe_scale": 1.0} if quantized else {}
    wrapper.run(
        query=q,
        kv_cache=cache.k.squeeze(2),
        out=o,
        lse=lse_rows,
        return_lse=True,
        return_lse_base_on_e=True,
        **unit,
    )
    if factor is not None:
        o.mul_(factor)
    if o is not dest:
        dest.copy_(o)
    return out


def check_mla_capture(meta: AttentionMetadata, batch_size: int, num_tokens: int) -> None:
    """Refuse a capture of MLA layers whose rows are not all ``max_query_len`` long."""
    if meta.max_query_len * batch_size == num_tokens:
        return
    raise UnsupportedConfigError(
        "the flashinfer backend captures MLA layers in uniform graphs only:",
        [
            Reason(
                ReasonKind.BATCH,
                "num_tokens",
                f"must be batch_size * max_query_len = {batch_size} * "
                f"{meta.max_query_len} for MLA (FlashInfer's MLA kernel fixes its "
                f"cluster size, which follows the mean query length, at capture), "
                f"found {num_tokens}",
            )
        ],
    )


def check_mla_replay(captured: FlashInferPlan, meta: AttentionMetadata) -> None:
    """Refuse, before anything is copied, a replay whose MLA cluster size differs from the
    captured one: the captured launch keeps its grid, which a re-plan would change."""
    bs, rows = captured.metadata.num_seqs, captured.metadata.num_tokens
    # Replay pads the batch to ``bs`` rows, which share the leftover token rows as
    # GraphBuffers._pad deals them.
    t, pad_rows, longest = meta.num_tokens, bs - meta.num_seqs, captured.metadata.max_query_len
    padded = t
    if pad_rows > 0:
        share = min((rows - t) // pad_rows, longest)
        padded = min(rows, t + share * (pad_rows - 1) + longest)
    for v in captured.wrappers:
        if not v.mla:
            continue
        then, now = _mla_cluster(rows, v.num_heads, bs), _mla_cluster(padded, v.num_heads, bs)
        if then != now:
            raise UnsupportedConfigError(
                "the flashinfer backend cannot replay this MLA step in this graph:",
                [
                    Reason(
                        ReasonKind.BATCH,
                        "query_lens",
                        f"give {padded} query rows in {bs} rows, a cluster size of {now}; the "
                        f"graph was captured with {then} (FlashInfer's MLA kernel fixes it at "
                        "capture). Capture uniform graphs (decode, verify) and replay full rows",
                    )
                ],
            )


def _mla_cluster(query_rows: int, num_heads: int, batch_size: int) -> int:
    """CTAs per cluster that FlashInfer's sm90 MLA plan picks (``MLAPlan`` in its
    scheduler.cuh): 2 when a row holds more than 64 (query, head) pairs on average."""
    return 2 if batch_size and query_rows * num_heads // batch_size > 64 else 1

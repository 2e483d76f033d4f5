"""``GraphRunner``: capture a step function once per batch size and replay it with padding.

The function receives a plan and the token-major inputs, and may call ``backend.forward`` for
any number of layers (or run a whole model step). Each captured batch size reads its metadata
from the backend's static ``GraphBuffers``; a smaller real batch is replayed on the smallest
capture that holds it, the extra rows padded (seq_len 1 on the reserved page, no KV write).

Usage (on a CUDA device, with a backend whose ``capabilities.graph_support`` allows it)::

    runner = GraphRunner(backend, step, batch_sizes=[1, 8, 32], max_pages=256, page_size=16)
    runner.capture(q_example, k_example, v_example)      # rows >= max batch * tokens_per_seq
    out = runner(meta, q, k, v)                           # replays; returns out[:num_tokens]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from attnsdk.contract.capabilities import GraphSupport
from attnsdk.contract.checks import check_int, check_usable_device
from attnsdk.contract.errors import InvalidInputError, Reason, ReasonKind, UnsupportedConfigError

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from attnsdk.contract.backend import Backend
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import GraphBuffers, Plan

__all__ = ["GraphRunner"]


@dataclass(frozen=True, slots=True)
class _Captured:
    batch_size: int
    num_tokens: int
    graph: torch.cuda.CUDAGraph
    plan: Plan
    output: torch.Tensor


class GraphRunner:
    """Captures ``fn(plan, *inputs) -> Tensor`` for each of ``batch_sizes`` and replays it.

    ``tokens_per_seq`` query rows are captured per sequence (1 for decode, k + 1 for
    speculative verify). Inputs are tensors whose first dimension is the token row.
    """

    def __init__(
        self,
        backend: Backend,
        fn: Callable[..., torch.Tensor],
        *,
        batch_sizes: Sequence[int],
        max_pages: int,
        page_size: int,
        tokens_per_seq: int = 1,
        device: torch.device | str = "cuda",
    ) -> None:
        try:
            if isinstance(batch_sizes, (str, bytes)):
                raise TypeError
            given = list(batch_sizes)
        except TypeError:
            given = []
        if not given:
            raise InvalidInputError(
                "batch_sizes", "a list of one or more positive ints", repr(batch_sizes)
            )
        sizes = sorted({check_int(f"batch_sizes[{i}]", b) for i, b in enumerate(given)})
        tokens_per_seq = check_int("tokens_per_seq", tokens_per_seq)
        needed = GraphSupport.DECODE_ONLY if tokens_per_seq == 1 else GraphSupport.UNIFORM_BATCH
        level = backend.capabilities.graph_support
        if level < needed:
            raise UnsupportedConfigError(
                f"backend {backend.name!r} cannot be captured in a CUDA graph:",
                [
                    Reason(
                        ReasonKind.CONFIGURATION,
                        "graph_support",
                        f"must be >= {needed.name}, found {level.name}",
                    )
                ],
            )
        dev = check_usable_device("device", device)
        if dev.type != "cuda":
            raise InvalidInputError("device", "a CUDA device (graphs are a CUDA feature)", dev)
        self.backend = backend
        self.fn = fn
        self.batch_sizes: tuple[int, ...] = tuple(sizes)
        self.tokens_per_seq = tokens_per_seq
        self.device = dev
        self.state: GraphBuffers = backend.graph_state(
            sizes[-1], sizes[-1] * tokens_per_seq, max_pages, page_size=page_size, device=dev
        )
        self._static: tuple[torch.Tensor, ...] = ()
        self._captured: list[_Captured] = []

    @property
    def max_tokens(self) -> int:
        return self.batch_sizes[-1] * self.tokens_per_seq

    def capture(self, *example_inputs: torch.Tensor, warmup: int = 2) -> None:
        """Copy the examples into static input buffers, then capture every batch size.

        Each example needs at least ``max_tokens`` rows; values only matter for the warm-up.
        Capturing starts from all-padding metadata, so it writes nothing to any KV cache.
        """
        for i, x in enumerate(example_inputs):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] < self.max_tokens:
                found = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise InvalidInputError(
                    f"example_inputs[{i}]", f"a tensor with >= {self.max_tokens} rows", found
                )
        self._static = tuple(x[: self.max_tokens].clone() for x in example_inputs)
        pool = torch.cuda.graph_pool_handle()
        captured = []
        # Largest first, so smaller graphs reuse the memory pool the largest one reserved.
        for bs in reversed(self.batch_sizes):
            tokens = bs * self.tokens_per_seq
            plan = self.backend.plan_for_capture(
                self.state, bs, tokens, max_query_len=self.tokens_per_seq
            )
            inputs = [x[:tokens] for x in self._static]
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.fn(plan, *inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                output = self.fn(plan, *inputs)
            captured.append(_Captured(bs, tokens, graph, plan, output))
        self._captured = sorted(captured, key=lambda c: c.batch_size)

    def __call__(self, meta: AttentionMetadata, *inputs: torch.Tensor) -> torch.Tensor:
        """Replay on the smallest capture that holds ``meta``; returns ``output[:num_tokens]``.

        No allocation and no device sync: inputs and metadata are copied into static buffers.
        """
        if not self._captured:
            raise InvalidInputError("GraphRunner", "capture() called first", "no captured graph")
        if len(inputs) != len(self._static):
            raise InvalidInputError("inputs", f"{len(self._static)} tensors", len(inputs))
        b, t = meta.num_seqs, meta.num_tokens
        entry = next(
            (
                c
                for c in self._captured
                if c.batch_size >= b
                and c.num_tokens >= t
                and c.plan.metadata.max_query_len >= meta.max_query_len
            ),
            None,
        )
        if entry is None:
            last = self._captured[-1]
            raise InvalidInputError(
                "meta",
                f"at most {last.batch_size} sequences, {last.num_tokens} tokens and "
                f"{self.tokens_per_seq} tokens per sequence (largest capture)",
                f"{b} sequences, {t} tokens, up to {meta.max_query_len} per sequence",
                "Capture a larger batch size or run this step eagerly",
            )
        for static, x in zip(self._static, inputs):
            static[:t].copy_(x[:t], non_blocking=True)
        self.backend.plan_for_replay(entry.plan, meta)
        entry.graph.replay()
        return entry.output[:t]

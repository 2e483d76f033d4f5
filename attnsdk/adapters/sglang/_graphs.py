"""The CUDA-graph half of the SGLang drop-in: both generations of SGLang's graph hooks.

- SGLang 0.5.13 and later: ``init_forward_metadata_out_graph(fb, in_capture=True)`` before
  capturing, ``init_forward_metadata_out_graph(fb_view)`` before each replay (``fb_view`` holds
  the padded static inputs), ``init_forward_metadata_in_graph(fb)`` inside the graph;
- SGLang 0.5.12 and earlier: ``init_forward_metadata_capture_cuda_graph`` /
  ``init_forward_metadata_replay_cuda_graph``.

Both map onto the attnsdk backend's ``graph_state`` / ``plan_for_capture`` / ``plan_for_replay``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.adapters._common import engine_attr, refuse
from attnsdk.adapters.sglang._modes import StepKind, draft_token_num, is_tree, step_kind
from attnsdk.contract.errors import InvalidInputError, UnsupportedConfigError

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from attnsdk.adapters.sglang._adapter import SGLangAdapter
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.plan import GraphBuffers, Plan

__all__ = ["SEQ_LEN_FILL_VALUE", "SGLangGraphHooks"]

SEQ_LEN_FILL_VALUE = 1
"""SGLang's seq_len of CUDA-graph padding rows; with req_to_token row 0 they read page 0."""


@dataclass(frozen=True, slots=True)
class _GraphBatch:
    """The ForwardBatch fields the adapter reads, rebuilt from a replay hook's arguments."""

    forward_mode: Any
    batch_size: int
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: torch.Tensor
    out_cache_loc: torch.Tensor
    spec_info: Any


class SGLangGraphHooks:
    """SGLang's CUDA-graph hooks for the drop-in (``SGLangAttentionBackendImpl`` mixes it in).

    Reads the drop-in's ``backend``, ``adapter``, ``device`` and ``page_size`` and sets its
    step plan ``_plan``; owns the static buffers (``_graph``) and the captured plans.
    """

    backend: Backend
    adapter: SGLangAdapter
    device: torch.device
    page_size: int
    _plan: Plan | None
    _graph: tuple[GraphBuffers, torch.Tensor] | None = None
    """Static buffers and an all "-1" slot tensor (the captured forward writes K/V itself)."""
    _graph_plans: dict[tuple[int, int], Plan]

    if TYPE_CHECKING:

        def _adapter(self) -> SGLangAdapter: ...

    # -- CUDA graphs ------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Allocate the static metadata buffers every captured batch size views."""
        max_pages = -(-self.adapter.req_to_token.shape[1] // self.page_size)
        state = self.backend.graph_state(
            max_bs, max_num_tokens, max_pages, page_size=self.page_size, device=self.device
        )
        if state.reserved_page != 0 or state.seq_len_fill != SEQ_LEN_FILL_VALUE:
            raise UnsupportedConfigError(
                f"backend {self.backend.name!r} graph buffers: expected reserved page 0 and "
                f"seq_len fill {SEQ_LEN_FILL_VALUE} (SGLang's), found page "
                f"{state.reserved_page} and fill {state.seq_len_fill}"
            )
        no_slots = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=self.device)
        self._graph = (state, no_slots)
        self._graph_plans.clear()

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """SGLang 0.5.13+: bind a captured plan (``in_capture``) or refresh it for a replay.

        At capture ``forward_batch`` views the graph runner's static inputs; at replay it is
        the runner's view of them (``batch_size`` rows, padding included, in the captured
        ``forward_mode``), whose values are copied into the captured plan's buffers.
        """
        fb = forward_batch

        def read(name: str) -> Any:
            return engine_attr(fb, "forward_batch", name)

        mode = read("forward_mode")
        step = _GraphStep(mode, read("spec_info"), getattr(fb, "encoder_lens", None))
        if in_capture:
            self._capture(read("batch_size"), read("out_cache_loc").shape[0], mode, step)
        else:
            batch = (read("req_pool_indices"), read("seq_lens"), read("seq_lens_cpu"))
            self._replay(read("batch_size"), *batch, step)

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """SGLang 0.5.13+: nothing to record in the graph (replay refreshed the buffers)."""

    def init_forward_metadata_capture_cuda_graph(
        self,
        bs: int,
        num_tokens: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None,
        forward_mode: ForwardMode,
        spec_info: Any,
    ) -> None:
        """SGLang <= 0.5.12: bind a plan of static-buffer views for ``bs`` rows, ``num_tokens``
        tokens. The static ``req_pool_indices`` / ``seq_lens`` are read at replay."""
        del req_pool_indices, seq_lens  # read at replay, from the same static buffers
        step = _GraphStep(forward_mode, spec_info, encoder_lens)
        self._capture(bs, num_tokens, forward_mode, step)

    def init_forward_metadata_replay_cuda_graph(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_sum: int,
        encoder_lens: torch.Tensor | None,
        forward_mode: ForwardMode,
        spec_info: Any,
        seq_lens_cpu: torch.Tensor | None,
    ) -> None:
        """SGLang <= 0.5.12: refresh the plan captured for ``bs`` in place.

        SGLang passes ``bs`` padded rows: padding rows have seq_len 1 (the fill value), read
        through req_to_token row 0 (or a stale row) and write slot 0 of the padding page.
        """
        del seq_lens_sum  # the host lengths come from seq_lens_cpu
        step = _GraphStep(forward_mode, spec_info, encoder_lens)
        self._replay(bs, req_pool_indices, seq_lens, seq_lens_cpu, step)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """SGLang's seq_len for padding rows: 1 (a row of length 0 is not a valid kernel row)."""
        return SEQ_LEN_FILL_VALUE

    def get_verify_buffers_to_fill_after_draft(self) -> list[None]:
        """No tree-mask or position buffers: a captured verify is a causal chain (topk 1)."""
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info: Any, cuda_graph_bs: Any) -> None:
        """Nothing to refresh for a chain verify (it has no tree mask)."""

    def _require_graph_state(self) -> tuple[GraphBuffers, torch.Tensor]:
        if self._graph is None:
            raise InvalidInputError(
                "init_cuda_graph_state", "called before capturing or replaying", "not called"
            )
        return self._graph

    def _capture(self, bs: int, num_tokens: int, mode: ForwardMode, step: Any) -> None:
        state, _ = self._require_graph_state()
        per_row = _graph_tokens_per_row(mode, step.spec_info, getattr(step, "encoder_lens", None))
        if num_tokens != bs * per_row:
            raise InvalidInputError(
                "num_tokens", f"bs * tokens per row = {bs} * {per_row} = {bs * per_row}", num_tokens
            )
        plan = self.backend.plan_for_capture(state, bs, num_tokens, max_query_len=per_row)
        self._graph_plans[(bs, per_row)] = plan
        self._plan = plan

    def _replay(
        self,
        bs: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        step: Any,
    ) -> None:
        _, no_slots = self._require_graph_state()
        mode = step.forward_mode
        per_row = _graph_tokens_per_row(mode, step.spec_info, getattr(step, "encoder_lens", None))
        plan = self._graph_plans.get((bs, per_row))
        if plan is None:
            captured = sorted(b for b, n in self._graph_plans if n == per_row)
            raise InvalidInputError("bs", f"a captured batch size, one of {captured}", bs)
        if seq_lens_cpu is None:
            raise InvalidInputError(
                "seq_lens_cpu", "the host twin of seq_lens (attnsdk never syncs for it)", None
            )
        view = _GraphBatch(
            forward_mode=mode,
            batch_size=bs,
            req_pool_indices=req_pool_indices[:bs],
            seq_lens=seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu[:bs],
            out_cache_loc=no_slots[: bs * per_row],
            spec_info=step.spec_info,
        )
        self.backend.plan_for_replay(plan, self._adapter().build_metadata(view))
        self._plan = plan


@dataclass(frozen=True, slots=True)
class _GraphStep:
    """What the legacy (<= 0.5.12) graph hooks pass, under the names the new hooks' batch has."""

    forward_mode: Any
    spec_info: Any
    encoder_lens: torch.Tensor | None


def _graph_tokens_per_row(mode: ForwardMode, spec_info: Any, encoder_lens: Any) -> int:
    if encoder_lens is not None:
        refuse("CUDA graph", "encoder_lens", "cross-attention is not mapped")
    kind = step_kind(mode)
    if kind is StepKind.TARGET_VERIFY:
        drafts = draft_token_num(spec_info)  # refuses a missing spec_info first
        if is_tree(spec_info):
            refuse(
                "CUDA graph",
                "spec_info",
                "tree verify (EAGLE topk > 1, NGRAM) runs eagerly: the graph buffers carry no "
                "tree mask yet (start SGLang without CUDA graphs for the target model)",
            )
        return drafts
    if kind is StepKind.DECODE and not (spec_info is not None and mode.is_decode()):
        return 1
    raise UnsupportedConfigError(
        f"forward_mode under CUDA graphs: expected DECODE, IDLE or TARGET_VERIFY, found {mode!r}"
        + (" with spec_info (EAGLE draft decode)" if kind is StepKind.DECODE else ""),
    )

"""The CUDA-graph half of the SGLang drop-in: both generations of SGLang's graph hooks.

- SGLang 0.5.13 and later: ``init_forward_metadata_out_graph(fb, in_capture=True)`` before
  capturing, ``init_forward_metadata_out_graph(fb_view)`` before each replay (``fb_view`` holds
  the padded static inputs), ``init_forward_metadata_in_graph(fb)`` inside the graph;
- SGLang 0.5.12 and earlier: ``init_forward_metadata_capture_cuda_graph`` /
  ``init_forward_metadata_replay_cuda_graph``.

Both map onto the attnsdk backend's ``graph_state`` / ``plan_for_capture`` / ``plan_for_replay``.
A replay builds the ``AttentionMetadata`` of the batch's real rows straight from the hook's
arguments (no batch object in between) and hands it to ``plan_for_replay``, which copies it into
the captured plan's static buffers (``GraphBuffers.replay_update``) and pads the other rows.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from attnsdk.adapters._common import engine_attr, refuse
from attnsdk.adapters.sglang._modes import StepKind, draft_token_num, is_tree, step_kind
from attnsdk.contract.checks import is_int_tensor
from attnsdk.contract.errors import InvalidInputError, InvalidMetadataError, UnsupportedConfigError
from attnsdk.contract.metadata import AttentionMetadata

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from attnsdk.adapters.sglang._adapter import SGLangAdapter
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.plan import GraphBuffers, Plan

__all__ = ["SEQ_LEN_FILL_VALUE", "SGLangGraphHooks"]

SEQ_LEN_FILL_VALUE = 1
"""SGLang's seq_len of CUDA-graph padding rows; with req_to_token row 0 they read page 0."""


@dataclass(frozen=True, slots=True)
class _GraphState:
    """What every replay reuses: the static buffers, and constant tensors it would otherwise
    rebuild per replay."""

    buffers: GraphBuffers
    no_slots: torch.Tensor
    """(max tokens,) int64 of -1 on the device: a replayed plan writes nothing (the captured
    forward writes K/V through SGLang's pool, at the graph runner's static ``out_cache_loc``)."""
    ramp: torch.Tensor
    """(max_bs + 1,) int32 ``0, 1, 2, ...`` on the device."""
    ramp_cpu: torch.Tensor
    """The same, on the host."""
    starts: dict[int, tuple[torch.Tensor, torch.Tensor]]
    """Tokens per row -> (device, host) ``query_start_loc`` of max_bs rows of that many
    tokens, made at capture; a replay of b rows takes its first b + 1 entries (a view)."""

    def query_starts(self, per_row: int) -> tuple[torch.Tensor, torch.Tensor]:
        found = self.starts.get(per_row)
        if found is None:
            found = self.starts[per_row] = (self.ramp * per_row, self.ramp_cpu * per_row)
        return found


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
    _graph: _GraphState | None = None
    """The static buffers and the constants replays reuse (``init_cuda_graph_state``)."""
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
        ramp = torch.arange(max_bs + 1, dtype=torch.int32)
        self._graph = _GraphState(
            buffers=state,
            no_slots=torch.full((max_num_tokens,), -1, dtype=torch.int64, device=self.device),
            ramp=ramp.to(self.device),
            ramp_cpu=ramp,
            starts={},
        )
        self._graph_plans.clear()

    def init_forward_metadata_out_graph(
        self, forward_batch: ForwardBatch, in_capture: bool = False
    ) -> None:
        """SGLang 0.5.13+: bind a captured plan (``in_capture``) or refresh it for a replay.

        At capture ``forward_batch`` views the graph runner's static inputs; at replay it is
        the runner's view of them (``batch_size`` rows in the captured ``forward_mode``, the
        last ``num_padding`` of them padding), whose real rows are copied into the captured
        plan's buffers.
        """
        fb = forward_batch

        def read(name: str) -> Any:
            return engine_attr(fb, "forward_batch", name)

        mode = read("forward_mode")
        step = _GraphStep(mode, read("spec_info"), getattr(fb, "encoder_lens", None))
        bs = read("batch_size")
        if in_capture:
            self._capture(bs, read("out_cache_loc").shape[0], mode, step)
        else:
            padding = getattr(fb, "num_padding", None)
            real = bs if padding is None else bs - padding
            batch = (read("req_pool_indices"), read("seq_lens"), read("seq_lens_cpu"))
            self._replay(bs, real, *batch, step)

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
        through req_to_token row 0 (or a stale row) and write slot 0 of the padding page. How
        many rows are real only the runner's batch says: 0.5.12's runner hands it to the
        backend as ``_replay_forward_batch`` around this call (for DeepSeek V4's backend);
        without it every row is taken as real, which reads the same keys for the real rows.
        """
        del seq_lens_sum  # the host lengths come from seq_lens_cpu
        live = getattr(getattr(self, "_replay_forward_batch", None), "batch_size", None)
        real = bs
        if isinstance(live, numbers.Integral) and not isinstance(live, bool) and live <= bs:
            real = int(live)
        step = _GraphStep(forward_mode, spec_info, encoder_lens)
        self._replay(bs, real, req_pool_indices, seq_lens, seq_lens_cpu, step)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """SGLang's seq_len for padding rows: 1 (a row of length 0 is not a valid kernel row)."""
        return SEQ_LEN_FILL_VALUE

    def get_verify_buffers_to_fill_after_draft(self) -> list[None]:
        """No tree-mask or position buffers: a captured verify is a causal chain (topk 1)."""
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info: Any, cuda_graph_bs: Any) -> None:
        """Nothing to refresh for a chain verify (it has no tree mask)."""

    def _require_graph_state(self) -> _GraphState:
        if self._graph is None:
            raise InvalidInputError(
                "init_cuda_graph_state", "called before capturing or replaying", "not called"
            )
        return self._graph

    def _capture(self, bs: int, num_tokens: int, mode: ForwardMode, step: Any) -> None:
        graph = self._require_graph_state()
        per_row = _graph_tokens_per_row(mode, step.spec_info, getattr(step, "encoder_lens", None))
        if num_tokens != bs * per_row:
            raise InvalidInputError(
                "num_tokens", f"bs * tokens per row = {bs} * {per_row} = {bs * per_row}", num_tokens
            )
        plan = self.backend.plan_for_capture(graph.buffers, bs, num_tokens, max_query_len=per_row)
        graph.query_starts(per_row)  # made now, so no replay allocates it
        self._graph_plans[(bs, per_row)] = plan
        self._plan = plan

    def _replay(
        self,
        bs: int,
        real: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor | None,
        step: Any,
    ) -> None:
        """Refresh the plan captured for ``bs`` rows with the first ``real`` of them (the rest
        are padding, which ``plan_for_replay`` pads itself: seq_len 1 on the reserved page)."""
        graph = self._require_graph_state()
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
        if not 0 <= real <= bs:
            raise InvalidInputError("num_padding", f"0..{bs} padding rows of {bs}", bs - real)
        # TARGET_VERIFY's seq_lens exclude the drafts, which are this step's query tokens.
        drafts = per_row if step_kind(mode) is StepKind.TARGET_VERIFY else 0
        meta = self._replay_metadata(
            graph, real, per_row, drafts, req_pool_indices, seq_lens, seq_lens_cpu
        )
        self.backend.plan_for_replay(plan, meta)
        self._plan = plan

    def _replay_metadata(
        self,
        graph: _GraphState,
        b: int,
        per_row: int,
        drafts: int,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
    ) -> AttentionMetadata:
        """The ``AttentionMetadata`` of the replay's ``b`` real rows, ``per_row`` query tokens
        each, from the graph runner's static inputs (host lengths from ``seq_lens_cpu``; no
        device sync). Its slots are -1: the captured forward writes K/V through the pool."""
        for name, t, device in (
            ("req_pool_indices", req_pool_indices, None),
            ("seq_lens", seq_lens, None),
            ("seq_lens_cpu", seq_lens_cpu, "cpu"),
        ):
            if not is_int_tensor(t) or t.dim() != 1 or t.shape[0] < b:
                found = (t.dtype, tuple(t.shape)) if isinstance(t, torch.Tensor) else repr(t)
                raise InvalidMetadataError(name, f"a 1-D integer tensor of >= {b} rows", found)
            if device is not None and t.device.type != device:
                raise InvalidMetadataError(f"{name}.device", device, t.device)
        adapter = self._adapter()
        rows = req_pool_indices[:b]
        if rows.device.type == "cpu":  # checked where reading it costs no device sync
            limit = adapter.req_to_token.shape[0]
            bad = torch.nonzero((rows < 0) | (rows >= limit))
            if bad.numel():
                i = int(bad[0])
                raise InvalidMetadataError(
                    f"req_pool_indices[{i}]", f"a row of req_to_token, 0..{limit - 1}", int(rows[i])
                )
        host = seq_lens_cpu[:b].to(torch.int32)
        lengths = seq_lens[:b].to(torch.int32)
        if drafts:
            host = host + drafts
            lengths = lengths + drafts
        max_seq = int(host.max()) if b else 0
        starts, starts_cpu = graph.query_starts(per_row)
        return AttentionMetadata.from_tensors(
            query_start_loc=starts[: b + 1],
            seq_lens=lengths,
            page_table=adapter.page_table(rows, -(-max_seq // self.page_size)),
            slot_mapping=graph.no_slots[: b * per_row],
            query_start_loc_cpu=starts_cpu[: b + 1],
            seq_lens_cpu=host,
            max_query_len=per_row if b else 0,
            max_seq_len=max_seq,
            page_size=self.page_size,
        )


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

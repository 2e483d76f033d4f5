"""A mock of SGLang's decode CUDA-graph runner: its input handling and either release's hooks,
without graphs (public through ``attnsdk.adapters.sglang.testing``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Literal

import torch

from attnsdk.adapters.sglang._mock_objects import ForwardMode, MockForwardBatch
from attnsdk.contract.errors import InvalidInputError

if TYPE_CHECKING:
    from collections.abc import Sequence

    from attnsdk.adapters.sglang._mock_objects import MockModelRunner, VerifyInput

__all__ = ["MockCudaGraphRunner"]


class MockCudaGraphRunner:
    """SGLang's decode CUDA-graph runner's input handling, minus the graphs.

    ``hooks="out_graph"`` follows SGLang 0.5.13+ (``DecodeCudaGraphRunner``): capture calls
    ``init_forward_metadata_out_graph(fb, in_capture=True)`` then ``..._in_graph(fb)`` for
    each size, largest first, on static inputs reset to padding (request row 0, seq_len 1,
    slot 0); a replay pads the same way and passes a view of the static inputs (the captured
    ``forward_mode``, the live ``out_cache_loc``, ``num_padding``). ``hooks="legacy"`` follows
    0.5.12's ``CudaGraphRunner``: the capture/replay hooks, padding rows keep whatever request
    row the static buffer last held, and the live batch is set on the backend as
    ``_replay_forward_batch`` around the replay hook. The returned ``MockForwardBatch`` views
    the static buffers, like the batch a captured graph reads.
    """

    def __init__(
        self,
        backend: Any,
        model_runner: MockModelRunner,
        capture_bs: Sequence[int],
        mode: ForwardMode = ForwardMode.DECODE,
        spec_info: VerifyInput | None = None,
        *,
        hooks: Literal["out_graph", "legacy"] = "out_graph",
    ) -> None:
        if hooks not in ("out_graph", "legacy"):
            raise InvalidInputError("hooks", "'out_graph' or 'legacy'", repr(hooks))
        self.backend, self.model_runner, self.mode = backend, model_runner, mode
        self.spec_info = spec_info
        self.hooks = hooks
        self.capture_bs = sorted(capture_bs)
        self.per_row = spec_info.draft_token_num if mode.is_target_verify() and spec_info else 1
        max_bs = self.capture_bs[-1]
        dev = model_runner.device
        fill = backend.get_cuda_graph_seq_len_fill_value()
        self.fill = fill
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), fill, dtype=torch.int64, device=dev)
        self.seq_lens_cpu = torch.full((max_bs,), fill, dtype=torch.int64)
        self.out_cache_loc = torch.zeros(max_bs * self.per_row, dtype=torch.int64, device=dev)
        backend.init_cuda_graph_state(max_bs, max_bs * self.per_row)
        for bs in reversed(self.capture_bs):
            if hooks == "legacy":
                backend.init_forward_metadata_capture_cuda_graph(
                    bs,
                    bs * self.per_row,
                    self.req_pool_indices[:bs],
                    self.seq_lens[:bs],
                    None,
                    mode,
                    spec_info,
                )
            else:
                self._reset()
                fb = self.static_batch(bs)
                backend.init_forward_metadata_out_graph(fb, in_capture=True)
                backend.init_forward_metadata_in_graph(fb)

    def _reset(self) -> None:
        self.req_pool_indices.zero_()
        self.out_cache_loc.zero_()
        self.seq_lens.fill_(self.fill)
        self.seq_lens_cpu.fill_(self.fill)

    def static_batch(self, bs: int) -> MockForwardBatch:
        """The forward batch a graph captured for ``bs`` rows reads (views of static buffers)."""
        return MockForwardBatch(
            forward_mode=self.mode,
            batch_size=bs,
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            seq_lens_sum=int(self.seq_lens_cpu[:bs].sum()),
            out_cache_loc=self.out_cache_loc[: bs * self.per_row],
            spec_info=self.spec_info,
        )

    def replay_prepare(self, fb: MockForwardBatch) -> MockForwardBatch:
        """Copy ``fb`` into the static inputs, pad to a captured size, run the replay hook."""
        raw = fb.batch_size
        bs = next((c for c in self.capture_bs if c >= raw), None)
        if bs is None:
            raise InvalidInputError("batch_size", f"<= {self.capture_bs[-1]} (captured)", raw)
        if fb.seq_lens_cpu is None or fb.seq_lens_sum is None:
            raise InvalidInputError("fb.seq_lens_cpu", "host lengths", None)
        if self.hooks == "out_graph":
            self._reset()  # SGLang 0.5.13+: padding rows read request row 0
        elif bs != raw:
            self.seq_lens.fill_(self.fill)
            self.seq_lens_cpu.fill_(self.fill)
            self.out_cache_loc.zero_()
        self.req_pool_indices[:raw].copy_(fb.req_pool_indices)
        self.seq_lens[:raw].copy_(fb.seq_lens)
        self.seq_lens_cpu[:raw].copy_(fb.seq_lens_cpu)
        self.out_cache_loc[: fb.out_cache_loc.shape[0]].copy_(fb.out_cache_loc)
        if self.hooks == "legacy":
            # 0.5.12's runner hands the live batch to the backend around the hook.
            self.backend._replay_forward_batch = fb
            self.backend.init_forward_metadata_replay_cuda_graph(
                bs,
                self.req_pool_indices,
                self.seq_lens,
                fb.seq_lens_sum + (bs - raw) * self.fill,
                None,
                self.mode,
                fb.spec_info,
                self.seq_lens_cpu,
            )
            self.backend._replay_forward_batch = None
        else:
            view = SimpleNamespace(
                batch_size=bs,
                forward_mode=self.mode,
                actual_forward_mode=fb.forward_mode,
                req_pool_indices=self.req_pool_indices[:bs],
                seq_lens=self.seq_lens[:bs],
                seq_lens_cpu=self.seq_lens_cpu[:bs],
                seq_lens_sum=fb.seq_lens_sum + (bs - raw) * self.fill,
                num_padding=bs - raw,
                encoder_lens=None,
                out_cache_loc=fb.out_cache_loc,
                spec_info=fb.spec_info,
            )
            self.backend.init_forward_metadata_out_graph(view)
        return self.static_batch(bs)

    def pad_tokens(self, x: torch.Tensor, bs: int) -> torch.Tensor:
        """``x`` (real tokens first) padded with zero rows to the ``bs * per_row`` graph rows."""
        out = x.new_zeros(bs * self.per_row, *x.shape[1:])
        out[: x.shape[0]] = x
        return out

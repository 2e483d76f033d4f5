"""Debug mode: every plan and forward fully validated, every output checked for NaN.

Turn it on with ``ATTNSDK_DEBUG=1`` or ``AttentionConfig(debug=True)``; ``create_backend`` then
returns the backend wrapped in ``DebugBackend``. It syncs the device on every layer, so it is
for finding a misbehaving integration, not for serving. Inside CUDA-graph capture nothing can
sync: captured forwards run unchecked and each replay's metadata is validated instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from attnsdk.contract.backend import check_forward_args
from attnsdk.contract.debug import ENV_DEBUG, env_debug
from attnsdk.contract.errors import (
    AttnSDKError,
    InvalidInputError,
)
from attnsdk.contract.metadata import check_is_metadata, validate_metadata
from attnsdk.features.ragged import check_ragged_args
from attnsdk.selection.wrapper import BackendWrapper, ForwardCall, RaggedCall

if TYPE_CHECKING:
    from attnsdk.contract.backend import Backend
    from attnsdk.contract.metadata import AttentionMetadata
    from attnsdk.contract.plan import Plan
    from attnsdk.selection.config import AttentionConfig

__all__ = ["ENV_DEBUG", "DebugBackend", "debug_enabled", "wrap_debug"]


def debug_enabled(config: AttentionConfig | None = None) -> bool:
    """``config.debug``, or the environment's ``ATTNSDK_DEBUG`` (``contract.debug``)."""
    return bool(config is not None and config.debug) or env_debug()


def wrap_debug(backend: Backend) -> Backend:
    return backend if isinstance(backend, DebugBackend) else DebugBackend(backend)


class DebugBackend(BackendWrapper):
    """A backend with every check on. Other attributes are the wrapped backend's.

    Before each forward: the argument checks, ``AttentionMetadata.validate(cache)`` (once per
    plan and cache size; the reserved page 0 unless a self-attention step writes nothing, see
    docs/kv_layout.md, "Pages and slots"), finite q / k / v, sinks finite or -inf (a sink of
    -inf adds nothing), and positive finite fp8 scales. After it: any error the device side
    recorded (e.g. a slot past the cache, reported at once), a finite output for every real
    token row and, when ``lse=`` is given, no NaN or +inf in its real rows.
    """

    def __init__(self, backend: Backend) -> None:
        self.inner = backend
        self.name = backend.name
        self.capabilities = backend.capabilities
        self._validated: tuple[Plan, int, int | None, int | None] | None = None
        """(plan, cache pages, window, chunk) of the last validation: the plan itself, not its
        id, which a new plan may reuse once the old one is freed."""
        self._validated_ragged: Plan | None = None

    def members(self) -> list[Backend]:
        return [self.inner]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __repr__(self) -> str:
        return f"DebugBackend({self.inner!r})"

    def plan(self, meta: AttentionMetadata) -> Plan:
        check_is_metadata("meta", meta)
        if meta.page_size is not None and not _capturing():
            # Without a layer the window is unknown: the reserved page is checked per forward.
            validate_metadata(meta, meta.page_size, reserved_page=None)
        return self.inner.plan(meta)

    def before_forward(self, call: ForwardCall) -> None:
        """Every check of a forward before it runs (class docstring); none while capturing."""
        if _capturing():
            return
        c = call
        check_forward_args(
            c.q, c.k, c.v, c.cache, c.plan, c.layer,
            sinks=c.sinks, k_scale=c.k_scale, v_scale=c.v_scale, out=c.out, lse=c.lse,
        )  # fmt: skip
        meta, layer = c.plan.metadata, c.layer
        last = self._validated
        seen = (c.cache.num_pages, layer.sliding_window, layer.attention_chunk_size)
        if last is None or last[0] is not c.plan or last[1:] != seen:
            validate_metadata(
                meta,
                c.cache,
                reserved_page=_reserved_page_to_check(meta),
                sliding_window=layer.sliding_window,
                attention_chunk_size=layer.attention_chunk_size,
            )
            self._validated = (c.plan, *seen)
        rows = int(meta.query_start_loc_cpu[-1])
        for name, t in (("q", c.q), ("k", c.k), ("v", c.v)):
            if t is not None:
                _finite(name, t[:rows], InvalidInputError)
        if c.sinks is not None:
            _finite_sinks(c.sinks)
        for name, scale in (("k_scale", c.k_scale), ("v_scale", c.v_scale)):
            if scale is not None and not bool((torch.isfinite(scale) & (scale > 0)).all()):
                raise InvalidInputError(name, "finite values > 0", scale.flatten().tolist())

    def after_forward(self, call: ForwardCall, result: torch.Tensor) -> torch.Tensor:
        if _capturing():
            return result
        rows = int(call.plan.metadata.query_start_loc_cpu[-1])
        return self._checked(result, call.lse, rows, call.cache.device)

    def before_ragged(self, call: RaggedCall) -> None:
        """``before_forward``'s checks for a ragged call: the arguments, ``validate(None)``
        once per plan (which reads ``key_start_loc`` against ``seq_lens``), finite q and key
        rows of k / v."""
        if _capturing():
            return
        c = call
        check_ragged_args(c.q, c.k, c.v, c.plan, c.layer, sinks=c.sinks, out=c.out, lse=c.lse)
        meta = c.plan.metadata
        if self._validated_ragged is not c.plan:
            validate_metadata(meta, None)
            self._validated_ragged = c.plan
        rows, keys = meta.num_tokens, int(meta.seq_lens_cpu.sum())
        for name, t in (("q", c.q[:rows]), ("k", c.k[:keys]), ("v", c.v[:keys])):
            _finite(name, t, InvalidInputError)
        if c.sinks is not None:
            _finite_sinks(c.sinks)

    def after_ragged(self, call: RaggedCall, result: torch.Tensor) -> torch.Tensor:
        if _capturing():
            return result
        return self._checked(result, call.lse, call.plan.metadata.num_tokens, call.q.device)

    def _checked(
        self, result: torch.Tensor, lse: torch.Tensor | None, rows: int, device: torch.device
    ) -> torch.Tensor:
        """``result`` after a forward: any error the device recorded, then a finite output and
        lse in the ``rows`` real token rows."""
        self.inner.sync_check(device)
        _finite("output", result[:rows], None, backend=self.name)
        if lse is not None:
            # -inf is a valid log-sum-exp (a row that sees no key and no sink); NaN never is.
            real = lse[:rows]
            _finite("lse", real.masked_fill(real == float("-inf"), 0.0), None, backend=self.name)
        return result

    def plan_for_replay(self, plan: Plan, meta: AttentionMetadata) -> None:
        super().plan_for_replay(plan, meta)
        if plan.graph is not None:
            validate_metadata(plan.metadata, plan.graph.page_size, reserved_page=None)


def _reserved_page_to_check(meta: AttentionMetadata) -> int | None:
    """Page 0, except in a self-attention step that writes nothing (then None: unchecked).

    Such a step's keys are not in pages an engine allocated: encoder-only attention served on
    a paged backend views the step's own k/v as a page-size-1 cache (token t on page t, page 0
    being token 0) and writes nothing, and every backend serves it exactly. Every step that writes K/V (any
    decoder step) and every cross-attention step reads pages an engine allocated, where page 0
    is its padding page or null block: those are checked, so a layer reading vLLM's null block
    in place of its own keys is still caught. ``validate()`` called directly is strict.
    """
    if meta.cross_attention:
        return 0
    writes = bool((meta.slot_mapping[: meta.num_tokens] >= 0).any())
    return 0 if writes else None


def _finite_sinks(sinks: torch.Tensor) -> None:
    """No NaN or +inf sink; -inf is a valid sink (exp(-inf) = 0: it adds nothing to the
    softmax denominator, which every backend serves exactly)."""
    _finite("sinks", sinks.masked_fill(sinks == float("-inf"), 0.0), InvalidInputError)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _finite(
    name: str, t: torch.Tensor, error: type[InvalidInputError] | None, backend: str = ""
) -> None:
    bad = ~torch.isfinite(t)
    if not bool(bad.any()):
        return
    where = tuple(int(i) for i in torch.nonzero(bad)[0])
    value = float(t[where])
    if error is not None:
        raise error(name, "finite values", f"{value} at {where}")
    raise AttnSDKError(
        f"debug mode: backend {backend!r} produced {value} at {name}{list(where)} from finite "
        "inputs and valid metadata; please report it with the batch"
    )

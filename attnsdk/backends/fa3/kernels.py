"""FA3 kernel providers: find one without importing it, load it, and call it the cheapest way.

Three packages ship the FlashAttention-3 Hopper kernels under different names. Detection
(``_gpu.module_present``) never imports a kernel library.

Calling route (docs/benchmarks.md has the numbers): ``flash_attn_interface.flash_attn_with_kvcache``
spends most of its eager time outside the kernel, in a ``torch.library.custom_op`` layer
(autograd and fake-tensor plumbing, ``maybe_contiguous`` on ten optional tensors) wrapped around
the registered C++ op. When the registered ``flash_attn_3::fwd`` op has the schema this module
was written against, the backend calls that op directly with positional arguments. Any other
build goes through the provider's public Python wrapper, which is slower but always correct.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from attnsdk.contract.errors import (
    BackendUnavailableError,
    Reason,
    ReasonKind,
    UnsupportedConfigError,
)
from attnsdk.kernels.probes import module_present

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch

__all__ = [
    "INSTALL_COMMAND",
    "PROVIDERS",
    "KernelCall",
    "Provider",
    "build_flags",
    "find_provider",
    "load_kernel",
]

Provider = Literal["flash_attn_interface", "sgl_kernel", "vllm"]

INSTALL_COMMAND = "pip install tokenspeed-fa3"
"""What error messages name: the official FA3 build (``flash_attn_interface``), as the ``fa3``
extra installs it. attnsdk is not on the package index, so ``attnsdk[fa3]`` works only as
``pip install -e "/path/to/attnsdk[fa3]"`` from a checkout."""

PROVIDERS: dict[Provider, str] = {
    "flash_attn_interface": "flash_attn_interface",
    "sgl_kernel": "sgl_kernel.flash_attn",
    "vllm": "vllm.vllm_flash_attn",
}
"""Provider name -> module holding ``flash_attn_with_kvcache``, in detection order."""

# ``torch.ops.flash_attn_3.fwd`` as this module calls it positionally: 35 arguments, q first,
# the output buffer 7th, sinks last (flash_attn_interface 3.0 with sinks). Any other schema goes
# through the Python wrapper.
_WRAPPER_NEEDS = frozenset({"page_table", "cu_seqlens_q", "max_seqlen_q", "cache_seqlens"})
"""Keywords the public wrapper must take for one paged varlen call to serve a mixed batch."""
_FWD_ARITY = 35
_FWD_MARKERS = {0: "q", 34: "sinks"}


def find_provider(pinned: Provider | Literal["auto"] = "auto") -> Provider | None:
    """The first installed provider (or ``pinned`` if installed); None when there is none."""
    names: tuple[Provider, ...] = tuple(PROVIDERS) if pinned == "auto" else (pinned,)
    return next((p for p in names if module_present(PROVIDERS[p])), None)


@functools.cache
def build_flags() -> dict[str, bool]:
    """Compile-time switches of the installed flash_attn_interface build ({} if unknown)."""
    if not module_present("flash_attn_config"):
        return {}
    config = importlib.import_module("flash_attn_config").CONFIG  # a plain dict, no kernels
    return dict(config.get("build_flags", {}))


@dataclass(frozen=True, slots=True)
class KernelCall:
    """A loaded provider: how to run one paged FA3 forward into ``out``."""

    provider: Provider
    direct: bool
    """True: the registered C++ op with positional arguments; False: the provider's wrapper."""
    fwd: Callable[..., Any]
    scheduler: Callable[..., Any] | None
    """``get_scheduler_metadata`` op, or None if this provider lacks it."""
    wrapper_kwargs: frozenset[str]
    """Keyword names the Python wrapper accepts (route ``direct=False``)."""

    @property
    def takes_qv(self) -> bool:
        """Whether a call can pass MLA's ``qv`` (the op's sixth argument; the wrapper's
        keyword, which vLLM's fork lacks on ``flash_attn_with_kvcache``)."""
        return self.direct or "qv" in self.wrapper_kwargs

    @property
    def takes_ragged(self) -> bool:
        """Whether a call can attend over dense varlen K/V (``cu_seqlens_k``, no page table):
        the registered op takes both forms; the wrappers' paged entry point does not."""
        return self.direct

    @property
    def returns_lse(self) -> bool:
        """Whether a call can hand back FA3's ``softmax_lse`` (the op always computes it)."""
        return self.direct or "return_softmax_lse" in self.wrapper_kwargs

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        *,
        cu_seqlens_q: torch.Tensor,
        cache_seqlens: torch.Tensor | None,
        page_table: torch.Tensor | None,
        max_seqlen_q: int,
        softmax_scale: float,
        causal: bool,
        window: tuple[int, int],
        softcap: float,
        q_descale: torch.Tensor | None,
        k_descale: torch.Tensor | None,
        v_descale: torch.Tensor | None,
        scheduler_metadata: torch.Tensor | None,
        num_splits: int,
        pack_gqa: bool | None,
        sinks: torch.Tensor | None,
        lse: torch.Tensor | None,
        qv: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        max_seqlen_k: int | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | None:
        """Attention into ``out`` and, when given, the log-sum-exp into ``lse`` (T, Hq);
        ``return_lse`` returns FA3's own log-sum-exp as a (T, Hq) view instead (strided, no
        copy: for ``merge_states``, which reads strides), else None.
        ``qv`` (T, Hq, Dv): MLA's second query part, multiplied with ``v_cache`` (the latent)
        and added to q·k (FA3's hdim 64 x 512 kernels). ``cu_seqlens_k`` (B + 1,) with
        ``max_seqlen_k``, and no ``page_table`` / ``cache_seqlens``: k_cache / v_cache are
        dense (Tk, Hkv, D | Dv) rows, sequence b's at ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
        (``flash_attn_varlen_func``; ``takes_ragged`` only)."""
        if self.direct:
            _, softmax_lse, *_ = self.fwd(
                q, k_cache, v_cache, None, None, qv, out, cu_seqlens_q, cu_seqlens_k, None, None,
                cache_seqlens, max_seqlen_q, max_seqlen_k, page_table, None, None, None, None, None,
                q_descale, k_descale, v_descale, softmax_scale, causal, window[0], window[1],
                0, softcap, True, scheduler_metadata, num_splits, pack_gqa, 0, sinks,
            )  # fmt: skip
            return _lse_out(lse, softmax_lse, q.shape[0], return_lse)
        if cu_seqlens_k is not None:
            raise UnsupportedConfigError(
                f"{self.provider}'s flash_attn_with_kvcache cannot attend over dense K/V:",
                [Reason(ReasonKind.CONFIGURATION, "ragged", "needs flash_attn_interface's op")],
            )
        kwargs: dict[str, Any] = {
            "cache_seqlens": cache_seqlens,
            "page_table": page_table,
            "cu_seqlens_q": cu_seqlens_q,
            "max_seqlen_q": max_seqlen_q,
            "softmax_scale": softmax_scale,
            "causal": causal,
            "window_size": window,
            "softcap": softcap,
            "num_splits": num_splits,
            "pack_gqa": pack_gqa,
        }
        optional = {
            "q_descale": q_descale,
            "k_descale": k_descale,
            "v_descale": v_descale,
            "scheduler_metadata": scheduler_metadata,
            "qv": qv,
        }
        kwargs.update({k: t for k, t in optional.items() if t is not None})
        if sinks is not None:
            # vLLM's fork names the sink logits "s_aux"; older builds have neither.
            name = next((n for n in ("sinks", "s_aux") if n in self.wrapper_kwargs), None)
            if name is None:
                raise UnsupportedConfigError(
                    "the installed FA3 build cannot apply attention sinks:",
                    [Reason(ReasonKind.CONFIGURATION, "sinks", f"unsupported by {self.provider}")],
                )
            kwargs[name] = sinks
        if "fa_version" in self.wrapper_kwargs:
            kwargs["fa_version"] = 3
        if lse is not None or return_lse:
            kwargs["return_softmax_lse"] = True  # backends refuse lse= when it is missing
        if "out" in self.wrapper_kwargs:
            result = self.fwd(q, k_cache, v_cache, out=out, **kwargs)
        else:
            result = self.fwd(q, k_cache, v_cache, **kwargs)
        # (out, softmax_lse, *rest) with return_softmax_lse, else the output alone.
        softmax_lse = None
        if lse is not None or return_lse:
            result, softmax_lse = result[0], result[1]
        if "out" not in self.wrapper_kwargs:
            out.copy_(result)
        return _lse_out(lse, softmax_lse, q.shape[0], return_lse)


def _lse_out(
    dest: torch.Tensor | None, softmax_lse: torch.Tensor | None, rows: int, view: bool
) -> torch.Tensor | None:
    """FA3's ``softmax_lse`` handed over as asked: copied into ``dest``, and/or returned as a
    (rows, Hq) view when ``view``."""
    if softmax_lse is None:
        return None
    if dest is not None:
        _copy_lse(dest, softmax_lse)
    return softmax_lse[:, :rows].t() if view else None


def _copy_lse(dest: torch.Tensor, softmax_lse: torch.Tensor) -> None:
    """FA3's varlen ``softmax_lse`` (Hq, total_q) into the caller's (T, Hq) buffer.

    Natural log (FA3's ``Softmax::finalize`` takes ``__logf`` of the row sum); a row that sees
    no key holds -inf. With sinks, the kernels fold the sink logit into each row's running max
    and sum before that log (vLLM's fork: ``finalize_aux``, on the first KV split only, so a
    split-KV combine counts it once; the flash_attn_interface build has a
    ``Softmax::set_row_sink``), so the sink term is already in the value and nothing is added
    here. tests/gpu/test_fa3.py::test_lse_counts_the_sink_once checks it on the GPU.
    """
    dest.copy_(softmax_lse[:, : dest.shape[0]].t())


def load_kernel(pinned: Provider | Literal["auto"] = "auto") -> KernelCall:
    """Import the provider (the first installed one for "auto") and pick its calling route.

    Raises ``BackendUnavailableError`` naming the install command when none is installed.
    """
    provider = find_provider(pinned)
    if provider is None:
        wanted = ", ".join(PROVIDERS.values()) if pinned == "auto" else PROVIDERS[pinned]
        raise BackendUnavailableError(
            f"the fa3 backend needs a FlashAttention-3 kernel library ({wanted}); none is installed.",
            INSTALL_COMMAND,
        )
    module = importlib.import_module(PROVIDERS[provider])
    if provider == "flash_attn_interface":
        import torch

        ops = getattr(torch.ops, "flash_attn_3", None)
        fwd = getattr(ops, "fwd", None) if ops is not None else None
        if fwd is not None and _direct_ok(_schema_names(fwd.default)):
            sched = getattr(ops, "get_scheduler_metadata", None)
            return KernelCall(
                provider, True, fwd.default, sched.default if sched else None, frozenset()
            )
    wrapper = getattr(module, "flash_attn_with_kvcache", None)
    names = frozenset(inspect.signature(wrapper).parameters) if wrapper is not None else frozenset()
    missing = sorted(_WRAPPER_NEEDS - names)
    if wrapper is None or missing:
        # e.g. a vLLM fork that serves FA3 only through flash_attn_varlen_func
        found = "no flash_attn_with_kvcache" if wrapper is None else f"one without {missing}"
        raise BackendUnavailableError(
            f"{PROVIDERS[provider]}.flash_attn_with_kvcache must take the paged varlen arguments "
            f"{sorted(_WRAPPER_NEEDS)}, found {found}.",
            INSTALL_COMMAND,
        )
    return KernelCall(provider, False, wrapper, None, names)


def _schema_names(op: Any) -> list[str]:
    return [a.name for a in op._schema.arguments]


def _direct_ok(names: list[str]) -> bool:
    return len(names) == _FWD_ARITY and all(names[i] == n for i, n in _FWD_MARKERS.items())

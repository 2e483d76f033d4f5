"""``Harness``: what every case of the conformance suite stands on. The attributes and hooks a
backend's test class sets, the fixtures, and the helpers that build a case's batches, skip what
the backend declares it cannot serve (after checking that it refuses it) and compare a run with
the reference's."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import pytest
import torch

from attnsdk.backends.reference import ReferenceBackend
from attnsdk.contract.errors import UnsupportedConfigError
from attnsdk.contract.kv import COMPUTE_DTYPES, KVCacheLayout
from attnsdk.contract.layer import LayerSpec
from attnsdk.selection.create import create_backend, explain
from attnsdk.testing._batch import make_batch
from attnsdk.testing._spec import BatchSpec
from attnsdk.testing._tolerance import assert_close_to_reference, tolerance
from attnsdk.testing.conformance._cache import as_packed, assert_same_cache, copy_cache
from attnsdk.testing.conformance._cases import (
    FEATURES,
    PACKED,
    edge_rows,
    with_siblings,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from attnsdk.contract.backend import Backend
    from attnsdk.contract.errors import Reason
    from attnsdk.selection.config import AttentionConfig
    from attnsdk.testing._batch import Batch, PageOrder

_PAGE_ORDERS: tuple[PageOrder, ...] = ("shuffled", "interleaved", "contiguous")
LSE_TOLERANCE = (5e-3, 1e-3)
"""(atol, rtol) of the log-sum-exp: fp32 from the same inputs on both sides; the slack covers
approximate exp2 / tanh (softcap) instructions. A missing sink term or a base-2 value misses it
by far more (the sink cases check that sinks move the lse by 10 * atol at least)."""


class Harness:
    """The attributes, hooks and fixtures of ``BackendConformance``, and the helpers its cases
    share; each group of cases is a subclass of it."""

    backend: ClassVar[str | AttentionConfig]
    """The backend under test: a registered name or an ``AttentionConfig``."""
    device: ClassVar[str] = "cpu"
    dtypes: ClassVar[tuple[torch.dtype, ...] | None] = None
    """Compute dtypes of the dtype cases; None: fp16, bf16 and fp32."""
    page_sizes: ClassVar[tuple[int, ...]] = (1, 16, 64)
    page_size: ClassVar[int] = 16
    seeds: ClassVar[int] = 3
    atol: ClassVar[float | None] = None
    rtol: ClassVar[float | None] = None
    serves_basic_case: ClassVar[bool] = True
    """False only for a backend that cannot serve a GQA layer on an NHD cache at ``page_size``
    (otherwise a backend refusing everything would pass by skipping)."""

    # -- hooks --------------------------------------------------------------------------------

    def tolerance(self, layout: KVCacheLayout) -> tuple[float, float]:
        """(atol, rtol) of the output comparison; default from the dtypes, then ``atol``/``rtol``."""
        atol, rtol = tolerance(layout.dtype, layout.storage_dtype)
        return (
            atol if self.atol is None else self.atol,
            rtol if self.rtol is None else self.rtol,
        )

    def lse_tolerance(self, layout: KVCacheLayout) -> tuple[float, float]:
        """(atol, rtol) of the log-sum-exp comparison: ``LSE_TOLERANCE``, or the output's
        tolerance with fp8 KV (a backend may round q differently around the fp8 scales)."""
        if layout.is_quantized:
            return self.tolerance(layout)
        return LSE_TOLERANCE

    def reference_batch(self, batch: Batch) -> Batch:
        """The batch the reference runs: override to model rounding the backend documents."""
        return batch

    # -- parametrisation and fixtures ---------------------------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """Parametrise ``dtype`` and ``page_size`` from the subclass's attributes."""
        for name, axis in generated_axes(type(self)).items():
            if name in metafunc.fixturenames:
                metafunc.parametrize(name, [v for _, v in axis], ids=[i for i, _ in axis])

    @pytest.fixture(scope="class")
    @classmethod
    def subject(cls) -> Backend:
        """The backend under test; skips the class, with the reasons, where it cannot run."""
        config = cls.backend
        dev = torch.device(cls.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            pytest.skip(f"{cls.__name__} needs a CUDA device ({cls.device}); none is visible")
        env = [r for reasons in explain(config, device=dev).values() for r in reasons]
        if env:
            pytest.skip(f"{_name(config)} cannot run on {dev}: " + "; ".join(map(str, env)))
        return create_backend(config, device=dev)

    @pytest.fixture(scope="class")
    @classmethod
    def oracle(cls) -> Backend:
        """The reference backend: every output and cache is compared with it."""
        return ReferenceBackend()

    # -- building a case ------------------------------------------------------------------------

    def _dtype(self, subject: Backend) -> torch.dtype:
        """The compute dtype of the non-dtype cases: bf16 if served, else the first served."""
        allowed = self.dtypes or tuple(COMPUTE_DTYPES)
        for d in (torch.bfloat16, torch.float16, torch.float32):
            if d in allowed and d in subject.capabilities.dtypes:
                return d
        return allowed[0]

    def _case(
        self,
        subject: Backend,
        feature: str,
        *,
        dtype: torch.dtype | None = None,
        order: str = "NHD",
        page_size: int | None = None,
    ) -> tuple[LayerSpec, KVCacheLayout]:
        """``feature``'s layer and cache layout; by default in ``_dtype``, NHD, ``page_size``."""
        f = FEATURES[feature]
        layout = KVCacheLayout(
            f.layer["num_kv_heads"],
            f.layer["head_dim"],
            self.page_size if page_size is None else page_size,
            dtype=self._dtype(subject) if dtype is None else dtype,
            v_head_dim=f.layer.get("v_head_dim"),
            order="HND" if order == PACKED else order,
            kv_dtype=f.kv_dtype,
            mla=f.layer.get("mla", False),
        )
        return LayerSpec(**f.layer), layout

    def _batches(
        self,
        subject: Backend,
        feature: str,
        spec: Callable[[int], BatchSpec],
        *,
        dtype: torch.dtype | None = None,
        order: str = "NHD",
        page_size: int | None = None,
        tree: bool = False,
    ) -> Iterator[Batch]:
        """A batch of ``spec(seed)`` on ``feature``'s case for each of ``seeds`` seeds; skips
        the case (``_require``) where the backend declares it cannot serve it."""
        f = FEATURES[feature]
        layer, layout = self._case(subject, feature, dtype=dtype, order=order, page_size=page_size)
        for seed in range(self.seeds):
            batch = self._batch(
                layer,
                layout,
                spec(seed),
                seed,
                per_head=f.per_head_scales,
                packed=order == PACKED,
                tree=tree,
            )
            self._require(subject, batch)
            yield batch

    def _batch(
        self,
        layer: LayerSpec,
        layout: KVCacheLayout,
        spec: BatchSpec,
        seed: int,
        *,
        per_head: bool = False,
        packed: bool = False,
        tree: bool = False,
    ) -> Batch:
        pages = _PAGE_ORDERS[seed % len(_PAGE_ORDERS)]
        edges = edge_rows(layer)
        if edges:
            # The rows where a window's or chunks' boundaries bite, whatever the seed drew;
            # first, so that graph padding rows stay last.
            spec = BatchSpec(
                tuple(q for q, _ in edges) + spec.query_lens,
                tuple(s for _, s in edges) + spec.seq_lens,
                spec.name,
                (False,) * len(edges) + spec.padded,
                spec.cross,
            )
        batch = make_batch(
            spec,
            layer,
            layout,
            pages=pages,
            seed=seed,
            device=self.device,
            per_head_scales=per_head,
            tree=tree,
        )
        if packed:
            batch = dataclasses.replace(batch, cache=as_packed(batch.cache))
        if tree:
            batch = dataclasses.replace(batch, metadata=with_siblings(batch.metadata))
        if batch.sinks is not None:
            # make_batch's unit-normal sinks barely move the output; these move it well past
            # the tolerance, so a backend that ignores them fails.
            gen = torch.Generator().manual_seed(seed)
            sinks = 1.0 + 2.0 * torch.randn(layer.num_heads, generator=gen)
            batch = dataclasses.replace(batch, sinks=sinks.to(self.device))
        return batch

    # -- running and comparing ----------------------------------------------------------------

    def _require(self, subject: Backend, batch: Batch) -> None:
        """Skip, with the backend's reasons, what it declares it cannot serve, after checking
        that forward refuses it and writes nothing."""
        reasons = subject.unsupported_reasons(batch.layer, batch.cache.layout, self.device)
        refused(reasons, subject, batch, with_lse=False)

    def _compare(self, subject: Backend, oracle: Backend, batch: Batch) -> torch.Tensor:
        """Run both on copies of the same cache; compare the output and the whole cache."""
        layout = batch.cache.layout
        out, cache = batch.run(subject, copy_cache(batch.cache))
        ref, ref_cache = self.reference_batch(batch).run(oracle)
        self._assert_output(out, ref, layout)
        assert_same_cache(cache, ref_cache, batch.metadata, exact=not layout.is_quantized)
        return out

    def _assert_output(self, out: torch.Tensor, ref: torch.Tensor, layout: KVCacheLayout) -> None:
        atol, rtol = self.tolerance(layout)
        assert_close_to_reference(out, ref, atol=atol, rtol=rtol)

    def _assert_lse(self, lse: torch.Tensor, ref: torch.Tensor, layout: KVCacheLayout) -> None:
        """fp32, within ``lse_tolerance`` (``assert_lse_close``)."""
        assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}"
        atol, rtol = self.lse_tolerance(layout)
        assert_lse_close(lse, ref, atol=atol, rtol=rtol)


def generated_axes(suite: type[Harness]) -> dict[str, list[tuple[str, Any]]]:
    """The arguments ``pytest_generate_tests`` parametrises, in its order, each as its
    [(pytest id, value)]: ``dtype`` (``dtypes``, else every compute dtype), ``page_size``."""
    dtypes = suite.dtypes or tuple(sorted(COMPUTE_DTYPES, key=str))
    return {
        "dtype": [(str(d).removeprefix("torch."), d) for d in dtypes],
        "page_size": [(f"p{p}", p) for p in suite.page_sizes],
    }


def refused(reasons: list[Reason], subject: Backend, batch: Batch, *, with_lse: bool) -> None:
    """With ``reasons``: check that running ``batch`` raises ``UnsupportedConfigError`` and
    writes nothing, then skip the case naming them. Without: return."""
    if not reasons:
        return
    cache = copy_cache(batch.cache)
    run = batch.run_with_lse if with_lse else batch.run
    with pytest.raises(UnsupportedConfigError):
        run(subject, cache)
    assert_same_cache(cache, batch.cache, batch.metadata, exact=True, what="refused step")
    skip_declared(reasons)


def skip_declared(reasons: Iterable[Reason]) -> NoReturn:
    """Skip the case with the reasons the backend declares for not serving it."""
    pytest.skip("declared unsupported: " + "; ".join(map(str, reasons)))


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, *, atol: float, rtol: float) -> None:
    """Within (atol, rtol); rows that see no key and no sink are -inf on both sides."""
    empty = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(lse), empty), "-inf (no key seen) where the oracle's is"
    assert_close_to_reference(lse[~empty], ref[~empty], atol=atol, rtol=rtol)


def without_sinks(batch: Batch) -> Batch:
    """``batch`` on its layer without sinks: what a backend that ignores them computes."""
    return dataclasses.replace(
        batch, layer=dataclasses.replace(batch.layer, has_sinks=False), sinks=None
    )


def _name(config: str | AttentionConfig) -> str:
    return config if isinstance(config, str) else config.backend

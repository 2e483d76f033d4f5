"""``BackendConformance``: the cases of every subject in one pytest class."""

from __future__ import annotations

from attnsdk.testing.conformance._graphs import GraphCases
from attnsdk.testing.conformance._lifecycle import LifecycleCases
from attnsdk.testing.conformance._lse import LseCases
from attnsdk.testing.conformance._matrix import MatrixCases
from attnsdk.testing.conformance._ragged import RaggedCases
from attnsdk.testing.conformance._steps import StepCases


# pytest collects a class's tests base by base from the far end of its MRO: the subjects are
# listed last first, so that the cases run (and run_conformance lists them) matrix first.
class BackendConformance(GraphCases, LseCases, RaggedCases, StepCases, LifecycleCases, MatrixCases):
    """The one test suite every attnsdk backend runs (needs pytest).

    A backend's test module subclasses it and names the backend and the device; pytest collects
    the subclass (its name starts with ``Test``), never this base::

        from attnsdk.testing.conformance import BackendConformance

        class TestMineConformance(BackendConformance):
            backend = "mine"          # a registered name or an AttentionConfig
            device = "cuda"

    Every case compares the backend with the ``reference`` backend (fp32 accumulation) run on a
    copy of the same cache: the output within the dtype's tolerance
    (``attnsdk.testing.tolerance``) and the whole cache after the step (bit-exact; fp8 slots the
    step writes within one fp8 step). A case the backend declares it cannot serve
    (``unsupported_reasons``) must be refused with ``UnsupportedConfigError``, writing nothing,
    and is then skipped with those reasons: the backend's own declarations are the only way to
    skip a case.

    The matrix is a covering design, not a product: every batch preset on the plain layer,
    every feature on a mixed batch, every storage order and page size on a mixed batch, each
    dtype with a few features; then ``prepare`` / ``warmup``, bad metadata, ``out=``,
    ``k = v = None``, rows past ``num_tokens`` and CUDA-graph replay against eager execution
    (with and without ``lse=``). No case relies on its seed to tell a rule apart: batches of a
    window or chunked layer also hold ``edge_rows`` (where the boundaries fall), tree batches
    two sibling drafts, ragged steps several queries over more keys and over fewer, and a scale
    other than the default has a case.

    The log-sum-exp (``lse=``, docs/kv_layout.md): on every preset and feature it matches the
    reference's and leaves the output bit for bit as without it; and attention split into a
    non-causal pass over a prefix of each sequence's pages and a causal pass over the rest,
    merged by ``attnsdk.merge_states``, equals one pass (the cascade / shared-prefix use). A
    backend whose ``lse_reasons`` refuses a case must raise ``UnsupportedConfigError`` and
    write nothing; the case is then skipped with those reasons.

    Class attributes a subclass may set: ``dtypes`` (default: fp16, bf16 and fp32; those the
    backend does not declare are checked to be refused), ``page_sizes`` (of the layout cases),
    ``page_size`` (of the others), ``seeds`` (random batches per case), ``atol`` / ``rtol``
    (override the dtype-derived tolerance), and the hooks ``tolerance``, ``lse_tolerance`` and
    ``reference_batch`` for precision choices a backend documents (fa3 multiplies fp8 KV with q
    cast to fp8).

    ``run_conformance(backend)`` runs the same cases without a pytest session and returns each
    one's outcome (``CaseResult``): for a backend built inside a test, such as the deliberately
    broken ones of tests/backends/test_conformance_mutants.py, which the suite must reject.
    """

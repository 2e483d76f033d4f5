"""``run_conformance``: the suite's cases without a pytest session, each one's ``CaseResult``."""

from __future__ import annotations

import inspect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pytest
import torch

from attnsdk.backends.base import BackendBase
from attnsdk.backends.reference import ReferenceBackend
from attnsdk.contract.backend import Backend
from attnsdk.selection.create import create_backend
from attnsdk.testing.conformance._harness import generated_axes
from attnsdk.testing.conformance._suite import BackendConformance

if TYPE_CHECKING:
    from collections.abc import Iterator

    from attnsdk.selection.config import AttentionConfig


@dataclass(frozen=True, slots=True)
class CaseResult:
    """The outcome of one conformance case, as ``run_conformance`` returns it."""

    case: str
    """The case's pytest id without the class, e.g. ``test_feature[window]``."""
    outcome: Literal["passed", "failed", "skipped"]
    message: str = ""
    """Why it failed (the exception's type and text) or was skipped; empty when it passed."""


def run_conformance(
    backend: Backend | str | AttentionConfig,
    *,
    device: str = "cpu",
    suite: type[BackendConformance] = BackendConformance,
    stop_at_first_failure: bool = False,
) -> list[CaseResult]:
    """Run every case of ``suite`` on ``backend`` without a pytest session, in pytest's order.

    For a backend a pytest class cannot name: one built inside a test (the deliberately broken
    backends of tests/backends/test_conformance_mutants.py, which the suite must reject) or in
    a script. ``backend`` is a backend instance, a registered name or an ``AttentionConfig``;
    ``suite`` is ``BackendConformance`` or a subclass whose attributes and hooks (``seeds``,
    ``dtypes``, ``tolerance``, ...) apply; its ``backend`` and ``device`` are replaced. The
    cases get the same arguments as under pytest (``subject``, ``oracle``, the parametrised
    values, ``dtype`` and ``page_size`` from the class attributes). A case is skipped when it
    calls ``pytest.skip`` (a refusal the backend declares, a CUDA-only case on a CPU) and
    fails on any exception, ``pytest.fail`` and ``pytest.raises``' included.
    ``stop_at_first_failure``: return as soon as one case fails.
    """
    dev = torch.device(device)
    subject = backend if isinstance(backend, Backend) else create_backend(backend, device=dev)
    attrs: dict[str, Any] = {"device": device}
    if isinstance(backend, Backend):
        attrs["backend"] = subject.name
        attrs["_fresh"] = lambda self, s: type(s)(s.options) if isinstance(s, BackendBase) else s
    else:
        attrs["backend"] = backend
    cls = type(f"Run{suite.__name__}", (suite,), attrs)
    oracle = ReferenceBackend()
    results = []
    fixtures = {"subject": subject, "oracle": oracle}
    for name, args, case, params in _cases(cls):
        try:
            kwargs = {a: params[a] if a in params else fixtures[a] for a in args}
        except KeyError as exc:
            raise TypeError(
                f"{case} takes the fixture {exc}, which run_conformance does not provide"
            ) from None
        try:
            getattr(cls(), name)(**kwargs)
        except pytest.skip.Exception as exc:
            results.append(CaseResult(case, "skipped", str(exc)))
        except (Exception, pytest.fail.Exception) as exc:
            results.append(CaseResult(case, "failed", f"{type(exc).__name__}: {exc}"))
            if stop_at_first_failure:
                break
        else:
            results.append(CaseResult(case, "passed"))
    return results


def _cases(
    cls: type[BackendConformance],
) -> Iterator[tuple[str, list[str], str, dict[str, Any]]]:
    """(method, argument names, pytest id, parametrised values) of every case of ``cls``, in
    the order and with the ids pytest gives them: ``pytest_generate_tests``' axes first, then
    each ``parametrize`` mark from the one nearest the function outwards, the first outermost
    (tests/backends/test_conformance_mutants.py compares them with pytest's collection)."""
    methods: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        methods.update((n, f) for n, f in vars(klass).items() if n.startswith("test_"))
    generated = generated_axes(cls)
    for name, fn in methods.items():
        args = [a for a in inspect.signature(fn).parameters if a != "self"]
        axes: list[list[tuple[str, dict[str, Any]]]] = [
            [(i, {arg: value}) for i, value in axis]
            for arg, axis in generated.items()
            if arg in args
        ]
        for mark in getattr(fn, "pytestmark", []):
            if mark.name != "parametrize":
                continue
            names, values = mark.args[0], list(mark.args[1])
            names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
            rows = [row if len(names) > 1 else (row,) for row in values]
            ids = mark.kwargs.get("ids") or [
                "-".join(_param_id(x, n, i) for x, n in zip(row, names))
                for i, row in enumerate(rows)
            ]
            axes.append([(i, dict(zip(names, row))) for i, row in zip(ids, rows)])
        for combo in itertools.product(*axes):
            case = name + ("[" + "-".join(i for i, _ in combo) + "]" if combo else "")
            yield name, args, case, {k: v for _, kw in combo for k, v in kw.items()}


def _param_id(value: Any, name: str, index: int) -> str:
    """pytest's id of one parametrised value."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return str(value)
    return f"{name}{index}"

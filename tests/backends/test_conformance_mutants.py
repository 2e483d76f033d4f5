"""Mutation test of the conformance suite: each backend here is the reference with one rule of
DESIGN §2 broken, and the suite must reject every one of them.

A suite that passes a broken backend is worse than none (issue #24: a ``forward_ragged`` that
treated prefix chunks as causal passed all cases, because no seed drew a sequence with two
queries and a key). Each mutant overrides the smallest piece of ``ReferenceBackend`` that breaks
its rule; ``run_conformance`` runs the whole suite on it and stops at the first failure.
``caught_by`` names the case family expected to fail first: a mutant caught anywhere else is
broken in more ways than it says (or crashes), which would prove nothing about the suite.
The unmutated reference passes the same run, so no mutant fails for a reason of the suite's.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest
import torch

from attnsdk.backends.reference import ReferenceBackend
from attnsdk.testing.conformance import BackendConformance, CaseResult, run_conformance

if TYPE_CHECKING:
    from attnsdk import LayerSpec
    from attnsdk.backends.base import AttendArgs, RaggedArgs


class Mutant(ReferenceBackend):
    """A reference backend with one rule broken (its docstring says which)."""

    caught_by: ClassVar[tuple[str, ...]]
    """The test methods of the suite whose cases see the broken rule."""


class LayerMutant(Mutant):
    """A mutant whose per-sequence maths (``ReferenceBackend._attend``, paged and ragged) runs
    on a changed layer: the rule it reads wrongly."""

    def changed(self, layer: LayerSpec) -> LayerSpec:
        raise NotImplementedError

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                *rest: Any) -> None:  # fmt: skip
        super()._attend(q, k, v, self.changed(layer), *rest)


class WindowOneTooWide(LayerMutant):
    """Sliding window W read as FA's left window (W keys back: one key too many)."""

    name = "mutant-window-plus-one"
    caught_by = ("test_feature",)

    def changed(self, layer: LayerSpec) -> LayerSpec:
        w = layer.sliding_window
        return layer if w is None else dataclasses.replace(layer, sliding_window=w + 1)


class WindowOneTooNarrow(LayerMutant):
    """Sliding window W read as SGLang's W - 1 (one key too few)."""

    name = "mutant-window-minus-one"
    caught_by = ("test_feature",)

    def changed(self, layer: LayerSpec) -> LayerSpec:
        w = layer.sliding_window
        return layer if w is None or w == 1 else dataclasses.replace(layer, sliding_window=w - 1)


class ChunksIgnored(LayerMutant):
    """``attention_chunk_size`` ignored: every query sees keys in earlier chunks."""

    name = "mutant-chunks-ignored"
    caught_by = ("test_feature",)

    def changed(self, layer: LayerSpec) -> LayerSpec:
        return dataclasses.replace(layer, attention_chunk_size=None)


class SoftcapIgnored(LayerMutant):
    """``softcap`` ignored: scores are not squashed by c * tanh(s / c)."""

    name = "mutant-softcap-ignored"
    caught_by = ("test_feature",)

    def changed(self, layer: LayerSpec) -> LayerSpec:
        return dataclasses.replace(layer, softcap=None)


class ScaleIgnored(LayerMutant):
    """``LayerSpec.scale`` ignored: scores scaled by the default head_dim ** -0.5."""

    name = "mutant-scale-ignored"
    caught_by = ("test_feature",)

    def changed(self, layer: LayerSpec) -> LayerSpec:
        return dataclasses.replace(layer, scale=None)


class NoncausalAsCausal(LayerMutant):
    """A non-causal layer run causally."""

    name = "mutant-noncausal-causal"
    caught_by = ("test_feature",)

    def changed(self, layer: LayerSpec) -> LayerSpec:
        return dataclasses.replace(layer, causal=True)


class LseBase2(Mutant):
    """``lse=`` in base 2 (what kernels that softmax with exp2 hold) instead of natural log."""

    name = "mutant-lse-base-2"
    caught_by = ("test_tree_verify", "test_cross_attention", "test_mla", "test_ragged", "test_lse")

    def _attend(self, *args: Any) -> None:
        super()._attend(*args)
        lse = args[6]  # (q, k, v, layer, sinks, out, lse, tree)
        if lse is not None:
            lse.div_(math.log(2))


class TreeIgnored(Mutant):
    """The tree mask ignored: draft tokens attend as a causal chain (siblings see each other)."""

    name = "mutant-tree-ignored"
    caught_by = ("test_tree_verify",)

    def _attend(self, *args: Any) -> None:
        super()._attend(*args[:7], None)  # (q, k, v, layer, sinks, out, lse) and no tree


class CrossAsCausal(Mutant):
    """A paged cross-attention step run causally (bottom-right) instead of every query seeing
    every key of the encoder."""

    name = "mutant-cross-causal"
    caught_by = ("test_cross_attention",)

    def attend(self, call: AttendArgs) -> torch.Tensor:
        if call.plan.metadata.cross_attention:
            call = dataclasses.replace(call, layer=dataclasses.replace(call.layer, causal=True))
        return super().attend(call)


class RaggedCrossAsCausal(Mutant):
    """A ragged prefix chunk (``for_ragged(..., cross_attention=True)``) run causally: the
    bug of issue #24."""

    name = "mutant-ragged-cross-causal"
    caught_by = ("test_ragged",)

    def attend_ragged(self, call: RaggedArgs) -> torch.Tensor:
        if call.plan.metadata.cross_attention:
            call = dataclasses.replace(call, layer=dataclasses.replace(call.layer, causal=True))
        return super().attend_ragged(call)


class MlaValueFromTheTail(Mutant):
    """MLA's V read from the last Dv dims of the latent row (rope part included) instead of
    the first ``kv_lora_rank``."""

    name = "mutant-mla-wrong-v"
    caught_by = ("test_tree_verify", "test_mla")

    def attend(self, call: AttendArgs) -> torch.Tensor:
        cache = call.cache
        if cache.layout.mla:
            cache = dataclasses.replace(cache, v=cache.k[..., -call.layer.v_dim :])
        return super().attend(dataclasses.replace(call, cache=cache))


class SinksTwice(Mutant):
    """Each sink counted twice in the softmax denominator (exp(s) + exp(s) = exp(s + ln 2))."""

    name = "mutant-sinks-twice"
    caught_by = ("test_feature",)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                sinks: torch.Tensor | None, *rest: Any) -> None:  # fmt: skip
        super()._attend(q, k, v, layer, None if sinks is None else sinks + math.log(2), *rest)


class OutIgnored(Mutant):
    """``out=`` ignored by ``forward``: the result goes to a fresh tensor, ``out`` untouched."""

    name = "mutant-out-ignored"
    caught_by = ("test_out_is_honoured",)

    def attend(self, call: AttendArgs) -> torch.Tensor:
        return super().attend(dataclasses.replace(call, out=torch.empty_like(call.out)))


class RaggedOutIgnored(Mutant):
    """``out=`` ignored by ``forward_ragged``: the result goes to a fresh tensor."""

    name = "mutant-ragged-out-ignored"
    caught_by = ("test_ragged",)

    def attend_ragged(self, call: RaggedArgs) -> torch.Tensor:
        return super().attend_ragged(dataclasses.replace(call, out=torch.empty_like(call.out)))


class GqaHeadsModulo(Mutant):
    """GQA heads mapped round-robin (query head h reads KV head h % Hkv) instead of in groups
    (h // (Hq / Hkv)): the two agree only for MHA and MQA."""

    name = "mutant-gqa-modulo"
    caught_by = ("test_feature",)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                sinks: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
                tree: torch.Tensor | None) -> None:  # fmt: skip
        g, hkv = layer.group_size, layer.num_kv_heads

        # The reference groups head h with KV head h // g; reorder the heads so that it pairs
        # head h with KV head h % hkv, then put the results back in head order.
        def grouped(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(1, (g, hkv)).transpose(1, 2).flatten(1, 2)

        def ungrouped(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(1, (hkv, g)).transpose(1, 2).flatten(1, 2)

        o = torch.empty_like(out)
        s = None if sinks is None else grouped(sinks[None])[0]
        rows_lse = None if lse is None else torch.empty_like(lse)
        super()._attend(grouped(q), k, v, layer, s, o, rows_lse, tree)
        out.copy_(ungrouped(o))
        if lse is not None and rows_lse is not None:
            lse.copy_(ungrouped(rows_lse))


class LseWithoutSinks(Mutant):
    """The sinks left out of ``lse=`` (the output still counts them)."""

    name = "mutant-lse-without-sinks"
    caught_by = ("test_tree_verify", "test_ragged", "test_lse")

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: LayerSpec,
                sinks: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor | None,
                tree: torch.Tensor | None) -> None:  # fmt: skip
        super()._attend(q, k, v, layer, sinks, out, None, tree)
        if lse is not None:
            super()._attend(q, k, v, layer, None, torch.empty_like(out), lse, tree)


class KeylessRowsUntouched(Mutant):
    """A cross-attention sequence without keys left as ``out`` was (zeros expected)."""

    name = "mutant-keyless-rows-untouched"
    caught_by = ("test_cross_attention",)

    def attend(self, call: AttendArgs) -> torch.Tensor:
        before, plan = call.out.clone(), call.plan
        result = super().attend(call)
        qsl = plan.metadata.query_start_loc_cpu.tolist()
        for b, seq_len in enumerate(plan.metadata.seq_lens_cpu.tolist()):
            if seq_len == 0:
                result[qsl[b] : qsl[b + 1]] = before[qsl[b] : qsl[b + 1]]
        return result


class OneSeed(BackendConformance):
    """The suite with one random batch per case: the rows that tell each rule apart are in
    every batch by construction, so the first batch must already catch every mutant (three
    seeds would hide a case that needs luck; one also keeps this test quick)."""

    seeds = 1


MUTANTS: list[type[Mutant]] = [
    LseBase2,
    WindowOneTooWide,
    WindowOneTooNarrow,
    ChunksIgnored,
    TreeIgnored,
    CrossAsCausal,
    RaggedCrossAsCausal,
    MlaValueFromTheTail,
    SinksTwice,
    OutIgnored,
    RaggedOutIgnored,
    SoftcapIgnored,
    ScaleIgnored,
    GqaHeadsModulo,
    NoncausalAsCausal,
    LseWithoutSinks,
    KeylessRowsUntouched,
]


def test_mutant_names_are_unique() -> None:
    names = [m.name for m in MUTANTS]
    assert len(set(names)) == len(names), names
    assert ReferenceBackend.name not in names


@pytest.fixture(scope="module")
def reference_run() -> list[CaseResult]:
    return run_conformance(ReferenceBackend(), suite=OneSeed)


def test_the_reference_passes_the_suite(reference_run: list[CaseResult]) -> None:
    """The control: the same run passes the unmutated reference, skipping only what needs a
    CUDA device, so a mutant's failure is the mutation's."""
    failed = [f"{r.case}: {r.message}" for r in reference_run if r.outcome == "failed"]
    assert not failed, "\n".join(failed)
    skipped = {r.case.split("[")[0] for r in reference_run if r.outcome == "skipped"}
    assert skipped <= {"test_graph_replay_equals_eager"}, skipped


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_the_suite_rejects(mutant: type[Mutant]) -> None:
    results = run_conformance(mutant(), suite=OneSeed, stop_at_first_failure=True)
    failed = [r for r in results if r.outcome == "failed"]
    assert failed, f"the suite passed {mutant.name} ({mutant.__doc__}) in {len(results)} cases"
    (first,) = failed
    # A mismatch, not a crash of the mutant, in a case that exercises the broken rule.
    assert first.message.startswith(("AssertionError", "Failed")), first.message
    assert first.case.split("[")[0] in mutant.caught_by, f"{first.case}: {first.message}"


def test_run_conformance_runs_what_pytest_collects(reference_run: list[CaseResult]) -> None:
    """``run_conformance`` expands the cases itself: it must find every case pytest collects,
    with the same ids, or a mutant could slip through a case it never ran."""
    module = Path(__file__).with_name("test_conformance_reference.py")
    listing = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(module)],
        capture_output=True, text=True, check=True, cwd=module.parents[2],
    ).stdout  # fmt: skip
    collected = [line.rsplit("::", 1)[1] for line in listing.splitlines() if "::" in line]
    assert collected, listing
    assert [r.case for r in reference_run] == collected

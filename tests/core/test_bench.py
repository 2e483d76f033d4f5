"""The pure parts of ``attnsdk bench`` (attnsdk/_bench*.py): cases, floors, the table, the raw
kernels' page lists, row fields, backend selection; and that benchmarks/ uses no SDK internals.
The command itself is tested in test_cli.py; the GPU paths run in benchmarks/run_gpu.sh."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import attnsdk as A
from attnsdk._bench.common import (
    LAYER,
    Case,
    Ceilings,
    Column,
    cases_for,
    dumps,
    format_table,
    rotation,
)
from attnsdk._bench.raw import _csr, write_kv
from attnsdk._bench.suite import MAX_KV_BYTES, _finish, make_inputs
from attnsdk._cli.bench import parse_names, select_backends
from attnsdk.contract.capabilities import GraphSupport
from attnsdk.contract.errors import UnsupportedConfigError

ROOT = Path(__file__).resolve().parents[2]
H200 = Ceilings(copy_gbs=4250.0, matmul_tflops=790.0, matmul_dtype="bfloat16")
"""DESIGN §7's H200 numbers."""


def test_cases_and_their_names() -> None:
    assert Case.decode(64, 4096) == Case("decode", "64x4k", (1,) * 64, (4096,) * 64)
    assert Case.prefill([4096] * 4).name == "prefill 4x4k"
    assert Case.prefill([512] * 8, cached=2048).seq_lens == (2560,) * 8
    assert Case.prefill([512] * 8, cached=2048).name == "extend 8x512 on 2k"
    mixed = Case.mixed(63, 4096, 2048, 2048)
    assert mixed.name == "63x4k decode + 2k chunk on 2k"
    assert (mixed.num_seqs, mixed.num_tokens, mixed.max_query_len) == (64, 63 + 2048, 2048)
    assert mixed.seq_lens == (4096,) * 64


def test_graph_level_a_case_needs() -> None:
    assert Case.decode(8, 1024).graph_level is GraphSupport.DECODE_ONLY
    assert Case.prefill([1024] * 4).graph_level is GraphSupport.UNIFORM_BATCH
    assert Case.mixed(3, 256, 64, 0).graph_level is GraphSupport.ANY_BATCH


def test_flops_and_bytes_match_the_single_backend_benches() -> None:
    """The formulas bench_prefill.py and bench_decode.py used, so old and new rows compare."""
    hq, hkv, d = 32, 8, 128
    for q_lens, ctx in (([1024], 0), ([4096] * 4, 0), ([1024] * 4, 8192), ([512] * 8, 2048)):
        visible = sum(n * ctx + n * (n + 1) // 2 for n in q_lens)
        assert Case.prefill(q_lens, cached=ctx).flops() == 4.0 * hq * d * visible
    for bs, ctx in ((1, 1024), (256, 32768)):
        assert Case.decode(bs, ctx).kv_bytes() == bs * ctx * hkv * d * 2 * 2


def test_floors() -> None:
    # DESIGN §7: decode at bs 64 x 4k reads 1 GiB of KV: ~253 µs at 4.25 TB/s.
    floor, bound = H200.floor_us(Case.decode(64, 4096).kv_bytes(), Case.decode(64, 4096).flops())
    assert bound == "memory"
    assert floor == pytest.approx(2**30 / 4.25e12 * 1e6)
    prefill = Case.prefill([8192])
    floor, bound = H200.floor_us(prefill.kv_bytes(), prefill.flops())
    assert bound == "compute"
    assert floor == pytest.approx(prefill.flops() / 790e12 * 1e6)
    mixed = Case.mixed(63, 4096, 2048, 2048)
    floor, _ = H200.floor_us(mixed.kv_bytes(), mixed.flops())
    assert floor == max(mixed.kv_bytes() / 4.25e6, mixed.flops() / 790e6)


def test_the_gpu_grid_is_the_one_asked_for() -> None:
    decode = cases_for("decode", "cuda", quick=False)
    assert {(c.num_seqs, c.seq_lens[0]) for c in decode} == {
        (b, k) for b in (1, 8, 64, 256) for k in (1024, 4096, 16384, 32768)
    }
    # none is skipped for size on a 141 GB card: the largest holds 32 GiB of KV
    assert max(c.kv_bytes() * rotation(c) for c in decode) <= MAX_KV_BYTES
    prefill = {c.name for c in cases_for("prefill", "cuda", quick=False)}
    assert {"prefill 1x1k", "prefill 1x4k", "prefill 1x8k"} <= prefill
    # the cases of the single-backend prefill bench, so old and new rows line up
    assert {"prefill 1x16k", "prefill 4x4k", "extend 4x1k on 8k", "extend 8x512 on 2k"} <= prefill
    assert "63x4k decode + 2k chunk on 2k" in {c.name for c in cases_for("mixed", "cuda", False)}
    for suite in ("decode", "prefill", "mixed"):
        assert cases_for(suite, "cpu", quick=False) == cases_for(suite, "cpu", quick=True)


def test_rotation_keeps_small_decode_caches_out_of_l2() -> None:
    assert rotation(Case.decode(1, 1024)) == 32
    assert rotation(Case.decode(8, 4096)) == 2  # 8 x 4k = 128 MiB per layer
    assert rotation(Case.decode(64, 4096)) == 1
    assert rotation(Case.mixed(63, 4096, 2048, 2048)) == 1


def test_table_formatting() -> None:
    rows: list[dict[str, Any]] = [
        {"case": "1x1k", "backend": "fa3", "sdk_fwd_eager_us": 12.345, "frac_of_floor": 0.5},
        {"case": "256x32k", "backend": "flex", "sdk_fwd_eager_us": 9655.66, "max_abs_err": 0.0},
    ]
    columns = [
        Column("case", "case"),
        Column("backend", "backend"),
        Column("sdk_fwd_eager_us", "SDK us", "us"),
        Column("frac_of_floor", "of floor", "percent"),
        Column("max_abs_err", "err", "error"),
    ]
    assert format_table(rows, columns).splitlines() == [
        "case     backend  SDK us  of floor      err",
        "1x1k     fa3        12.3     50.0%        -",
        "256x32k  flex     9655.7         -  0.0e+00",
    ]
    assert Column("r", "r", "ratio").cell(1.0) == "1.000"


def test_json_has_no_nan() -> None:
    text = dumps({"a": math.nan, "b": [math.inf, 1.5], "c": {"d": None}})
    assert '"a": null' in text
    assert "NaN" not in text
    assert "Infinity" not in text


def test_legacy_fields_keep_their_meaning() -> None:
    """decode.json and prefill.json rows still carry the fields the old scripts wrote."""
    case = Case.decode(64, 4096)
    row: dict[str, Any] = {"kv_bytes": case.kv_bytes(), "flops": case.flops()}
    row.update(sdk_fwd_eager_us=300.0, sdk_step_eager_us=310.0, raw_eager_us=320.0)
    row.update(sdk_graph_us=280.0, raw_graph_us=290.0)
    _finish(row, case, H200)
    assert row["sdk_eager_us"] == 310.0  # one plan() per step included, as before
    assert row["eager_ratio"] == 310.0 / 320.0
    assert row["fwd_eager_ratio"] == 300.0 / 320.0
    assert row["graph_ratio"] == 280.0 / 290.0
    assert row["kv_gbs"] == pytest.approx(case.kv_bytes() / 280.0 / 1e3)  # over graph replay
    assert row["kv_frac_of_copy"] == pytest.approx(row["kv_gbs"] / 4250.0)
    assert row["frac_of_floor"] == pytest.approx(row["floor_us"] / 280.0)
    assert (row["bound"], row["floor_basis"]) == ("memory", "graph")

    case = Case.prefill([4096])
    row = {"kv_bytes": case.kv_bytes(), "flops": case.flops()}
    row.update(sdk_fwd_eager_us=400.0, sdk_step_eager_us=410.0, raw_eager_us=450.0)
    _finish(row, case, H200)
    assert (row["sdk_us"], row["raw_us"]) == (410.0, 450.0)
    assert row["sdk_tflops"] == pytest.approx(case.flops() / 410.0 / 1e6)
    assert row["ratio"] == pytest.approx(450.0 / 410.0)  # TFLOP/s ratio: higher is better
    assert row["frac_of_matmul"] == pytest.approx(row["sdk_tflops"] / 790.0)
    assert (row["graph_ratio"], row["floor_basis"]) == (None, "eager")
    assert row["frac_of_floor"] == pytest.approx(row["floor_us"] / 400.0)


def test_flashinfer_page_lists() -> None:
    """The CSR form the raw FlashInfer wrappers are planned with, checked on a CPU."""
    case = Case("mixed", "m", (1, 3), (17, 3))
    inputs = make_inputs(case, LAYER, "cpu")
    meta = inputs.meta
    csr = _csr(meta, 16)
    assert csr["kv_indptr"].tolist() == [0, 2, 3]
    assert csr["last_page_len"].tolist() == [1, 3]
    assert csr["qo_indptr"].tolist() == [0, 1, 4]
    assert csr["indices"].tolist() == [*meta.page_table[0, :2].tolist(), meta.page_table[1, 0]]
    # pages are shuffled, each used once, page 0 never
    assert sorted(csr["indices"].tolist()) == [1, 2, 3]


def test_the_raw_kv_write_matches_the_sdk_store() -> None:
    case = Case.mixed(2, 40, 5, 3)
    inputs = make_inputs(case, LAYER, "cpu")
    mine = inputs.caches[0]
    theirs = A.KVCache(mine.layout, mine.k.clone(), mine.v.clone())
    write_kv(mine, inputs.meta, inputs.k, inputs.v)
    sdk = A.create_backend("reference")
    sdk.forward(inputs.q, inputs.k, inputs.v, theirs, sdk.plan(inputs.meta), LAYER)
    assert torch.equal(mine.k, theirs.k)
    assert torch.equal(mine.v, theirs.v)


def test_names_and_backend_selection() -> None:
    assert parse_names(["flex, FA3", "fa3", ""], ["fa3", "flex"], "--backend") == ["flex", "fa3"]
    assert parse_names(None, ["fa3"], "--backend") == []
    with pytest.raises(UnsupportedConfigError, match=r"known: fa3, flex\. Did you mean 'flex'\?"):
        parse_names(["flx"], ["fa3", "flex"], "--backend")
    run, skipped = select_backends([], "cpu")
    assert "reference" in run
    assert "routed" not in run  # composites only by name
    assert "routed" not in skipped
    assert "fa3" in skipped
    assert skipped["fa3"][0].startswith("environment: device must be one of ['cuda']")
    run, skipped = select_backends(["reference", "fa3"], "cpu")
    assert (run, list(skipped)) == (["reference"], ["fa3"])


ALLOWED = {"attnsdk", "attnsdk._bench.common", "attnsdk._cli.main", "attnsdk._cli.bench"}
"""What benchmarks/ may import from attnsdk: the public API, public backend modules, and the
bench machinery it wraps (which lives in the package so that ``attnsdk bench`` works from a
wheel)."""


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_benchmark_scripts_use_no_sdk_internals(path: Path) -> None:
    tree = ast.parse(path.read_text(), str(path))
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    private = {
        m
        for m in modules
        if m.startswith("attnsdk")
        and m not in ALLOWED
        and any(part.startswith("_") for part in m.split("."))
    }
    assert private == set()
    assert "sys.path" not in path.read_text()


def test_tree_benchmark_runs_on_cpu_and_checks_its_output(tmp_path: Path) -> None:
    """benchmarks/bench_tree.py on the CPU backends: a row per backend and case, the tree's
    output checked against the reference, JSON and PNG written."""
    import json

    from benchmarks import bench_tree

    bench_tree.main(["--quick", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "tree.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["reference", "flex"]
    for row in rows:
        assert row["max_abs_err"] < 1e-4
        assert row["tree_us"] > 0
        assert row["chain_us"] > 0
        assert row["tree_over_chain"] == row["tree_us"] / row["chain_us"]
    assert (tmp_path / "tree.png").stat().st_size > 0


def test_write_results_writes_json_and_plot(tmp_path: Path) -> None:
    """The benchmark scripts' common output: valid JSON (NaN as null) with the run's config,
    and the plot drawn beside it from the same rows."""
    import json

    from attnsdk._bench.common import write_results

    drawn: list[Path] = []
    rows = [{"us": 1.5, "ratio": float("nan")}]
    write_results(tmp_path / "x", "demo", rows, lambda r, p: drawn.append(p), device="cpu", k=3)
    data = json.loads((tmp_path / "x" / "demo.json").read_text())
    assert data["rows"] == [{"us": 1.5, "ratio": None}]
    assert data["config"]["device"] == "cpu"
    assert data["config"]["k"] == 3
    assert drawn == [tmp_path / "x" / "demo.png"]

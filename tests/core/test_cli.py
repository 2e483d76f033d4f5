"""The ``attnsdk`` command: ``--version``, ``info``, ``explain`` and ``demo``, their exit codes,
their JSON and their help. The main paths run as a subprocess, as a user runs them; the error
matrix runs in-process through ``main``."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import attnsdk as A
from attnsdk._cli.main import build_parser, main
from attnsdk.backends.reference import ReferenceBackend

ROOT = Path(__file__).resolve().parents[2]
CPU = ("--device", "cpu")  # the same answer on every machine: fa3 never runs on a CPU
SHAPE = ("--heads", "32", "--kv-heads", "8", "--head-dim", "128")


def run_cli(*args: str, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSDK_")}
    return subprocess.run(
        [sys.executable, "-m", "attnsdk", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**clean, **env},
        cwd=cwd,
        check=False,
    )


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``main(args)`` in-process, from an empty folder with no ATTNSDK_* variables:
    returns (exit code, stdout, stderr); argparse's exits become exit codes."""
    monkeypatch.delenv("ATTNSDK_BACKEND", raising=False)
    monkeypatch.delenv("ATTNSDK_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)

    def call(*args: str) -> tuple[int, str, str]:
        try:
            code = main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 2
        out, err = capsys.readouterr()
        return code, out, err

    return call


# --- --version and help ------------------------------------------------------------------------


def test_version() -> None:
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"attnsdk {A.__version__}\n"


def test_the_attnsdk_script_is_the_same_command() -> None:
    script = Path(sys.executable).with_name("attnsdk")
    if not script.exists():
        pytest.skip(f"no attnsdk script next to {sys.executable} (not pip-installed)")
    proc = subprocess.run(
        [str(script), "--version"], capture_output=True, text=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"attnsdk {A.__version__}\n"


@pytest.mark.parametrize("command", [[], ["info"], ["explain"], ["demo"], ["bench"]])
def test_help_is_plain_text(cli: Any, command: list[str]) -> None:
    code, out, _ = cli(*command, "--help")
    assert code == 0
    assert out.startswith("usage: attnsdk")
    assert "``" not in out  # argparse prints help strings as they are: no reST markup
    assert not re.search(r":(class|func|meth):", out)


def test_a_command_is_required(cli: Any) -> None:
    code, _, err = cli()
    assert code == 2
    assert "info" in err


# --- info --------------------------------------------------------------------------------------

INFO_KEYS = {"attnsdk", "python", "torch", "device", "config", "backends", "fa3_kernel", "engines"}
CONFIG_KEYS = {"backend", "options", "debug", "source", "selected", "error"}


def test_info() -> None:
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"attnsdk  {A.__version__}"
    assert lines[1].split() == ["python", sys.version.split()[0]]
    assert lines[2] == f"torch    {torch.__version__}"
    assert lines[3].startswith("device   ")
    assert lines[4].startswith("config   auto, from default")
    first = next(i for i, line in enumerate(lines) if line.startswith("backends on "))
    engines = lines.index("engine adapters (tested releases; make test-engines):")
    kernel = next(line for line in lines if line.startswith("fa3 kernel  "))
    assert lines.index(kernel) == engines - 1
    assert lines[engines + 1].split()[:4] == ["sglang", "0.5.12.post1", "..", "0.5.23,"]
    assert lines[engines + 2].split()[:4] == ["vllm", "0.33.0", "..", "0.34.0,"]
    status: dict[str, str] = {}
    reasons: dict[str, list[str]] = {}
    name = ""
    for line in lines[first + 1 : engines - 1]:
        if line.startswith("      - "):  # a reason of the backend above
            reasons[name].append(line.strip()[2:])
        else:
            name, status[name] = line.split()
            reasons[name] = []
    assert list(status) == A.backend_names()
    assert status["reference"] == "available"
    for name, state in status.items():
        assert state in ("available", "unavailable"), name
        assert bool(reasons[name]) == (state == "unavailable"), name  # unavailable says why


def test_info_json() -> None:
    proc = run_cli("info", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == INFO_KEYS
    assert report["attnsdk"] == A.__version__
    assert report["torch"] == torch.__version__
    assert set(report["device"]) == {"type", "name", "compute_capability"}
    config = report["config"]
    assert set(config) == CONFIG_KEYS
    assert config["backend"] == "auto"
    assert config["options"] == {"candidates": None}
    assert config["source"]["kind"] == "default"
    assert config["error"] is None
    backends = report["backends"]
    assert [b["name"] for b in backends] == A.backend_names()
    for b in backends:
        assert set(b) == {"name", "available", "reasons"}
        assert b["available"] == (not b["reasons"])
        for r in b["reasons"]:
            assert set(r) == {"kind", "field", "message"}
            assert r["kind"] in ("environment", "configuration", "batch")
    available = [b["name"] for b in backends if b["available"]]
    assert config["selected"] == available[0]  # auto: the highest priority that can run
    assert set(report["fa3_kernel"]) == {"requested", "provider", "module", "installed"}
    assert set(report["fa3_kernel"]["installed"]) == {"flash_attn_interface", "sgl_kernel", "vllm"}
    assert [e["package"] for e in report["engines"]] == ["sglang", "vllm"]
    assert set(report["engines"][0]) == {"package", "tested", "installed"}


def test_info_shows_the_config_in_effect_and_its_source(cli: Any, tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.attnsdk]\nbackend = "Reference"\n')
    code, out, _ = cli("info", "--json")
    config = json.loads(out)["config"]
    assert code == 0
    assert config["backend"] == "reference"
    assert config["source"] == {
        "kind": "pyproject",
        "value": str(tmp_path / "pyproject.toml"),
        "text": f"[tool.attnsdk] in {tmp_path / 'pyproject.toml'}",
    }
    assert config["selected"] == "reference"
    assert config["options"] == {"max_scores": 1 << 25}


def test_info_with_the_backend_variable(cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNSDK_BACKEND", "REFERENCE")
    code, out, _ = cli("info")
    assert code == 0
    assert "config   reference, from ATTNSDK_BACKEND=REFERENCE" in out
    assert "selects reference on " in out


def test_info_reports_a_broken_config_with_everything_else(
    cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ATTNSDK_BACKEND", "refrence")
    code, out, _ = cli("info", "--json")
    assert code == 1
    report = json.loads(out)
    assert report["config"]["backend"] is None
    assert report["config"]["error"].startswith("ATTNSDK_BACKEND='refrence': unknown attention")
    assert "Did you mean 'reference'?" in report["config"]["error"]
    assert [b["name"] for b in report["backends"]] == A.backend_names()
    code, out, _ = cli("info")
    assert code == 1
    assert "config   error: ATTNSDK_BACKEND='refrence'" in out


def test_info_exit_code_when_the_configured_backend_cannot_run(
    cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Never(ReferenceBackend):
        @classmethod
        def environment_reasons(cls, device: Any = None) -> list[A.Reason]:
            return [A.Reason(A.ReasonKind.ENVIRONMENT, "device", "never runs")]

    unrunnable = A.register_backend("never", Never, priority=-1)
    try:
        monkeypatch.setenv("ATTNSDK_BACKEND", "Never")
        code, out, _ = cli("info", "--json")
    finally:
        unrunnable.remove()
    assert code == 1
    config = json.loads(out)["config"]
    assert (config["backend"], config["selected"]) == ("never", None)


FAKE_KERNEL = "raise RuntimeError('attnsdk info imported a kernel library')\n"


def test_info_finds_the_fa3_kernel_without_importing_it(tmp_path: Path) -> None:
    """Stand-in kernel packages that fail on import: info finds them by path only."""
    (tmp_path / "flash_attn_interface.py").write_text(FAKE_KERNEL)
    (tmp_path / "sgl_kernel").mkdir()
    (tmp_path / "sgl_kernel" / "__init__.py").write_text(FAKE_KERNEL)
    (tmp_path / "sgl_kernel" / "flash_attn.py").write_text(FAKE_KERNEL)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    proc = run_cli("info", "--json", PYTHONPATH=path)
    assert proc.returncode == 0, proc.stderr
    kernel = json.loads(proc.stdout)["fa3_kernel"]
    assert kernel == {
        "requested": "auto",
        "provider": "flash_attn_interface",
        "module": "flash_attn_interface",
        "installed": {"flash_attn_interface": True, "sgl_kernel": True, "vllm": False},
    }
    config = tmp_path / "attn.json"
    config.write_text(json.dumps({"backend": "fa3", "provider": "sgl_kernel"}))
    proc = run_cli("info", PYTHONPATH=path, ATTNSDK_CONFIG=str(config))
    assert "fa3 kernel  sgl_kernel.flash_attn (provider sgl_kernel;" in proc.stdout, proc.stderr


# --- explain -----------------------------------------------------------------------------------

EXPLAIN_KEYS = {"config", "device", "layer", "layout", "backends", "chosen", "ok"}


def test_explain() -> None:
    proc = run_cli("explain", *SHAPE, "--window", "4096", *CPU)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "layer    Hq=32 Hkv=8 D=128 Dv=128, causal, window 4096" in out
    assert "layout   page_size 16, dtype bfloat16" in out
    assert "device   cpu" in out
    assert "  reference    can serve" in out
    assert "  fa3          cannot serve" in out
    assert "      - environment: device must be one of ['cuda'], found 'cpu'" in out
    assert out.rstrip().endswith("result   auto picks reference, which can serve this layer")


def test_explain_a_chunked_layer(cli: Any) -> None:
    code, out, _ = cli("explain", *SHAPE, "--chunk", "8192", "--backend", "reference", *CPU)
    assert code == 0
    assert "sinks off, chunks 8192" in out


def test_explain_json() -> None:
    proc = run_cli("explain", *SHAPE, "--dtype", "fp16", "--kv-dtype", "fp8", "--json", *CPU)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) == EXPLAIN_KEYS
    assert set(report["config"]) == {"backend", "options", "debug", "source"}
    assert report["device"] == "cpu"
    assert report["layer"] == {
        "num_heads": 32,
        "num_kv_heads": 8,
        "head_dim": 128,
        "v_head_dim": None,
        "scale": None,
        "causal": True,
        "sliding_window": None,
        "softcap": None,
        "has_sinks": False,
        "attention_chunk_size": None,
        "mla": False,
    }
    assert report["layout"] == {
        "num_kv_heads": 8,
        "head_dim": 128,
        "page_size": 16,
        "dtype": "float16",
        "v_head_dim": None,
        "order": "NHD",
        "kv_dtype": "float8_e4m3fn",
        "mla": False,
    }
    # What "auto" may pick: composites ("routed", negative priority) are asked for by name.
    assert [b["name"] for b in report["backends"]] == [
        n for n in A.backend_names() if n != "routed"
    ]
    assert (report["chosen"], report["ok"]) == ("reference", True)


def test_explain_an_explicit_backend_that_cannot_run_exits_1() -> None:
    proc = run_cli("explain", *SHAPE, "--backend", "FA3", "--json", *CPU)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["config"]["backend"] == "fa3"
    assert report["config"]["source"]["kind"] == "--backend"
    assert [b["name"] for b in report["backends"]] == ["fa3"]
    assert (report["chosen"], report["ok"]) == (None, False)


def test_explain_a_shape_auto_picks_but_cannot_serve(cli: Any) -> None:
    code, out, _ = cli("explain", "--heads", "8", "--head-dim", "2048", *CPU)
    assert code == 1
    assert "  reference    cannot serve" in out
    assert "      - configuration: head_dim must be <= 1024" in out
    assert "result   auto picks reference, which cannot serve this layer" in out


def test_explain_every_shape_flag(cli: Any) -> None:
    args = ["--heads", "8", "--kv-heads", "1", "--head-dim", "64", "--v-head-dim", "32"]
    args += ["--window", "128", "--softcap", "30", "--sinks", "--non-causal", "--page-size", "32"]
    args += ["--chunk", "256"]
    args += ["--dtype", "torch.float32", "--order", "HND", "--backend", "reference", "--json"]
    code, out, _ = cli("explain", *args, *CPU)
    assert code == 0
    report = json.loads(out)
    assert report["layer"] == {
        "num_heads": 8,
        "num_kv_heads": 1,
        "head_dim": 64,
        "v_head_dim": 32,
        "scale": None,
        "causal": False,
        "sliding_window": 128,
        "softcap": 30.0,
        "has_sinks": True,
        "attention_chunk_size": 256,
        "mla": False,
    }
    assert (report["layout"]["page_size"], report["layout"]["dtype"]) == (32, "float32")
    assert report["layout"]["order"] == "HND"


LAYER_FILES = {
    "layer.json": json.dumps(
        {
            "num_heads": 16,
            "num_kv_heads": 4,
            "head_dim": 128,
            "sliding_window": 512,
            "page_size": 64,
            "dtype": "bf16",
        }
    ),
    "layer.toml": (
        "num_heads = 16\nnum_kv_heads = 4\nhead_dim = 128\nsliding_window = 512\n"
        'page_size = 64\ndtype = "bfloat16"\n'
    ),
}


@pytest.mark.parametrize("name", sorted(LAYER_FILES))
def test_explain_a_layer_file(cli: Any, tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(LAYER_FILES[name])
    code, out, _ = cli("explain", "--layer", str(path), "--backend", "reference", "--json", *CPU)
    assert code == 0
    report = json.loads(out)
    assert report["layer"]["num_heads"] == 16
    assert report["layer"]["sliding_window"] == 512
    assert (report["layout"]["page_size"], report["layout"]["dtype"]) == (64, "bfloat16")
    # flags override the file
    code, out, _ = cli("explain", "--layer", str(path), "--head-dim", "2048", "--json", *CPU)
    assert code == 1
    assert json.loads(out)["layer"]["head_dim"] == 2048


def test_explain_config_file_and_environment(
    cli: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "attn.json"
    path.write_text(json.dumps({"attnsdk": {"backend": "Reference", "max_scores": 64}}))
    code, out, _ = cli("explain", *SHAPE, "--config", str(path), "--json", *CPU)
    config = json.loads(out)["config"]
    assert code == 0
    assert config["backend"] == "reference"
    assert config["options"] == {"max_scores": 64}
    assert config["source"] == {"kind": "--config", "value": str(path), "text": f"--config {path}"}
    monkeypatch.setenv("ATTNSDK_BACKEND", "reference")
    code, out, _ = cli("explain", *SHAPE, *CPU)
    assert code == 0
    assert out.startswith("config   reference, from ATTNSDK_BACKEND=reference\n")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--head-dim", "128"], "num_heads: expected --heads"),
        (["--heads", "8"], "head_dim: expected --head-dim"),
        ([*SHAPE, "--dtype", "bf17"], "unknown dtype 'bf17'"),
        ([*SHAPE, "--heads", "x"], "argument --heads: invalid int value"),
        ([*SHAPE, "--order", "NDH"], "argument --order: invalid choice"),
        ([*SHAPE, "--backend", "a", "--config", "b"], "not allowed with argument"),
        ([*SHAPE, "--backend", "refrence"], "Did you mean 'reference'?"),
        ([*SHAPE, "--config", "missing.toml"], "attention config file 'missing.toml' does not"),
        (["--heads", "7", "--kv-heads", "2", "--head-dim", "64"], "LayerSpec.num_heads"),
        ([*SHAPE, "--device", "tpu"], "device"),
        ([*SHAPE, "--layer", "missing.json"], "layer file 'missing.json' does not exist"),
    ],
)
def test_explain_usage_errors_exit_2(cli: Any, args: list[str], message: str) -> None:
    code, out, err = cli("explain", *args)
    assert code == 2
    assert out == ""
    assert message in err
    assert "Traceback" not in err


def test_explain_layer_file_errors_name_the_file_and_the_key(cli: Any, tmp_path: Path) -> None:
    path = tmp_path / "layer.json"
    path.write_text(json.dumps({"num_heads": 8, "head_dims": 64}))
    code, _, err = cli("explain", "--layer", str(path))
    assert code == 2
    assert "head_dims: expected a LayerSpec or KVCacheLayout field" in err
    assert f"Did you mean 'head_dim'? In layer file {str(path)!r}" in err
    path.write_text(json.dumps({"num_heads": 8, "head_dim": 64, "dtype": "f16"}))
    code, _, err = cli("explain", "--layer", str(path))
    assert code == 2
    assert "dtype: expected a dtype name, found 'f16'" in err
    path.write_text(json.dumps({"num_heads": 8, "head_dim": 64, "page_size": 0}))
    code, _, err = cli("explain", "--layer", str(path))
    assert code == 2
    assert "KVCacheLayout.page_size" in err
    assert f"From layer file {str(path)!r} and the command line" in err


# --- demo --------------------------------------------------------------------------------------


def test_demo() -> None:
    proc = run_cli("demo", "--seed", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    for key in ("backend ", "batch ", "layer ", "forward ", "check "):
        assert any(line.startswith(key) for line in out.splitlines()), key
    assert "KV cache identical" in out
    assert out.rstrip().endswith("demo OK")


def test_unknown_backend_is_a_message_not_a_traceback(cli: Any) -> None:
    code, _, err = cli("demo", "--backend", "refrence")
    assert code == 2
    assert err.startswith("attnsdk: error: unknown attention backend 'refrence'")
    assert "Did you mean 'reference'?" in err
    assert "Traceback" not in err


# --- bench -------------------------------------------------------------------------------------

BENCH_KEYS = {
    "attnsdk", "device", "device_type", "torch", "python", "threads", "quick", "layer",
    "copy_ceiling_gbs", "matmul_ceiling_tflops", "matmul_dtype", "backends",
    "backends_skipped", "suites", "seconds",
}  # fmt: skip
ROW_KEYS = {
    "suite", "case", "backend", "num_seqs", "num_tokens", "layers", "kv_bytes", "flops",
    "setup_s", "max_abs_err", "correct", "sdk_fwd_eager_us", "sdk_step_eager_us",
    "sdk_plan_host_us", "graph", "fwd_eager_ratio", "graph_ratio", "floor_us", "bound",
    "floor_basis", "frac_of_floor",
}  # fmt: skip
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}  # the CPU path on every machine


@pytest.fixture
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process bench runs take the CPU path, GPU or not."""
    import attnsdk._cli.bench

    monkeypatch.setattr(attnsdk._cli.bench, "cuda_available", lambda: False)


def test_bench_quick_json_on_a_cpu() -> None:
    proc = run_cli("bench", "--quick", "--json", "--backend", "reference", **NO_GPU)
    assert proc.returncode == 0, proc.stderr
    assert "GPU benchmarks need CUDA" in proc.stderr  # said once, on stderr: stdout is JSON
    report = json.loads(proc.stdout)
    assert set(report) == BENCH_KEYS
    assert (report["device_type"], report["quick"], report["backends"]) == (
        "cpu",
        True,
        ["reference"],
    )
    assert report["layer"] == {
        "num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "page_size": 16, "dtype": "bfloat16"
    }  # fmt: skip
    assert list(report["suites"]) == ["decode", "prefill", "mixed"]
    for suite, data in report["suites"].items():
        assert data["skipped"] == []
        (row,) = data["rows"]
        assert set(row) >= ROW_KEYS, ROW_KEYS - set(row)
        assert (row["suite"], row["backend"], row["correct"]) == (suite, "reference", True)
        assert row["sdk_fwd_eager_us"] > 0
        assert "raw_eager_us" not in row  # no raw kernel runs on a CPU
        assert row["graph"] == "not on a GPU"
        assert row["frac_of_floor"] > 0
    decode = report["suites"]["decode"]["rows"][0]
    assert {"bs", "ctx", "sdk_eager_us", "eager_ratio", "kv_gbs", "kv_frac_of_copy"} <= set(decode)
    prefill = report["suites"]["prefill"]["rows"][0]
    assert {"sdk_us", "raw_us", "sdk_tflops", "ratio", "frac_of_matmul"} <= set(prefill)


def test_bench_table_and_out_dir(cli: Any, cpu_only: None, tmp_path: Path) -> None:
    code, out, err = cli(
        "bench", "--quick", "--backend", "Reference", "--suite", "decode", "--out", str(tmp_path)
    )
    assert code == 0, err
    header, row, *rest = out.splitlines()
    assert header.split()[:6] == ["suite", "case", "backend", "SDK", "us", "raw"]
    assert row.split()[:3] == ["decode", "4x256", "reference"]
    assert rest[-1].startswith("per layer, forward only")
    assert "measured in this run on cpu" in rest[-1]
    # one suite: its file only (bench.json is written when several suites ran)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.json"]
    data = json.loads((tmp_path / "decode.json").read_text())
    assert data["suite"] == "decode"
    assert [r["case"] for r in data["rows"]] == ["4x256"]
    assert data["copy_ceiling_gbs"] > 0


def test_bench_backend_lists(cli: Any, cpu_only: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """--backend is repeatable and takes comma lists; a backend that cannot run is skipped
    with its reasons, and nothing left to run is exit status 1."""
    import attnsdk._cli.bench as bench

    seen: list[list[str]] = []
    real = bench.select_backends

    def spy(names: list[str], device: str) -> tuple[list[str], dict[str, list[str]]]:
        seen.append(names)
        return real(names, device)

    monkeypatch.setattr(bench, "select_backends", spy)
    code, out, err = cli("bench", "--quick", "--backend", "fa3,FA3", "--backend", "flashinfer")
    assert seen == [["fa3", "flashinfer"]]
    assert code == 1
    assert out == ""
    assert "skipped fa3: environment: device must be one of ['cuda'], found 'cpu'" in err
    assert "skipped flashinfer: environment: device must be one of ['cuda']" in err
    assert "no backend to benchmark on cpu" in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--backend", "refrence"], "--backend 'refrence': unknown; known: "),
        (["--backend", "fa3,nope"], "--backend 'nope': unknown; known: "),
        (["--suite", "decod"], "--suite 'decod': unknown; known: decode, prefill, mixed."),
    ],
)
def test_bench_unknown_names_exit_2(cli: Any, args: list[str], message: str) -> None:
    code, out, err = cli("bench", *args)
    assert code == 2
    assert out == ""
    assert message in err
    assert "Traceback" not in err
    if "backend" in message:
        assert ", ".join(A.backend_names()) in err  # names every registered backend
    assert "Did you mean" in err or "nope" in args[1]


def test_bench_reports_a_wrong_backend(
    cli: Any, cpu_only: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend whose output differs from the reference fails the run (exit status 1)."""

    class Wrong(ReferenceBackend):
        def attend(self, call: Any) -> Any:
            return call.out.zero_()

    handle = A.register_backend("wrong", Wrong, priority=-1)
    try:
        code, out, err = cli("bench", "--quick", "--backend", "wrong", "--suite", "prefill")
    finally:
        handle.remove()
    assert code == 1
    assert "FAILED prefill prefill 1x128 wrong: wrong output" in err
    assert "wrong" in out  # the row is still printed


# --- docs/cli.md -------------------------------------------------------------------------------

MANUAL = (ROOT / "docs" / "cli.md").read_text()


def manual_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", MANUAL, re.DOTALL)
    lines = [line.split(" #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if re.match(r"^(\w+=\S+ )*attnsdk\b", line)]


@pytest.mark.parametrize("command", manual_commands())
def test_every_command_in_the_manual_parses(command: str) -> None:
    first = command.split(" | ")[0]  # a pipe into another program
    words = [w for w in shlex.split(first) if not re.match(r"^\w+=", w)]
    assert words[0] == "attnsdk"
    if {"--help", "--version"} & set(words):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(words[1:])
        assert info.value.code == 0, command
    else:
        build_parser().parse_args(words[1:])  # a usage error would exit 2


def documented_keys(section: str) -> set[str]:
    """The `key` names of the keys table under ``section`` in docs/cli.md."""
    text = MANUAL.split(section, 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `([\w.]+)` \|", text, re.MULTILINE))


def test_the_manual_documents_every_json_key() -> None:
    info = documented_keys("### `attnsdk info --json`")
    assert {k for k in info if "." not in k} == INFO_KEYS
    assert {k.split(".", 1)[1] for k in info if k.startswith("config.")} == CONFIG_KEYS
    explain = documented_keys("### `attnsdk explain --json`")
    assert {k for k in explain if "." not in k} == EXPLAIN_KEYS
    bench = documented_keys("### `attnsdk bench --json`")
    assert {k for k in bench if "." not in k} == BENCH_KEYS
    assert {k.split(".", 1)[1] for k in bench if k.startswith("row.")} >= ROW_KEYS


def test_explain_mla(cli: Any) -> None:
    args = ["--heads", "16", "--kv-heads", "1", "--head-dim", "576", "--v-head-dim", "512"]
    code, out, _ = cli("explain", *args, "--mla", "--backend", "reference", *CPU)
    assert code == 0, out
    assert "MLA (latent cache)" in out
    code, out, _ = cli("explain", *args, "--mla", "--backend", "flex", "--json", *CPU)
    report = json.loads(out)
    assert (report["layer"]["mla"], report["layout"]["mla"]) == (True, True)
    assert code == 1
    assert "must be <= 256 and a multiple of 16, found 576" in json.dumps(report["backends"])

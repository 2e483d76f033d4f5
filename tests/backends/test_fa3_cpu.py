"""What the fa3 backend promises without a GPU: lazy imports, reasons, options, errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pydantic import ValidationError

import attnsdk as A
import attnsdk.contract.capabilities as caps_module
from attnsdk.backends.fa3 import FA3Backend, FA3Options
from attnsdk.backends.fa3 import backend as fa3
from attnsdk.backends.fa3 import kernels as _fa3_kernels
from attnsdk.backends.reference import ReferenceBackend

KERNEL_MODULES = ("flash_attn_interface", "flash_attn_3", "sgl_kernel", "vllm", "triton")
LAYER = A.LayerSpec(num_heads=8, num_kv_heads=2, head_dim=128)
LAYOUT = A.KVCacheLayout(2, 128, 16)


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend an sm90 GPU and an installed kernel library are present."""
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(fa3, "find_provider", lambda pinned="auto": "flash_attn_interface")
    monkeypatch.setattr(fa3, "build_flags", dict)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: None)


def test_importing_the_backend_imports_no_kernel_library() -> None:
    code = (
        "import sys, torch; before = set(sys.modules); "
        "import attnsdk, attnsdk.backends.fa3, attnsdk.backends.graphs; "
        "attnsdk.backends.fa3.FA3Backend.environment_reasons('cuda'); "
        f"print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] in {KERNEL_MODULES!r}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.strip() == "[]"


def test_environment_reasons_without_gpu_or_library(
    no_gpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fa3, "find_provider", lambda pinned="auto": None)
    reasons = FA3Backend.environment_reasons()
    assert all(r.kind is A.ReasonKind.ENVIRONMENT for r in reasons)
    by_field = {r.field: r.message for r in reasons}
    assert "needs a CUDA GPU" in by_field["device"]
    assert "pip install tokenspeed-fa3" in by_field["install"]
    cpu = FA3Backend.environment_reasons("cpu")
    assert any("must be one of ['cuda'], found 'cpu'" in r.message for r in cpu)


def test_environment_reasons_on_wrong_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(caps_module, "compute_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(fa3, "find_provider", lambda pinned="auto": "sgl_kernel")
    reasons = FA3Backend.environment_reasons("cuda")
    assert [r.field for r in reasons] == ["compute_capability"]
    assert "must be >= 9.0, found 8.0" in reasons[0].message


def test_environment_reasons_on_hopper_with_library(hopper: None) -> None:
    assert FA3Backend.environment_reasons("cuda") == []
    assert FA3Backend.refusals(A.Request(LAYER, LAYOUT, torch.device("cuda"))) == []


def test_create_backend_on_cpu_raises_environment_reasons(no_gpu: None) -> None:
    with pytest.raises(A.UnsupportedConfigError) as info:
        A.create_backend("fa3")
    assert info.value.reasons
    assert all(r.kind is A.ReasonKind.ENVIRONMENT for r in info.value.reasons)
    assert "device" in {r.field for r in info.value.reasons}


def test_auto_skips_fa3_without_gpu(no_gpu: None) -> None:
    assert A.create_backend("auto").name == "reference"
    assert "fa3" in A.backend_names()
    assert A.backend_names().index("fa3") < A.backend_names().index("reference")


def test_missing_library_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_fa3_kernels, "module_present", lambda name: False)
    with pytest.raises(A.BackendUnavailableError) as info:
        FA3Backend(FA3Options(provider="vllm"))
    assert info.value.install_command == "pip install tokenspeed-fa3"
    assert "vllm.vllm_flash_attn" in str(info.value)
    assert isinstance(info.value, ImportError)


def test_module_present_imports_nothing() -> None:
    code = (
        "import sys; from attnsdk.backends.fa3.kernels import module_present; "
        "print(module_present('wsgiref.simple_server'), module_present('wsgiref.no_such_module'), "
        "module_present('no_such_package.x'), 'wsgiref' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert done.stdout.split() == ["True", "False", "False", "False"]


def test_provider_order(monkeypatch: pytest.MonkeyPatch) -> None:
    present = {"sgl_kernel.flash_attn", "vllm.vllm_flash_attn"}
    monkeypatch.setattr(_fa3_kernels, "module_present", lambda name: name in present)
    assert _fa3_kernels.find_provider() == "sgl_kernel"
    assert _fa3_kernels.find_provider("vllm") == "vllm"
    assert _fa3_kernels.find_provider("flash_attn_interface") is None


@pytest.mark.parametrize(
    ("layer", "layout", "field"),
    [
        (A.LayerSpec(4, 4, 512), A.KVCacheLayout(4, 512, 16), "head_dim"),
        (A.LayerSpec(4, 4, 100), A.KVCacheLayout(4, 100, 16), "head_dim"),
        (LAYER, A.KVCacheLayout(2, 128, 16, dtype=torch.float32), "dtype"),
        (LAYER, A.KVCacheLayout(2, 128, 16, kv_dtype=torch.float8_e5m2), "kv_dtype"),
        (LAYER, A.KVCacheLayout(2, 128, 16, dtype=torch.float16, kv_dtype=torch.float8_e4m3fn), "dtype"),
        (A.LayerSpec(4, 2, 72), A.KVCacheLayout(2, 72, 16, kv_dtype=torch.float8_e4m3fn), "head_dim"),
        (A.LayerSpec(4, 2, 128, v_head_dim=64), A.KVCacheLayout(2, 128, 16, v_head_dim=64), "v_head_dim"),
    ],
)  # fmt: skip
def test_configuration_reasons(
    hopper: None, layer: A.LayerSpec, layout: A.KVCacheLayout, field: str
) -> None:
    reasons = FA3Backend.refusals(A.Request(layer, layout, torch.device("cuda")))
    assert field in {r.field for r in reasons}
    assert all(r.kind is A.ReasonKind.CONFIGURATION for r in reasons)


def test_every_reason_is_returned(hopper: None) -> None:
    layer = A.LayerSpec(4, 4, 512)
    layout = A.KVCacheLayout(4, 512, 16, dtype=torch.float32)
    reasons = FA3Backend.refusals(A.Request(layer, layout, torch.device("cuda")))
    assert {"dtype", "head_dim", "v_head_dim"} <= {r.field for r in reasons}
    assert reasons == sorted(reasons)


def test_build_flags_become_reasons(hopper: None, monkeypatch: pytest.MonkeyPatch) -> None:
    flags = {"FLASHATTENTION_DISABLE_SOFTCAP": True, "FLASHATTENTION_DISABLE_HDIM256": True}
    monkeypatch.setattr(fa3, "build_flags", lambda: flags)
    layer = A.LayerSpec(4, 4, 256, softcap=30.0)
    fields = {
        r.field: r.message
        for r in FA3Backend.refusals(A.Request(layer, None, torch.device("cuda")))
    }
    assert "not compiled" in fields["softcap"]
    assert "<= 192" in fields["head_dim"]


def test_hnd_and_page_sizes_are_supported(hopper: None) -> None:
    for page in (1, 16, 64, 256):
        for order in ("NHD", "HND"):
            layout = A.KVCacheLayout(2, 128, page, order=order)
            assert FA3Backend.refusals(A.Request(LAYER, layout, torch.device("cuda"))) == []


def test_options_validation() -> None:
    assert FA3Options().provider == "auto"
    with pytest.raises(ValidationError):
        FA3Options(num_splits=-1)
    with pytest.raises(ValidationError):
        FA3Options(provider="flashinfer")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        FA3Options.model_validate({"num_split": 2})
    options = FA3Options(pack_gqa=True)
    with pytest.raises(ValidationError):
        options.pack_gqa = False  # type: ignore[misc]
    config = A.AttentionConfig.model_validate({"backend": "fa3", "num_splits": 4})
    assert isinstance(config.options, FA3Options)
    assert config.options.num_splits == 4


def test_graph_runner_refuses_uncapturable_backend() -> None:
    with pytest.raises(A.UnsupportedConfigError, match="graph_support"):
        A.GraphRunner(
            ReferenceBackend(), lambda plan: plan, batch_sizes=[1], max_pages=1, page_size=16
        )


def test_graph_runner_validates_arguments(hopper: None) -> None:
    class Capturable:
        name = "capturable"
        capabilities = FA3Backend.capabilities

    backend = Capturable()
    with pytest.raises(A.InvalidInputError, match="batch_sizes"):
        A.GraphRunner(backend, print, batch_sizes=[], max_pages=1, page_size=16)  # type: ignore[arg-type]
    with pytest.raises(A.InvalidInputError, match="device"):
        A.GraphRunner(backend, print, batch_sizes=[1], max_pages=1, page_size=16, device="cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("direct", [True, False], ids=["registered-op", "wrapper"])
def test_kernel_call_hands_back_fa3s_lse(direct: bool) -> None:
    """FA3 returns its log-sum-exp as (Hq, total_q). ``lse=`` copies it into a (T, Hq) buffer;
    ``return_lse`` returns a (T, Hq) view of it instead, no copy (the tree passes merge those
    views, ``merge_states`` reading strides); both on either calling route."""
    t, hq, padded = 3, 2, 5
    native = torch.arange(hq * padded, dtype=torch.float32).reshape(hq, padded)

    def fwd(*args: object, **kwargs: object) -> tuple[torch.Tensor, ...]:
        if not direct:
            assert kwargs["return_softmax_lse"] is True
        return (torch.zeros(t, hq, 4), native)

    names = frozenset({"return_softmax_lse", "out", "cache_seqlens", "page_table"})
    call = _fa3_kernels.KernelCall("flash_attn_interface", direct, fwd, None, names)
    q, out = torch.zeros(t, hq, 4), torch.zeros(t, hq, 4)
    args = {
        "cu_seqlens_q": torch.tensor([0, t], dtype=torch.int32), "cache_seqlens": None,
        "page_table": None, "max_seqlen_q": t, "softmax_scale": 1.0, "causal": True,
        "window": (-1, -1), "softcap": 0.0, "q_descale": None, "k_descale": None,
        "v_descale": None, "scheduler_metadata": None, "num_splits": 1, "pack_gqa": None,
        "sinks": None,
    }  # fmt: skip
    view = call(q, q, q, out, lse=None, return_lse=True, **args)
    assert view is not None
    assert view.shape == (t, hq)
    assert view.data_ptr() == native.data_ptr()  # FA3's own buffer
    assert torch.equal(view, native[:, :t].t())
    dest = torch.empty(t, hq)
    assert call(q, q, q, out, lse=dest, **args) is None
    assert torch.equal(dest, native[:, :t].t())

"""Every fake and patch the engines' released Python code needs on a CPU-only host.

The engine tier (``make test-engines``) runs attnsdk's adapters inside SGLang's and vLLM's own
code: each engine's wheel installed ``--no-deps`` into ``.engines/<engine>-<version>/site`` with
the pure-Python modules pinned in ``<engine>_engine/requirements-<version>.txt``, on torch 2.13 CPU.
Only what cannot work without a GPU is replaced, here and nowhere else:

* **Fake modules** (``SGLANG_FAKED``): an import hook answers for the listed compiled packages
  (and their submodules) with an empty module whose every attribute is a *stub*. A stub can be
  imported, read, subclassed and used in annotations, but **calling it raises**
  :class:`FakeCalled`, so code that reaches a real kernel fails loudly, never silently. vLLM
  needs none: it imports its own compiled modules under ``try/except``, and faking an optional
  GPU package would make vLLM believe the kernels exist.
* **Patches** (``VLLM_PATCHES``): vLLM's no-GPU platform class is subclassed (never modified)
  so its Python paths can run on a CPU; an optional CPU cache op lets vLLM's own FlexAttention
  backend serve as a control; model configs are served offline.

SGLang needs no patch: its platform probes answer "no GPU" by themselves (leave
``SGLANG_USE_CPU_ENGINE`` unset). Known CPU limits of the engines' own code, handled in tests:
SGLang's ``MHATokenToKVPool.set_kv_buffer`` fails under autograd on CPU (run under
``torch.no_grad()``); SGLang 0.5.12.post1's paged allocator ``alloc_extend`` / ``alloc_decode``
launch Triton kernels (use ``alloc(n)``); importing either engine emits warnings, which
tests/engines/pytest.ini does not turn into errors.

This module imports neither engine nor torch at import time.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path
from typing import Any

__all__ = [
    "DEFAULT_HF_HOME",
    "HF_CONFIGS",
    "SGLANG_FAKED",
    "VLLM_PATCHES",
    "FakeCalled",
    "install_sglang",
    "install_vllm",
    "is_fake",
]

#: SGLang's compiled packages answered by fakes, each with the reason the real one cannot be used.
SGLANG_FAKED: dict[str, str] = {
    "sgl_kernel": (
        "SGLang's CUDA kernel package (PyPI: sglang-kernel): its wheels are CUDA builds whose "
        "__init__ loads .so files that need libcuda, so it cannot import on a CPU host. "
        "Needed (both versions) by the FA3 backend module "
        "sglang.srt.layers.attention.flashattention_backend, which does "
        "`from sgl_kernel import merge_state_v2` at module level. The other engine-tier "
        "modules (pools, allocator, ForwardBatch, RadixAttention, registry, graph runners, "
        "ServerArgs, spec inputs, torch_native, the test kit) import without it; "
        "with the fake, sglang.srt.layers.quantization.utils.get_scalar_types() returns "
        "stubs instead of SGLang's own ImportError mocks (harmless)."
    ),
    "torchvision": (
        "Compiled against one exact torch build, and pip would pull a CUDA torch with it. "
        "SGLang imports it unconditionally on `import sglang` paths: 0.5.12.post1 in "
        "sglang/srt/utils/common.py (`from torchvision.io import decode_jpeg`), 0.5.23 via "
        "sglang/srt/configs/__init__.py -> nano_nemotron_vl -> multimodal/internvl_utils.py "
        "(`import torchvision.transforms`). Side effect: transformers' availability probe "
        "(importlib.util.find_spec) then sees torchvision as installed and reads a few names "
        "(InterpolationMode, ...) at import; nothing calls them."
    ),
}

#: vLLM runtime patches applied by install_vllm() (name -> why).
VLLM_PATCHES: dict[str, str] = {
    "platform": (
        "No GPU, so vLLM picks vllm.platforms.interface.UnspecifiedPlatform, whose "
        "device_type is '' (the harness builds torch.device(f'{device_type}:0')), whose "
        "manual_seed_all raises NotImplementedError (set_random_seed calls it), whose "
        "is_pin_memory_available says True (torch CPU cannot pin: async_tensor_h2d then "
        "fails), whose get_attn_backend_cls returns '' (so Attention(...) cannot select "
        "any backend) and whose opaque_attention_op is False (CUDA and CPU platforms say True: "
        "Attention.forward then goes through the torch.ops.vllm.unified_attention_with_output "
        "custom op, as in production). install() sets vllm.platforms._current_platform to an "
        "instance of a subclass fixing those five; is_cpu() stays False so no CPU-build kernels (vllm._C "
        "CPU ops, absent from the CUDA wheel) are selected."
    ),
    "_C_cache_ops.reshape_and_cache_flash": (
        "Compiled op (vllm._C, not importable here) that vLLM's FlexAttentionImpl."
        "do_kv_cache_update calls. Registered with torch.library as a plain-PyTorch CPU "
        "implementation (kv_cache_dtype 'auto' only) so vLLM's own FLEX_ATTENTION backend "
        "can serve as a control in vLLM's harness. Skipped with install(cache_ops=False)."
    ),
    "_C_cache_ops.concat_and_cache_mla": (
        "Compiled op (vllm._C) with which vLLM's MLAAttentionImpl.do_kv_cache_update writes "
        "the latent cache (kv_c then k_pe per token). Registered beside reshape_and_cache_flash "
        "as a plain-PyTorch CPU implementation (kv_cache_dtype 'auto', and 'fp8' / 'fp8_e4m3' as "
        "vLLM's kernel quantizes: e4m3 of row / scale, saturated), so MLA layers run with vLLM's "
        "own cache writes."
    ),
    "_C_cache_ops.gather_and_maybe_dequant_cache": (
        "Compiled op (vllm._C) with which vLLM's MLA prefill gathers a chunk of a request's "
        "cached context (latent rows, by block table, token_to_seq and seq_starts) into its "
        "workspace before up-projecting it. Registered beside concat_and_cache_mla as a "
        "plain-PyTorch CPU implementation ('auto', and fp8 dequantized as e4m3 * scale)."
    ),
    "triton_merge_attn_states": (
        "vLLM merges the MLA prefill's context and new-token parts with merge_attn_states, which "
        "takes its CUDA op on CUDA, its own PyTorch version (_merge_attn_states_torch) on the CPU "
        "platform, and the Triton kernel elsewhere: on this platform (is_cpu() False) that is "
        "Triton, which cannot run here. install() points the Triton module's merge_attn_states "
        "at vLLM's own PyTorch version, so the merge is still vLLM's code."
    ),
    "hf_offline": (
        "vLLM's harness builds ModelConfig('Qwen/Qwen3-0.6B'), which reads config.json from "
        "the Hub; the Hub is unreachable here. install() writes that config.json into an "
        "HF cache (HF_HOME) and sets HF_HUB_OFFLINE=1. Skipped with install(hf_home=None)."
    ),
}

#: config.json of the models vLLM's attention harness names (as published on the Hub).
HF_CONFIGS: dict[str, dict] = {
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "initializer_range": 0.02,
        "intermediate_size": 3072,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": 16,
        "num_hidden_layers": 28,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
    # Not on the Hub: a two-layer DeepSeek-V2 shape for the MLA drop-in's tests
    # (vllm_engine/test_vllm_mla.py). vLLM's MLA head size is kv_lora_rank + rope = 576.
    "attnsdk-test/tiny-deepseek-v2": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 32,
        "qk_rope_head_dim": 64,
        "v_head_dim": 32,
        "intermediate_size": 512,
        "moe_intermediate_size": 64,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
        "rope_theta": 10000,
        "rms_norm_eps": 1e-6,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 2,
    },
}

_REPO = Path(__file__).resolve().parents[2]
DEFAULT_HF_HOME = _REPO / ".engines" / "hf"


_ACTIVE: set[str] = set()
"""Top-level package names the import hook currently answers for."""


class FakeCalled(RuntimeError):
    """A stub from ``tests/engines/fakes.py`` was called."""


_STUBS: dict[str, type] = {}


def _is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


class _StubMeta(type):
    """Metaclass of stubs: attribute reads give more stubs; calling a stub raises."""

    def __getattr__(cls, name: str) -> type:
        if _is_dunder(name):
            raise AttributeError(name)
        return _stub(f"{cls.__module__}.{cls.__qualname__}.{name}")

    def __call__(cls, *args: object, **kwargs: object) -> object:
        if cls.__dict__.get("_fake_stub", False):
            raise FakeCalled(
                f"{cls.__module__}.{cls.__qualname__} is a CPU fake "
                f"(tests/engines/fakes.py): the real compiled package is not "
                f"installed here, so it cannot be called."
            )
        return super().__call__(*args, **kwargs)  # a real class that subclasses a stub

    def __repr__(cls) -> str:
        return f"<fake {cls.__module__}.{cls.__qualname__}>"


def _stub(fullname: str) -> type:
    stub = _STUBS.get(fullname)
    if stub is None:
        module, _, qual = fullname.rpartition(".")
        stub = _StubMeta(qual, (), {"_fake_stub": True, "__module__": module, "__qualname__": qual})
        _STUBS[fullname] = stub
    return stub


def _fake_module(name: str) -> types.ModuleType:
    mod = types.ModuleType(name, f"CPU fake of {name} (tests/engines/fakes.py)")

    def __getattr__(attr: str) -> type:  # PEP 562: any attribute resolves to a stub
        if _is_dunder(attr):
            raise AttributeError(f"fake module {name!r} has no attribute {attr!r}")
        return _stub(f"{name}.{attr}")

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    mod.__path__ = []  # a package, so that any submodule import reaches the finder
    mod.__version__ = "0.0.0+fake"
    mod.__fake__ = True  # type: ignore[attr-defined]
    return mod


def _importer() -> str:
    """file:line of the first frame outside importlib and this file (for diagnostics)."""
    frame = sys._getframe(1)
    while frame is not None:
        fn = frame.f_code.co_filename
        if not fn.startswith("<frozen") and fn != __file__:
            return f"{fn}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


#: fake module name -> where it was first imported from (file:line), for diagnostics.
IMPORTED_FROM: dict[str, str] = {}


class _FakeFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):  # type: ignore[no-untyped-def]
        if fullname.partition(".")[0] not in _ACTIVE:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        IMPORTED_FROM.setdefault(spec.name, _importer())
        return _fake_module(spec.name)

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        pass


_FINDER = _FakeFinder()


def is_fake(obj: object) -> bool:
    """True for a fake module or a stub."""
    return bool(getattr(obj, "__fake__", False) or getattr(obj, "_fake_stub", False))


def hide_hub_kernels() -> None:
    """Make ``import kernels`` fail with ImportError, which transformers takes for "no hub
    kernels".

    A fresh dev venv resolves the newest transformers, which brings the newest ``kernels``
    package; an engine release's own, older transformers (SGLang 0.5.12.post1 ships 5.6.0) finds
    it, calls its API as it was (``LayerRepository`` without a revision) and fails at import.
    Hub kernels download GPU code: the CPU engine tier has no use for them in any release.
    """
    if "kernels" not in sys.modules:
        sys.modules["kernels"] = None  # type: ignore[assignment]


def install_sglang() -> None:
    """Register SGLang's fakes (idempotent). Must run before ``import sglang``."""
    if "sglang" in sys.modules and not _ACTIVE:
        raise RuntimeError("fakes.install_sglang() must run before sglang is imported")
    hide_hub_kernels()
    _ACTIVE.update(SGLANG_FAKED)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


def _write_hf_configs(hf_home: Path) -> None:
    """A minimal HF cache (refs/main -> one snapshot holding config.json) for HF_CONFIGS."""
    revision = "0" * 40
    for repo_id, config in HF_CONFIGS.items():
        repo_dir = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo_dir / "snapshots" / revision
        target = snapshot / "config.json"
        if target.is_file():
            continue
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo_dir / "refs").mkdir(exist_ok=True)
        (repo_dir / "refs" / "main").write_text(revision)
        target.write_text(json.dumps(config, indent=2))


def _make_platform_cls(base: type) -> type:
    class CpuTestPlatform(base):  # type: ignore[misc,valid-type,unused-ignore]
        """UnspecifiedPlatform that can run vLLM's CPU-capable Python paths (see PATCHES)."""

        device_name = "cpu"
        device_type = "cpu"

        @classmethod
        def manual_seed_all(cls, seed: int) -> None:
            pass  # torch.manual_seed (called just before by set_random_seed) seeds the CPU

        @classmethod
        def is_pin_memory_available(cls) -> bool:
            return False

        @classmethod
        def opaque_attention_op(cls) -> bool:
            return True  # as CudaPlatform / CpuPlatform: Attention.forward -> torch.ops.vllm.*

        @classmethod
        def get_attn_backend_cls(
            cls, selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None
        ) -> str:
            # What CudaPlatform does for an explicitly selected backend (there is no
            # automatic choice on this platform): validate it, then use it.
            if selected_backend is None:
                raise ValueError(
                    "tests/engines/fakes.py platform: select a backend explicitly "
                    "(AttentionConfig(backend=...)); there is no automatic choice on CPU."
                )
            backend_cls = selected_backend.get_class()
            validate = getattr(backend_cls, "validate_configuration", None)
            if validate is not None:
                reasons = validate(
                    device_capability=cls.get_device_capability(),
                    **attn_selector_config._asdict(),
                )
                if reasons:
                    raise ValueError(f"Selected backend {selected_backend} is not valid: {reasons}")
            return selected_backend.get_path()

    return CpuTestPlatform


_MLA_FP8 = ("fp8", "fp8_e4m3")
"""vLLM's kv_cache_dtype names of an e4m3 latent cache, as the CPU MLA cache ops serve them."""


def _to_e4m3(x: Any, scale: Any) -> Any:
    """vLLM's cache quantization: ``x / scale``, saturated to e4m3's finite range (±448)."""
    import torch

    limit = torch.finfo(torch.float8_e4m3fn).max
    return (x.float() / scale.float()).clamp(-limit, limit).to(torch.float8_e4m3fn)


def _register_cache_ops() -> None:
    import torch

    if hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash"):
        return  # real op (or ours) already registered
    lib = torch.library.Library("_C_cache_ops", "DEF")
    lib.define(
        "reshape_and_cache_flash(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, str kv_cache_dtype, "
        "Tensor k_scale, Tensor v_scale) -> ()"
    )

    def reshape_and_cache_flash(
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        # key/value: [T, H, D]; key_cache/value_cache: [num_blocks, block_size, H, D] views.
        if kv_cache_dtype != "auto":
            raise NotImplementedError(
                f"CPU reshape_and_cache_flash (tests/engines/fakes.py) handles "
                f"kv_cache_dtype='auto' only, not {kv_cache_dtype!r}"
            )
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        valid = slots >= 0  # -1 marks padding tokens
        block_size = key_cache.shape[1]
        blocks, offsets = slots[valid] // block_size, slots[valid] % block_size
        key_cache[blocks, offsets] = key[:n][valid].to(key_cache.dtype)
        value_cache[blocks, offsets] = value[:n][valid].to(value_cache.dtype)

    lib.impl("reshape_and_cache_flash", reshape_and_cache_flash, "CompositeExplicitAutograd")
    lib.define(
        "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, str kv_cache_dtype, Tensor scale, bool skip_scale=False) -> ()"
    )

    def concat_and_cache_mla(
        kv_c: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache_dtype: str,
        scale: torch.Tensor,
        skip_scale: bool = False,
    ) -> None:
        # kv_c: [T, kv_lora_rank]; k_pe: [T, rope] or [T, 1, rope]; kv_cache: [blocks, bs, L+R].
        n = slot_mapping.shape[0]
        slots = slot_mapping.long()
        valid = slots >= 0
        rows = torch.cat((kv_c[:n], k_pe[:n].reshape(n, -1)), dim=-1)[valid]
        block_size = kv_cache.shape[1]
        at = slots[valid] // block_size, slots[valid] % block_size
        if kv_cache_dtype == "auto":
            kv_cache[at] = rows.to(kv_cache.dtype)
        elif kv_cache_dtype in _MLA_FP8:  # vLLM's saturating e4m3 of row / scale, as bytes
            kv_cache.view(torch.uint8)[at] = _to_e4m3(rows, scale).view(torch.uint8)
        else:
            raise NotImplementedError(
                f"CPU concat_and_cache_mla (tests/engines/fakes.py) handles kv_cache_dtype "
                f"'auto', 'fp8' and 'fp8_e4m3', not {kv_cache_dtype!r}"
            )

    lib.impl("concat_and_cache_mla", concat_and_cache_mla, "CompositeExplicitAutograd")
    lib.define(
        "gather_and_maybe_dequant_cache(Tensor src_cache, Tensor(a!) dst, Tensor block_table, "
        "Tensor cu_seq_lens, Tensor token_to_seq, int num_tokens, str kv_cache_dtype, "
        "Tensor scale, Tensor? seq_starts=None) -> ()"
    )

    def gather_and_maybe_dequant_cache(
        src_cache: torch.Tensor,
        dst: torch.Tensor,
        block_table: torch.Tensor,
        cu_seq_lens: torch.Tensor,
        token_to_seq: torch.Tensor,
        num_tokens: int,
        kv_cache_dtype: str,
        scale: torch.Tensor,
        seq_starts: torch.Tensor | None = None,
    ) -> None:
        # Row i of dst is position seq_starts[b] + (i - cu_seq_lens[b]) of request b =
        # token_to_seq[i], read through block_table[b]; src_cache: [blocks, bs, L+R].
        if kv_cache_dtype not in ("auto", *_MLA_FP8):
            raise NotImplementedError(
                f"CPU gather_and_maybe_dequant_cache (tests/engines/fakes.py) handles "
                f"kv_cache_dtype 'auto', 'fp8' and 'fp8_e4m3', not {kv_cache_dtype!r}"
            )
        seq = token_to_seq[:num_tokens].long()
        pos = torch.arange(num_tokens) - cu_seq_lens.long()[seq]
        if seq_starts is not None:
            pos = pos + seq_starts.long()[seq]
        block_size = src_cache.shape[1]
        blocks = block_table.long()[seq, pos // block_size]
        rows = src_cache[blocks, pos % block_size]
        if kv_cache_dtype != "auto":  # e4m3 bytes (or an e4m3 view): value = e4m3 * scale
            rows = rows.view(torch.float8_e4m3fn).float() * scale.float()
        dst[:num_tokens] = rows.to(dst.dtype)

    lib.impl(
        "gather_and_maybe_dequant_cache",
        gather_and_maybe_dequant_cache,
        "CompositeExplicitAutograd",
    )
    _KEEP.append(lib)  # a Library deregisters its ops when garbage-collected


_KEEP: list[object] = []
_PLATFORM: list[object] = []


def install_vllm(
    *, cache_ops: bool = True, hf_home: str | os.PathLike[str] | None = DEFAULT_HF_HOME
) -> None:
    """Register the fakes and apply the patches (idempotent).

    Must run before anything reads ``vllm.platforms.current_platform``.  ``hf_home=None``
    leaves HF_HOME / HF_HUB_OFFLINE alone; ``cache_ops=False`` skips the CPU cache op.
    """
    hide_hub_kernels()

    if hf_home is not None:
        hf_home = Path(hf_home)
        if "huggingface_hub" in sys.modules and os.environ.get("HF_HOME") != str(hf_home):
            raise RuntimeError(
                "tests/engines/fakes.install_vllm(): huggingface_hub was imported before "
                "install() and read HF_HOME already; call install() first."
            )
        _write_hf_configs(hf_home)
        os.environ["HF_HOME"] = str(hf_home)
        os.environ["HF_HUB_OFFLINE"] = "1"

    import vllm.platforms
    from vllm.platforms.interface import UnspecifiedPlatform

    current = vllm.platforms._current_platform
    if not _PLATFORM:
        if current is not None and not isinstance(current, UnspecifiedPlatform):
            raise RuntimeError(
                f"vLLM already resolved its platform to {type(current).__name__}; "
                "tests/engines/fakes.install_vllm() expects a host without a GPU."
            )
        _PLATFORM.append(_make_platform_cls(UnspecifiedPlatform)())
    if current is not _PLATFORM[0]:
        if current is not None:
            raise RuntimeError(
                "vllm.platforms.current_platform was read before "
                "tests/engines/fakes.install_vllm(); call install() first."
            )
        vllm.platforms._current_platform = _PLATFORM[0]

    if cache_ops:
        _register_cache_ops()

    import vllm.v1.attention.ops.merge_attn_states as merge
    import vllm.v1.attention.ops.triton_merge_attn_states as triton_merge

    triton_merge.merge_attn_states = merge._merge_attn_states_torch

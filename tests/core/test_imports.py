"""``import attnsdk`` (and its CPU-side subpackages) imports no kernel library and no engine,
and does not even look at installed entry points."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = (
    "flash_attn_interface",
    "flash_attn",
    "flash_attn_3",
    "sgl_kernel",
    "sglang",
    "vllm",
    "triton",
    "flashinfer",
    "transformers",
)

MODULES = (
    "attnsdk",
    "attnsdk.adapters",
    "attnsdk.backends.reference",
    "attnsdk.testing",
    "attnsdk.integrations.transformers",  # imports transformers in register(), not before
)

# One fresh interpreter; the report says which heavy modules appeared after each import, in
# order, so the first offender is the module that pulled them in.
# Whatever ``import torch`` itself pulls in (e.g. triton on some CUDA builds) is not attnsdk's.
SCRIPT = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys

    heavy, modules = json.loads(sys.argv[1])
    loaded = lambda: sorted(m for m in heavy if m in sys.modules)
    import torch  # noqa: F401
    baseline = set(loaded())
    import attnsdk.selection.registry
    plugins_loaded = attnsdk.selection.registry._PLUGINS_LOADED  # entry points wait for first use
    report = {}
    for name in modules:
        importlib.import_module(name)
        report[name] = sorted(set(loaded()) - baseline)
    # Every public backend and adapter module too, including ones added after this test was
    # written. Private helpers (``_triton_store``) may be kernels themselves: what matters is
    # that the public modules do not import them eagerly.
    for package in ("attnsdk.backends", "attnsdk.adapters"):
        path = importlib.import_module(package).__path__
        for info in pkgutil.walk_packages(path, package + "."):
            if any(part.startswith("_") for part in info.name.split(".")):
                continue
            importlib.import_module(info.name)
            report[info.name] = sorted(set(loaded()) - baseline)
    print(json.dumps([plugins_loaded, report]))
    """
)


def test_import_pulls_in_no_kernel_library_or_engine() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps([HEAVY, MODULES])],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    plugins_loaded, report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plugins_loaded is False
    assert set(MODULES) <= set(report)
    assert {name: heavy for name, heavy in report.items() if heavy} == {}

"""docs/adapters/sglang.md's launch snippet, run as written against the installed SGLang.

The snippet registers the drop-in with ``register_attention_backend("attnsdk")`` and adds the
name to ``--attention-backend``'s choices with ``add_attention_backend_choices``. Here it is read
from the doc and executed as a module: SGLang's registry must then hold its factory, SGLang's own
argument parser must accept ``--attention-backend attnsdk`` (and still reject unknown names), and
the model runner's code path must build an ``SGLangAttentionBackend`` from the registry.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from real_sglang import EngineRunner, Pools, create_backend
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, ServerArgs

from attnsdk.adapters.sglang import SGLangAttentionBackend

DOC = Path(__file__).resolve().parents[3] / "docs" / "adapters" / "sglang.md"
SERVER = "sglang.srt.entrypoints.http_server"


@pytest.fixture
def snippet(monkeypatch):
    """The doc's launch script, executed as an imported module (not ``__main__``)."""
    found = re.search(r"```py\n(# launch_attnsdk\.py.*?)```", DOC.read_text(), re.S)
    assert found, "docs/adapters/sglang.md lost its launch snippet"
    # The HTTP server module exists and defines launch_server, but its own dependencies
    # (uvicorn, uvloop) are not installed here; the snippet only calls it under __main__.
    spec = importlib.util.find_spec(SERVER)
    assert spec is not None
    assert "def launch_server(" in Path(spec.origin).read_text()
    server = types.ModuleType(SERVER)
    server.launch_server = None
    monkeypatch.setitem(sys.modules, SERVER, server)
    # Leave SGLang's registry and choices as other tests found them.
    monkeypatch.setitem(ATTENTION_BACKENDS, "attnsdk", ATTENTION_BACKENDS["attnsdk"])
    choices = list(ATTENTION_BACKEND_CHOICES)
    namespace = {"__name__": "launch_attnsdk"}
    try:
        exec(compile(found.group(1), "launch_attnsdk.py", "exec"), namespace)
        yield namespace
    finally:
        ATTENTION_BACKEND_CHOICES[:] = choices


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(p)
    return p


def test_snippet_registers_the_dropin(snippet):
    factory = snippet["create_attnsdk_backend"]
    assert ATTENTION_BACKENDS["attnsdk"] is factory
    assert ATTENTION_BACKEND_CHOICES.count("attnsdk") == 1
    args = parser().parse_args(["--model-path", "m", "--attention-backend", "attnsdk"])
    assert args.attention_backend == "attnsdk"
    with pytest.raises((argparse.ArgumentError, SystemExit)):
        parser().parse_args(["--model-path", "m", "--attention-backend", "attnsdk-typo"])
    backend = create_backend(EngineRunner(Pools(16, torch.bfloat16)), "attnsdk")
    assert isinstance(backend, SGLangAttentionBackend)
    assert isinstance(backend, AttentionBackend)
    assert backend.backend.name == "reference", 'backend="auto" on a machine without a GPU'

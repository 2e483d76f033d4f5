"""examples/mini_engine.py: its greedy tokens equal Hugging Face ``generate`` with eager attention.

Four requests of different prompt lengths arrive at different steps (one prompt longer than the
token budget, so it is prefilled in chunks next to decodes); fp32 on the CPU, reference backend.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.17")

import attnsdk as A  # noqa: E402

NEW_TOKENS = 16
PROMPT_LENS = (7, 45, 3, 20)
ARRIVALS = {0: (0, 1), 2: (2,), 5: (3,)}  # step -> request ids


@pytest.fixture(scope="module")
def served(mini_engine: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        eos_token_id=None,
    )
    eager = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32
    ).eval()
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model.load_state_dict(eager.state_dict())
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in PROMPT_LENS]
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = eager.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt) :].tolist())

    backend = A.create_backend("reference")
    engine = mini_engine.MiniEngine(
        model, backend, num_pages=48, page_size=4, max_batch=8, token_budget=32
    )
    requests = [mini_engine.Request(i, p, NEW_TOKENS) for i, p in enumerate(prompts)]
    arrivals = {step: [requests[i] for i in ids] for step, ids in ARRIVALS.items()}
    results = engine.run(arrivals)
    return {"engine": engine, "requests": requests, "results": results, "expected": expected}


def test_greedy_tokens_equal_hf_generate(served: dict[str, Any]) -> None:
    for req, expected in zip(served["requests"], served["expected"]):
        assert len(req.output) == NEW_TOKENS
        assert req.output == expected, f"request {req.rid}"


def test_steps_mix_prefill_and_decode(served: dict[str, Any]) -> None:
    results = served["results"]
    assert any(r.num_prefill and r.num_decode for r in results)
    # The 45-token prompt does not fit the 32-token budget: its first chunk samples nothing.
    assert results[0].num_prefill == 2
    assert [req.rid for req, _ in results[0].emitted] == [0]
    assert all(r.num_tokens <= 32 for r in results)
    assert not any(r.graph for r in results)  # no CUDA graphs on the CPU


def test_pages_are_all_freed(served: dict[str, Any]) -> None:
    engine = served["engine"]
    assert not engine.scheduler.has_work
    assert engine.allocator.num_free == engine.allocator.num_pages - 1  # page 0 stays reserved
    assert all(not req.pages for req in served["requests"])


def test_attention_needs_the_step(mini_engine: Any, served: dict[str, Any]) -> None:
    model = served["engine"].model
    with pytest.raises(A.UnsupportedConfigError, match="attnsdk_step"):
        model(input_ids=torch.tensor([[1, 2]]), use_cache=False)


def test_allocator_keeps_page_zero(mini_engine: Any) -> None:
    alloc = mini_engine.PageAllocator(4)
    pages = alloc.allocate(3)
    assert sorted(pages) == [1, 2, 3]
    with pytest.raises(RuntimeError, match="1 pages, 0 free"):
        alloc.allocate(1)
    alloc.release(pages)
    assert alloc.num_free == 3


def test_llama4_chunked_layers_equal_hf_generate(mini_engine: Any) -> None:
    """Llama 4's chunked layers reach the engine as ``attention_chunk_size`` (through the
    integration's ``layer_spec``): prompts longer than a chunk decode as HF ``generate`` does."""
    torch.manual_seed(0)
    config = transformers.Llama4TextConfig(
        hidden_size=64,
        intermediate_size=128,
        intermediate_size_mlp=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=128,
        attention_chunk_size=8,
        num_local_experts=2,
        eos_token_id=None,
    )
    eager = transformers.AutoModelForCausalLM.from_config(
        copy.deepcopy(config), attn_implementation="eager", dtype=torch.float32
    ).eval()
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model.load_state_dict(eager.state_dict())
    engine = mini_engine.MiniEngine(
        model, A.create_backend("reference"), num_pages=48, page_size=4, token_budget=32
    )
    assert [s.attention_chunk_size for s in engine.layers] == [8, 8, 8, None]
    prompts = [torch.randint(1, 128, (n,)).tolist() for n in (19, 5)]
    requests = [mini_engine.Request(i, p, 10) for i, p in enumerate(prompts)]
    engine.run({0: requests})
    for req in requests:
        ids = torch.tensor([req.prompt])
        out = eager.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert req.output == out[0, len(req.prompt) :].tolist(), f"request {req.rid}"

"""attnsdk inside Hugging Face models (``attnsdk.integrations.transformers``), on the CPU.

Tiny models with random weights, each compared with the same weights under transformers' own
eager attention: prefill logits (fp32, tight tolerance), greedy tokens over a DynamicCache, a
left-padded batch (served exactly) and a right-padded causal batch (refused). Llama 4's chunked
layers map to ``LayerSpec.attention_chunk_size``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.17")

from attnsdk import AttentionConfig, UnsupportedConfigError  # noqa: E402
from attnsdk.integrations.transformers import register  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 128,
}
CONFIGS: dict[str, Any] = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON),
    # Alternating sliding (W=4) and global layers, softcapped scores, a non-default scale.
    "gemma2": lambda: transformers.Gemma2Config(
        **COMMON,
        sliding_window=4,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0,
        query_pre_attn_scalar=8,
    ),
    # Chunked (C=4) and global layers (every fourth), a small MoE.
    "llama4": lambda: transformers.Llama4TextConfig(
        **COMMON, intermediate_size_mlp=128, attention_chunk_size=4, num_local_experts=2
    ),
    # Sinks on every layer, sliding (W=4) and full layers, a small MoE.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON, sliding_window=4, num_local_experts=4, num_experts_per_tok=2
    ),
}
ATOL = 1e-5


@pytest.fixture(scope="module")
def names() -> dict[str, str]:
    flex = AttentionConfig(backend="flex", compile=False)
    return {
        "reference": register("reference", name="attnsdk_test_reference"),
        "flex": register(flex, name="attnsdk_test_flex"),
    }


def _function(name: str) -> Any:
    return transformers.AttentionInterface._global_mapping[name]


def _pair(config: Any, name: str, cls: Any = None) -> tuple[Any, Any]:
    """The same random weights under eager and under ``name`` (each model its own config:
    ``from_config`` writes the implementation into the config object it is given)."""
    cls = cls or transformers.AutoModelForCausalLM
    torch.manual_seed(0)
    eager = cls.from_config(copy.deepcopy(config), attn_implementation="eager").eval()
    ours = cls.from_config(copy.deepcopy(config), attn_implementation=name).eval()
    ours.load_state_dict(eager.state_dict())
    assert eager.config._attn_implementation == "eager"
    assert ours.config._attn_implementation == name
    return eager, ours


def _greedy(model: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0
    )


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_prefill_decode_and_left_padding_match_eager(names: dict[str, str], arch: str) -> None:
    eager, ours = _pair(CONFIGS[arch](), names["reference"])
    fn = _function(names["reference"])
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (2, 11))  # longer than the window: it matters
    before = fn.forwards
    with torch.no_grad():
        expected, got = eager(ids).logits, ours(ids).logits
    assert fn.forwards - before == ours.config.num_hidden_layers  # attnsdk really ran
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert torch.equal(_greedy(ours, ids), _greedy(eager, ids))
    # Left padding (what generate on a padded batch uses): served exactly, token for token.
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        expected, got = (
            eager(ids, attention_mask=mask).logits,
            ours(ids, attention_mask=mask).logits,
        )
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()], atol=ATOL, rtol=0)
    assert torch.equal(_greedy(ours, ids, mask), _greedy(eager, ids, mask))


def test_flex_backend_matches_eager(names: dict[str, str]) -> None:
    eager, ours = _pair(CONFIGS["llama"](), names["flex"])
    fn = _function(names["flex"])
    ids = torch.randint(1, 128, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=ATOL, rtol=0)
    assert torch.equal(_greedy(ours, ids), _greedy(eager, ids))
    assert fn.backend(torch.device("cpu")).name == "flex"


def test_right_padding_in_a_causal_model_is_refused(names: dict[str, str]) -> None:
    _, ours = _pair(CONFIGS["llama"](), names["reference"])
    ids = torch.randint(1, 128, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with (
        torch.no_grad(),
        pytest.raises(UnsupportedConfigError, match=r"attention_mask\[1\].*padding_side = 'left'"),
    ):
        ours(ids, attention_mask=mask)


def test_encoder_non_causal_with_right_padding_matches_eager(names: dict[str, str]) -> None:
    config = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=128,
    )  # fmt: skip
    eager, ours = _pair(config, names["reference"], transformers.AutoModel)
    assert not any(getattr(m, "is_causal", False) for m in ours.modules())
    fn = _function(names["reference"])
    ids = torch.randint(1, 128, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 2:] = 0  # more query rows than keys: split into chunks over the same keys
    for m in (None, mask):
        before = fn.forwards
        with torch.no_grad():
            expected = eager(ids, attention_mask=m).last_hidden_state
            got = ours(ids, attention_mask=m).last_hidden_state
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)  # padded rows too
        assert fn.forwards - before == config.num_hidden_layers


def test_a_wrong_scale_is_caught(names: dict[str, str]) -> None:
    """The comparison can fail: the same function with a 10 % larger scale does not pass."""
    fn = _function(names["reference"])
    name = register("reference", name="attnsdk_test_wrong_scale")

    def wrong(module: Any, q: Any, k: Any, v: Any, mask: Any, scaling: Any = None, **kw: Any):
        return fn(module, q, k, v, mask, scaling=scaling * 1.1, **kw)

    transformers.AttentionInterface.register(name, wrong)
    eager, ours = _pair(CONFIGS["llama"](), name)
    ids = torch.randint(1, 128, (1, 8))
    with torch.no_grad(), pytest.raises(AssertionError):
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=ATOL, rtol=0)


def test_training_dropout_is_refused(names: dict[str, str]) -> None:
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.1
    _, ours = _pair(config, names["reference"])
    ours.train()
    with pytest.raises(UnsupportedConfigError, match="dropout"):
        ours(torch.randint(1, 128, (1, 4)))


@pytest.mark.parametrize("name", ["paged|attnsdk", "attnsdk_flashinfer", ""])
def test_register_refuses_names_transformers_would_misread(name: str) -> None:
    with pytest.raises(ValueError, match=r"name: expected a non-empty name without the 'paged\|'"):
        register("reference", name=name)


def test_docs_snippet_runs() -> None:
    doc = (ROOT / "docs" / "integrations" / "transformers.md").read_text()
    (code,) = re.findall(r"^```python\n(.*?)^```$", doc, re.DOTALL | re.MULTILINE)
    exec(compile(code, "docs/integrations/transformers.md", "exec"), {"__name__": "snippet"})


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_a_forward_that_needs_gradients_is_refused_and_leaves_nothing_behind(
    names: dict[str, str], backend: str
) -> None:
    """attnsdk computes no gradients: training through it (here with non-reentrant gradient
    checkpointing, which once gave NaN gradients silently) is refused with the reason, and the
    refused call leaves no state behind: the next inference call still matches eager."""
    eager, ours = _pair(CONFIGS["llama"](), names[backend])
    ours.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ours.train()
    ids = torch.randint(1, 128, (2, 7))
    with pytest.raises(UnsupportedConfigError, match=r"query\.requires_grad.*torch\.no_grad"):
        ours(ids, labels=ids).loss.backward()
    ours.eval()
    with pytest.raises(UnsupportedConfigError, match="inference only"):
        ours(ids)  # grad mode on, weights require grad
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=ATOL, rtol=0)
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, atol=ATOL, rtol=0)

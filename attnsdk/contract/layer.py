"""``LayerSpec``: the static attention shape of one model layer."""

from __future__ import annotations

from dataclasses import dataclass

from attnsdk.contract.checks import check_bool, check_int, check_mla_dims, check_positive_float
from attnsdk.contract.errors import InvalidInputError

__all__ = ["LayerSpec"]


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What one attention layer computes; static for the life of the model.

    >>> layer = LayerSpec(num_heads=32, num_kv_heads=8, head_dim=128, sliding_window=4096)
    >>> layer.group_size, layer.window_left, round(layer.softmax_scale, 6)
    (4, 4095, 0.088388)
    """

    num_heads: int
    """Query heads Hq (per tensor-parallel rank)."""
    num_kv_heads: int
    """KV heads Hkv; ``num_heads % num_kv_heads == 0`` (MHA, GQA and MQA)."""
    head_dim: int
    """QK head dim D."""
    v_head_dim: int | None = None
    """V head dim Dv; None means ``head_dim``."""
    scale: float | None = None
    """Softmax scale applied to q·k; None means ``head_dim ** -0.5``."""
    causal: bool = True
    """Bottom-right aligned causal mask: the query at position p sees keys 0..p."""
    sliding_window: int | None = None
    """Hugging Face convention: the query at p sees keys max(0, p - W + 1)..p. None = no window."""
    softcap: float | None = None
    """Scores (already scaled) become ``c * tanh(s / c)`` before softmax. None or 0 = off
    (0 is stored as None)."""
    has_sinks: bool = False
    """The layer passes per-head fp32 ``sinks`` (an extra softmax logit without a value)."""
    attention_chunk_size: int | None = None
    """Chunked local attention C (Llama 4's iRoPE layers): positions split into chunks
    [kC, (k+1)C) and the query at p sees key j only if ``j // C == p // C``, on top of the rules
    above (causal, window). None = off. docs/kv_layout.md defines it."""
    mla: bool = False
    """Multi-head latent attention (DeepSeek V2/V3, Kimi K2) in its absorbed form: one KV head
    whose vector is the latent ``c`` (the first ``v_head_dim = kv_lora_rank`` dims) followed by
    the rope key (``rope_dim`` dims), and V is that latent: ``V[j] = K[j][:kv_lora_rank]``. q
    holds each head's absorbed ``q_nope`` then its ``q_rope``. The KV layout must be ``mla`` too;
    build both with ``for_mla``. docs/kv_layout.md, "MLA"."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            check_int(f"LayerSpec.{name}", getattr(self, name))
        if self.v_head_dim is not None:
            check_int("LayerSpec.v_head_dim", self.v_head_dim)
        if self.num_heads % self.num_kv_heads:
            raise InvalidInputError(
                "LayerSpec.num_heads",
                f"a multiple of num_kv_heads={self.num_kv_heads}",
                self.num_heads,
            )
        if self.scale is not None:
            object.__setattr__(self, "scale", check_positive_float("LayerSpec.scale", self.scale))
        check_bool("LayerSpec.causal", self.causal)
        if self.sliding_window is not None:
            try:
                check_int("LayerSpec.sliding_window", self.sliding_window)
            except InvalidInputError:
                raise InvalidInputError(
                    "LayerSpec.sliding_window",
                    "None or an int >= 1 (Hugging Face convention: window size W)",
                    repr(self.sliding_window),
                    "SGLang's sliding_window_size is W-1; pass W = that + 1",
                ) from None
        if self.softcap is not None:
            cap = check_positive_float("LayerSpec.softcap", self.softcap, allow_zero=True)
            object.__setattr__(self, "softcap", cap or None)
        check_bool("LayerSpec.has_sinks", self.has_sinks)
        if self.attention_chunk_size is not None:
            try:
                check_int("LayerSpec.attention_chunk_size", self.attention_chunk_size)
            except InvalidInputError:
                raise InvalidInputError(
                    "LayerSpec.attention_chunk_size",
                    "None or an int >= 1 (the chunk size C in tokens)",
                    repr(self.attention_chunk_size),
                    "Pass None for a layer without chunks",
                ) from None
        check_bool("LayerSpec.mla", self.mla)
        if self.mla:
            check_mla_dims("LayerSpec", self.num_kv_heads, self.head_dim, self.v_head_dim)

    @classmethod
    def for_mla(
        cls,
        num_heads: int,
        *,
        kv_lora_rank: int = 512,
        rope_dim: int = 64,
        scale: float | None = None,
        causal: bool = True,
    ) -> LayerSpec:
        """An absorbed MLA layer: ``num_kv_heads=1``, ``head_dim=kv_lora_rank + rope_dim``,
        ``v_head_dim=kv_lora_rank``. DeepSeek's ``scale`` is ``(qk_nope_head_dim +
        qk_rope_head_dim) ** -0.5`` (times its YaRN mscale squared), not ``head_dim ** -0.5``: pass
        it.

        >>> layer = LayerSpec.for_mla(16, scale=192**-0.5)
        >>> layer.head_dim, layer.v_dim, layer.kv_lora_rank, layer.rope_dim
        (576, 512, 512, 64)
        """
        return cls(
            num_heads=num_heads,
            num_kv_heads=1,
            head_dim=kv_lora_rank + rope_dim,
            v_head_dim=kv_lora_rank,
            scale=scale,
            causal=causal,
            mla=True,
        )

    @property
    def v_dim(self) -> int:
        """Dv, resolved."""
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def softmax_scale(self) -> float:
        """The scale, resolved (``head_dim ** -0.5`` by default)."""
        return self.head_dim**-0.5 if self.scale is None else float(self.scale)

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def window_left(self) -> int:
        """Keys to the left a query may see: W - 1, or -1 for no window (FlashAttention's form)."""
        return -1 if self.sliding_window is None else self.sliding_window - 1

    @property
    def has_softcap(self) -> bool:
        return bool(self.softcap)

    @property
    def kv_lora_rank(self) -> int | None:
        """An MLA layer's latent dim (= Dv); None for other layers."""
        return self.v_dim if self.mla else None

    @property
    def rope_dim(self) -> int | None:
        """An MLA layer's rope dim (= D - Dv); None for other layers."""
        return self.head_dim - self.v_dim if self.mla else None

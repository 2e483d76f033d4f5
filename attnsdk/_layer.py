"""``LayerSpec``: the static attention shape of one model layer."""

from __future__ import annotations

from dataclasses import dataclass

from attnsdk._errors import InvalidInputError

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
    """Scores (already scaled) become ``c * tanh(s / c)`` before softmax. None or 0 = off."""
    has_sinks: bool = False
    """The layer passes per-head fp32 ``sinks`` (an extra softmax logit without a value)."""

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise InvalidInputError(f"LayerSpec.{name}", "a positive int", repr(value))
        if self.v_head_dim is not None and (
            not isinstance(self.v_head_dim, int) or self.v_head_dim <= 0
        ):
            raise InvalidInputError(
                "LayerSpec.v_head_dim", "a positive int or None", self.v_head_dim
            )
        if self.num_heads % self.num_kv_heads:
            raise InvalidInputError(
                "LayerSpec.num_heads",
                f"a multiple of num_kv_heads={self.num_kv_heads}",
                self.num_heads,
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise InvalidInputError(
                "LayerSpec.sliding_window",
                "None or an int >= 1 (Hugging Face convention: window size W)",
                repr(self.sliding_window),
                "SGLang's sliding_window_size is W-1; pass W = that + 1",
            )
        if self.softcap is not None and self.softcap < 0:
            raise InvalidInputError("LayerSpec.softcap", "None or a value >= 0", self.softcap)
        if self.scale is not None and not self.scale > 0:
            raise InvalidInputError("LayerSpec.scale", "None or a value > 0", self.scale)

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

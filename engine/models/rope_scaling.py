"""RoPE frequency scaling for long context (llama3, linear, YaRN, proportional, LongRoPE):
the one schema both a layer's RotarySpec (engine/models/specs.py) and ModelConfig use; the
frequencies themselves are engine/models/rope.py's."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from engine.config import Strict


class RopeScaling(Strict):
    """RoPE frequency scaling for long context. Frozen: a layer's spec holds it (hashable)."""

    model_config = ConfigDict(**Strict.model_config, frozen=True)

    kind: Literal["llama3", "linear", "yarn", "proportional", "longrope", "dynamic"] = "llama3"
    """llama3: frequency-dependent (Llama 3.1+); linear: every frequency / factor (Gemma 3);
    yarn: YaRN (arXiv 2309.00071; Qwen3, DeepSeek), frequencies interpolated by a linear ramp
    between beta_fast and beta_slow rotations, and cos/sin scaled by an attention factor;
    proportional: the frequencies of the whole head, only the fastest rotated_fraction of them
    kept (the rest zero: those pairs not rotated), every one / factor (Gemma 4's global layers);
    longrope: LongRoPE (arXiv 2402.13753; Phi-3.5, Phi-4-mini), each frequency divided by its
    own short_factor, or long_factor when the sequence is longer than original_max_position,
    and cos/sin scaled by an attention factor (rope.py); dynamic: dynamic NTK (InternLM3), the
    base stretched to base * (factor * n / original_max_position - factor + 1) ** (d / (d - 2))
    once the sequence's length n (its largest position + 1) exceeds original_max_position."""
    factor: float = Field(8.0, gt=0)
    low_freq_factor: float = Field(1.0, gt=0)
    """llama3 only, as is the next one."""
    high_freq_factor: float = Field(4.0, gt=0)
    original_max_position: int = Field(8192, gt=0)
    """Context length the base model was trained with (llama3, yarn)."""
    beta_fast: float = Field(32.0, gt=0)
    """yarn only, as are the rest: rotations below which a frequency is interpolated fully..."""
    beta_slow: float = Field(1.0, gt=0)
    """... and above which it is kept (extrapolated)."""
    attention_factor: float | None = Field(None, gt=0)
    """cos and sin are multiplied by this; None: 0.1 ln(factor) + 1, or with mscale and
    mscale_all_dim (DeepSeek) the ratio of those two terms."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    """Round the ramp's ends to whole dimensions (transformers' default)."""
    rotated_fraction: float = Field(1.0, gt=0, le=1)
    """proportional only: the share of each head's dimension pairs that rotate
    (transformers' partial_rotary_factor of that RoPE type)."""
    short_factor: tuple[float, ...] | None = None
    """longrope only, as is the next one: per rotated pair, the divisor of its frequency while
    the sequence fits in original_max_position..."""
    long_factor: tuple[float, ...] | None = None
    """... and once it is longer (transformers: max(position) + 1 > original_max_position)."""

    @model_validator(mode="after")
    def _check_longrope(self) -> RopeScaling:
        factors = (self.short_factor, self.long_factor)
        if self.kind == "longrope" and (None in factors or len(self.short_factor or ()) != len(self.long_factor or ())):
            raise ValueError("rope_scaling of kind longrope needs short_factor and long_factor of one length")
        return self

    def yarn_attention_factor(self) -> float:
        """The factor YaRN and LongRoPE scale cos and sin by (1.0 for the other kinds)."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.kind == "longrope":  # factor: max_position_embeddings / original (transformers)
            if self.factor <= 1.0:
                return 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_position))

        def get_mscale(scale: float, mscale: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim)
        return get_mscale(self.factor)

"""EXAONE 4.0 (Exaone4ForCausalLM; LGAI-EXAONE/EXAONE-4.0-*): OLMo 2's norm placement with
Qwen 3's QK norm, and global layers without RoPE.

Each sublayer's output is normalised before the residual add and its input is not,
x + norm(attn(x)) (ModelConfig.block.pre_norms false, post_norms true; the tensors are OLMo 2's
post_attention_layernorm and post_feedforward_layernorm), and queries and keys get an
RMSNorm over head_dim before RoPE. With a sliding window (`sliding_window` set: three local
layers then a global one by default, `sliding_window_pattern` a period or a string such as
"LLLG", or `layer_types`) only the sliding-window layers rotate and the global ones are NoPE
(ModelConfig.rope.pattern); without one every layer is global and rotates.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, qk_norm_tensors, register_family, shortest_period

DEFAULT_WINDOW = 4096
"""transformers' sliding_window where config.json leaves the key out (null: no window)."""


@register_family
class Exaone4(Family):
    name = "exaone4"
    architecture = "Exaone4ForCausalLM"
    model_type = "exaone4"
    fixed = {"qk_norm": True, "pre_norms": False, "post_norms": True}
    hf_defaults = {
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "sliding_window": DEFAULT_WINDOW,
        "sliding_window_pattern": 4,
    }
    unsupported_flags = ()
    hf_constants = {}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        if hf.get("sliding_window", DEFAULT_WINDOW) is None:
            return ["full_attention"] * num_layers
        pattern = self.hf_value(hf, "sliding_window_pattern")
        if isinstance(pattern, str):  # "LLLG": L sliding, G global, repeated over the layers
            if not pattern or set(pattern) - {"L", "G"}:
                raise ConfigError(
                    f"config.json ({self.architecture}): sliding_window_pattern '{pattern}' must be L and G letters"
                )
            letters = [pattern[i % len(pattern)] for i in range(num_layers)]
            return ["sliding_attention" if x == "L" else "full_attention" for x in letters]
        if not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(
                f"config.json ({self.architecture}): sliding_window_pattern {pattern!r} must be a period >= 1 "
                "or L and G letters"
            )
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        if hf.get("sliding_window", DEFAULT_WINDOW) is None:
            return {}  # every layer rotates
        local = [t == "sliding_attention" for t in self.layer_types(hf, hf["num_hidden_layers"])]
        if not any(local):
            raise ConfigError(
                f"config.json ({self.architecture}): a sliding_window with no sliding_attention layer makes every "
                "layer NoPE, which is not supported; set sliding_window to null for a model without a window"
            )
        return {"rope_pattern": None if all(local) else shortest_period(local)}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = cfg.layer_is_local()
        period = next(
            (n for n in range(1, cfg.num_layers + 1) if local == [(i + 1) % n != 0 for i in range(cfg.num_layers)]),
            None,
        )
        windowed = any(local)
        return {
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "sliding_window": cfg.attention.sliding_window if windowed else None,
            # transformers' own value: 0 without a window, else the period (its default where none fits)
            "sliding_window_pattern": (period or self.hf_defaults["sliding_window_pattern"]) if windowed else 0,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [spec for spec in super().attention_tensors(cfg) if spec.path[0] != "attn_norm"]

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec(("post_attn_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_feedforward_layernorm.weight", None),
        ]

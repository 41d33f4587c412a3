"""Ministral (MinistralForCausalLM) and Ministral 3 (Ministral3ForCausalLM).

Ministral (8B, 2024) is Mistral with a sliding window on the layers `layer_types` marks (by
default every layer, when `sliding_window` is set). Ministral 3 (3B, 8B, 14B, 2025; Devstral 2)
is Mistral with YaRN and Llama 4's query scale on every layer, after RoPE: queries times
1 + beta * log(1 + floor(p / original_max_position_embeddings)) (its rope_parameters'
`llama_4_scaling_beta`; ModelConfig.attention.query_position_scale). Its 3B, 8B and 14B are published as
Mistral3ForConditionalGeneration, read as their text decoder (the vision tower skipped).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    Family,
    Multimodal,
    layer_types_to_hf,
    register_family,
    rope_parameters_to_hf,
    rope_to_hf,
)


@register_family
class Ministral(Family):
    name = "ministral"
    architecture = "MinistralForCausalLM"
    model_type = "ministral"
    hf_defaults = {"max_position_embeddings": 131072, "tie_word_embeddings": False, "sliding_window": 4096}
    hf_constants = {}  # MinistralConfig has no bias flags: its layers never have biases

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        # A file without the key has transformers' default window (4096); null is none.
        window = hf["sliding_window"] if "sliding_window" in hf else self.hf_defaults["sliding_window"]
        return ["full_attention" if window is None else "sliding_attention"] * num_layers

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return layer_types_to_hf(cfg)


LLAMA_4_SCALING_BETA = 0.1
"""Ministral3Config's default llama_4_scaling_beta (with its default YaRN)."""


@register_family
class Ministral3(Family):
    name = "ministral3"
    architecture = "Ministral3ForCausalLM"
    model_type = "ministral3"
    # Ministral 3 3B, 8B and 14B are published with a vision tower; the text decoder as
    # transformers saves it: under language_model.model., its head language_model.lm_head.
    multimodal = Multimodal(
        architecture="Mistral3ForConditionalGeneration",
        model_type="mistral3",
        prefixes=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
        text_model_type="ministral3",
    )
    hf_defaults = {"max_position_embeddings": 262144, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    hf_constants = {}  # Ministral3Config has no bias flags

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        # As Mistral: a window applies to every layer, or none.
        return ["full_attention" if hf.get("sliding_window") is None else "sliding_attention"] * num_layers

    def rope_parameters(self, hf: dict) -> dict:
        """The file's RoPE dict, or Ministral3Config's default (YaRN x16 from 16K, beta 0.1)."""
        rope = hf.get("rope_parameters") or hf.get("rope_scaling")
        if rope is None:
            return {
                "rope_type": "yarn",
                "rope_theta": 1000000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 16384,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": LLAMA_4_SCALING_BETA,
            }
        return {"rope_theta": hf.get("rope_theta", 1000000.0), **rope}

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        return super().rope_from_hf({**hf, "rope_parameters": self.rope_parameters(hf)}, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        rope = self.rope_parameters(hf)
        beta = rope.get("llama_4_scaling_beta")
        if beta is None or rope.get("original_max_position_embeddings") is None:
            raise ConfigError(
                f"config.json ({self.architecture}): rope_parameters needs llama_4_scaling_beta and "
                "original_max_position_embeddings (the query scale's strength and period)"
            )
        return {"query_position_scale": float(beta)}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = all(cfg.layer_is_local())
        rope_parameters = rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling)
        rope_scaling = rope_to_hf(cfg.rope.scaling)
        if cfg.attention.query_position_scale is not None:  # (else the round trip names the field)
            # in both: transformers builds rope_parameters from the older rope_scaling when given
            beta = {"llama_4_scaling_beta": cfg.attention.query_position_scale}
            rope_parameters, rope_scaling = {**rope_parameters, **beta}, {**(rope_scaling or {}), **beta}
        return {
            "sliding_window": cfg.attention.sliding_window if local else None,
            "rope_parameters": rope_parameters,
            "rope_scaling": rope_scaling,
        }

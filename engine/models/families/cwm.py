"""CWM (CwmForCausalLM; facebook/cwm, 32B): Llama with a sliding window on three layers of
every four, Llama 3's RoPE scaling.

transformers' CwmConfig marks the layers by `layer_types` (by default layer 0 of every four
full, the rest sliding over `sliding_window` 8,192 positions: ModelConfig.attention_pattern
global, local, local, local); its attention is Llama's with no biases.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import Family, layer_types_to_hf, register_family

DEFAULT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 1000000.0,
    "factor": 16.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}
"""transformers' CwmConfig RoPE where config.json has none."""


@register_family
class Cwm(Family):
    name = "cwm"
    architecture = "CwmForCausalLM"
    model_type = "cwm"
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "sliding_window": 8192,
    }
    required_token_ids = {"bos_token_id": 128000}  # CwmConfig's default (Llama 3's <|begin_of_text|>)
    unsupported_flags = ("mlp_bias",)
    hf_constants = {"mlp_bias": False, "pretraining_tp": 1}  # CwmConfig has no attention_bias

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("rope_parameters") is None and hf.get("rope_theta") is None and hf.get("rope_scaling") is None:
            hf = {**hf, "rope_parameters": DEFAULT_ROPE}
        return super().rope_from_hf(hf, where)

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return layer_types_to_hf(cfg)

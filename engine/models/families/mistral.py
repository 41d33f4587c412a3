"""Mistral (MistralForCausalLM): Llama with one sliding window for all layers, or none."""

from __future__ import annotations

from typing import Any

from engine.models.families.base import Family, register_family


@register_family
class Mistral(Family):
    name = "mistral"
    architecture = "MistralForCausalLM"
    model_type = "mistral"
    hf_defaults = {"max_position_embeddings": 131072, "tie_word_embeddings": False}
    hf_constants = {}  # MistralConfig has no bias flags: its layers never have biases

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        # A window applies to every layer; `layer_types` is not a Mistral key.
        kind = "full_attention" if hf.get("sliding_window") is None else "sliding_attention"
        return [kind] * num_layers

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        # Only an all-local pattern is expressible; anything else exports without a window
        # and the round trip names the field.
        return {"sliding_window": cfg.attention.sliding_window if all(cfg.layer_is_local()) else None}

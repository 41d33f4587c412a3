"""SmolLM3 (SmolLM3ForCausalLM): Llama with NoPE layers.

Every `no_rope_layer_interval`-th layer (every fourth by default) leaves queries and keys
unrotated: transformers' `no_rope_layers` holds 1 for a RoPE layer and 0 for a NoPE one
(ModelConfig.rope.pattern). A sliding window, where `use_sliding_window` is set, applies to
the layers `layer_types` marks sliding (by default the NoPE ones).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import Family, register_family, shortest_period


@register_family
class SmolLM3(Family):
    name = "smollm3"
    architecture = "SmolLM3ForCausalLM"
    model_type = "smollm3"
    hf_defaults = {
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rope_theta": 2_000_000.0,
        "no_rope_layer_interval": 4,
    }
    hf_constants = {"attention_bias": False, "mlp_bias": False}

    def rope_layers(self, hf: dict, where: str) -> list[bool]:
        """Per layer: does it use RoPE? transformers' no_rope_layers, or its interval rule."""
        layers = hf["num_hidden_layers"]
        flags = hf.get("no_rope_layers")
        if flags is None:
            interval = self.hf_value(hf, "no_rope_layer_interval")
            return [(i + 1) % interval != 0 for i in range(layers)]
        if len(flags) != layers:
            raise ConfigError(f"{where}: no_rope_layers has {len(flags)} entries for {layers} layers")
        return [bool(x) for x in flags]

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
            return ["full_attention"] * num_layers
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        rope = self.rope_layers(hf, "config.json")
        return ["full_attention" if x else "sliding_attention" for x in rope]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        rope = self.rope_layers(hf, f"config.json ({self.architecture})")
        return {"rope_pattern": None if all(rope) else shortest_period(rope)}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = cfg.layer_is_local()
        rope = [layer.rope for layer in cfg.layer_pattern()]
        interval = next(
            (n for n in range(2, cfg.num_layers + 2) if rope == [(i + 1) % n != 0 for i in range(cfg.num_layers)]), None
        )
        return {
            "no_rope_layers": [int(x) for x in rope],
            "no_rope_layer_interval": interval or self.hf_defaults["no_rope_layer_interval"],
            "use_sliding_window": any(local),
            "sliding_window": cfg.attention.sliding_window,
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
        }

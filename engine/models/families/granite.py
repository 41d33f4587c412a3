"""Granite 3 (GraniteForCausalLM) and Granite SWA (GraniteSWAForCausalLM): Llama with IBM's
multipliers, and the second with sliding windows, attention sinks and NoPE layers.

Granite: token embeddings times embedding_multiplier, each sublayer's output times
residual_multiplier before the residual add, attention scores times attention_multiplier
(which replaces head_dim^-0.5: ModelConfig.attention.scale is always set), logits divided by
logits_scaling (the ModelConfig fields of those names; 1.0 is None).

Granite SWA adds, per layer, a sliding window (`layer_types`), a learned sink logit per head
in the softmax's denominator (`self_attn.sinks`, ModelConfig.attention.sinks; transformers
scales the output by sigmoid(logsumexp(scores) - sink), the same number) and a RoPE base
(`layer_rope_theta`, 0 for a NoPE layer). The engine has one base for global layers and
one for local ones: the layers of each kind that rotate must share it, and RoPE scaling,
where set, must leave the local base equal to the global one.
"""

from __future__ import annotations

from typing import Any

from engine import flat_keys
from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    layer_types_to_hf,
    register_family,
    shortest_period,
)

MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
"""config.json keys that are the ModelConfig fields of the same name, 1.0 meaning None."""


@register_family
class Granite(Family):
    name = "granite"
    architecture = "GraniteForCausalLM"
    model_type = "granite"
    hf_defaults = {
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "attention_multiplier": 1.0,
    }
    hf_constants = {"attention_bias": False, "mlp_bias": False}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        multipliers = {}
        for key in MULTIPLIERS:
            value = float(self.hf_value(hf, key, 1.0))
            multipliers[key] = None if value == 1.0 else value
        return {"attention_scale": float(self.hf_value(hf, "attention_multiplier")), **multipliers}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        # attention_scale None (head_dim^-0.5) has no Granite spelling: the round trip refuses it.
        return {
            "attention_multiplier": cfg.attention.scale,
            **{key: flat_keys.value(cfg, key) or 1.0 for key in MULTIPLIERS},
        }


@register_family
class GraniteSWA(Granite):
    name = "granite_swa"
    architecture = "GraniteSWAForCausalLM"
    model_type = "granite_swa"
    fixed = {"attention_sinks": True}
    hf_defaults = {
        **Granite.hf_defaults,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "sliding_window": 128,
    }

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]

    def _layer_thetas(self, hf: dict, theta: float, where: str) -> list[float]:
        layers = hf["num_hidden_layers"]
        thetas = hf.get("layer_rope_theta")
        if thetas is None:
            return [theta] * layers
        if len(thetas) != layers:
            raise ConfigError(f"{where}: layer_rope_theta has {len(thetas)} entries for {layers} layers")
        return [float(t) for t in thetas]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = super().rope_from_hf(hf, where)
        local = [t == "sliding_attention" for t in self.layer_types(hf, hf["num_hidden_layers"])]
        thetas = self._layer_thetas(hf, rope["rope_theta"], where)
        bases = {kind: {t for t, x in zip(thetas, local, strict=True) if t and x == kind} for kind in (False, True)}
        if len(bases[False]) > 1 or len(bases[True]) > 1:
            raise ConfigError(
                f"{where}: layer_rope_theta gives the rotating layers of one kind (sliding or full attention) "
                "more than one RoPE base; only one base per kind is supported"
            )
        global_theta = next(iter(bases[False]), rope["rope_theta"])
        local_theta = next(iter(bases[True]), global_theta)
        if local_theta != global_theta and rope["rope_scaling"] is not None:
            raise ConfigError(f"{where}: RoPE scaling with a sliding-window layers' base of their own is not supported")
        rotates = [bool(t) for t in thetas]
        return {
            **rope,
            "rope_theta": global_theta,
            "rope_local_theta": None if local_theta == global_theta else local_theta,
            "rope_pattern": None if all(rotates) else shortest_period(rotates),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local_theta = cfg.rope.local_theta or cfg.rope.theta
        thetas = [
            (local_theta if layer.local else cfg.rope.theta) if layer.rope else 0.0 for layer in cfg.layer_pattern()
        ]
        window = {"sliding_window": cfg.attention.sliding_window or self.hf_defaults["sliding_window"]}
        return {**super().extra_hf_keys(cfg), **layer_types_to_hf(cfg), **window, "layer_rope_theta": thetas}

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return [TensorSpec(("attn", "sinks_n"), LAYER + "self_attn.sinks", None)]

"""Poolside's Laguna (LagunaForCausalLM, model_type laguna; poolside/laguna-XS.2): grouped-query
attention with a QK norm and a softplus gate per head, over DeepSeek-V3's sigmoid router.

Its attention differs by layer type (`layer_types`): sliding-window layers and full ones, each
with a RoPE of its own (`rope_parameters` keyed by layer type: by default the full layers
rotate half of each head at base 500000, the sliding ones all of it at base 10000:
ModelConfig.rope.theta / rotary_dim and rope.local_theta / local_rotary_dim). Each head's
output is multiplied by softplus(x . w), a scalar per head from the layer's input (`g_proj`,
ModelConfig.attention.head_gate with head_gate_activation softplus). The layers
`mlp_layer_types` marks dense (by default the first) have a gated MLP of intermediate_size, the
rest a mixture of experts chosen by sigmoid scores of the (optionally tanh-capped:
moe_router_logit_softcapping, ModelConfig.moe.router_softcap) router logits plus a choosing
bias, the chosen weights renormalised and scaled by moe_routed_scaling_factor, beside one
shared expert of shared_expert_intermediate_size. Checkpoints keep the choosing bias as
`mlp.experts.e_score_correction_bias` and the shared expert as `mlp.shared_expert`, and one
tensor per expert.

Refused in one sentence: per-layer head counts that differ (`num_attention_heads_per_layer`),
a gate per head and dimension (`gating: per-element`), the router weight on the experts' input
(`moe_apply_router_weight_on_input`, which transformers refuses too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    TensorSpec,
    layer_types_to_hf,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
)
from engine.models.families.routed_gqa import RoutedGqa, ffn_fields, mlp_layer_types

NAMES = {
    "mlp.gate.e_score_correction_bias": "mlp.experts.e_score_correction_bias",
    "mlp.shared_experts.": "mlp.shared_expert.",
}
"""DeepSeek-V3's names (families/deepseek.py) -> Laguna's checkpoints'."""

DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}
"""LagunaConfig's rope_parameters where a config.json has none."""


def _fraction(rotary: int, head_dim: int) -> float:
    """partial_rotary_factor giving int(head_dim * factor) == rotary (transformers' rounding)."""
    fraction = rotary / head_dim
    return fraction if int(head_dim * fraction) == rotary else (rotary + 0.5) / head_dim


@register_family
class Laguna(RoutedGqa):
    name = "laguna"
    architecture = "LagunaForCausalLM"
    model_type = "laguna"
    fixed = {
        **RoutedGqa.fixed,
        "qk_norm": True,
        "router_renormalize": True,
        "num_shared_experts": 1,
        "attention_head_gate": True,
        "attention_head_gate_activation": "softplus",
    }
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "head_dim": 128,
        "sliding_window": 512,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "moe_routed_scaling_factor": 1.0,
        "moe_router_logit_softcapping": 0.0,
        "gating": True,
    }
    unsupported_flags = ("attention_bias", "moe_apply_router_weight_on_input")
    hf_constants = {
        "attention_bias": False,
        "moe_apply_router_weight_on_input": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "gating": True,
    }

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        return hf.get("layer_types") or ["full_attention"] * num_layers

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        heads = hf.get("num_attention_heads_per_layer")
        if heads is not None and any(n != hf.get("num_attention_heads") for n in heads):
            raise ConfigError(
                f"{where}: num_attention_heads_per_layer must give every layer num_attention_heads "
                f"({hf.get('num_attention_heads')}) heads, got {heads}"
            )
        gating = self.hf_value(hf, "gating")
        if gating not in (True, "per-head"):
            raise ConfigError(f"{where}: gating {gating!r} is not supported (true or 'per-head': a gate per head)")
        return super().config_from_hf(hf, where)

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or DEFAULT_ROPE
        head_dim = self.hf_value(hf, "head_dim")
        found = {}
        for kind in ("full_attention", "sliding_attention"):
            params = rope.get(kind)
            if not isinstance(params, dict):
                raise ConfigError(f"{where}: rope_parameters must have a {kind} entry (RoPE per layer type)")
            theta, scaling = rope_from_hf({k: v for k, v in params.items() if k != "partial_rotary_factor"}, where)
            if scaling is not None:
                raise ConfigError(f"{where}: rope_parameters.{kind}: only the default RoPE is supported")
            found[kind] = theta, int(head_dim * params.get("partial_rotary_factor", 1.0))
        (theta, rotary), (local_theta, local_rotary) = found["full_attention"], found["sliding_attention"]
        if rotary % 2 or local_rotary % 2:
            raise ConfigError(f"{where}: partial_rotary_factor must rotate an even number of head_dim's dimensions")
        return {
            "rope_theta": theta,
            "rope_scaling": None,
            "rope_local_theta": local_theta,
            "rotary_dim": None if rotary == head_dim else rotary,
            "local_rotary_dim": None if local_rotary == rotary else local_rotary,
        }

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        softcap = self.hf_value(hf, "moe_router_logit_softcapping")
        return {
            "head_dim": self.hf_value(hf, "head_dim"),
            "num_experts": self.hf_value(hf, "num_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "shared_expert_mlp_dim": self.hf_value(hf, "shared_expert_intermediate_size"),
            "router_scale": float(self.hf_value(hf, "moe_routed_scaling_factor")),
            "router_softcap": float(softcap) if softcap > 0 else None,
            **ffn_fields([t == "sparse" for t in types]),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        head_dim = cfg.attention.head_dim
        rotary = cfg.rope.rotary_dim or head_dim
        local_rotary = cfg.rope.local_rotary_dim or rotary
        rope = {
            "full_attention": {
                "rope_type": "default",
                "rope_theta": cfg.rope.theta,
                "partial_rotary_factor": _fraction(rotary, head_dim),
            },
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": cfg.rope.local_theta or cfg.rope.theta,
                "partial_rotary_factor": _fraction(local_rotary, head_dim),
            },
        }
        return {
            **layer_types_to_hf(cfg),
            "sliding_window": cfg.attention.sliding_window or self.hf_defaults["sliding_window"],
            "num_attention_heads_per_layer": [cfg.attention.num_heads] * cfg.num_layers,
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "shared_expert_intermediate_size": cfg.shared_mlp_dim,
            "moe_routed_scaling_factor": cfg.moe.router_scale,
            "moe_router_logit_softcapping": cfg.moe.router_softcap or 0.0,
            "mlp_layer_types": mlp_layer_types(cfg),
            "rope_parameters": rope,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        # transformers 4's keys: LagunaConfig keeps RoPE per layer type in rope_parameters only
        del hf["rope_theta"], hf["rope_scaling"]
        return hf

    def extra_attention_tensors(self) -> list[TensorSpec]:
        gate = TensorSpec(("attn", "w_head_gate_dn"), LAYER + "self_attn.g_proj.weight", 1)
        return [*qk_norm_tensors(), gate]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        specs = []
        for spec in super().mlp_tensors(cfg):
            name = spec.hf_name.removeprefix(LAYER)
            for ours, theirs in NAMES.items():
                name = name.replace(ours, theirs)
            specs.append(dataclasses.replace(spec, hf_name=LAYER + name))
        return specs

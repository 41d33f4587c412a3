"""Granite 3.0 mixtures of experts (GraniteMoeForCausalLM: granite-3.0-1b-a400m, -3b-a800m,
PowerMoE), with a shared MLP (GraniteMoeSharedForCausalLM), and with sliding windows, sinks
and per-layer RoPE (GraniteMoeSWAForCausalLM).

Llama's attention and pre-norms with Granite's multipliers (embeddings times
embedding_multiplier, each sublayer's output times residual_multiplier before the residual
add, attention scores times attention_multiplier instead of head_dim^-0.5, logits divided by
logits_scaling); every layer's feed-forward is num_local_experts experts of intermediate_size,
each token's top-k weighted by a softmax over its k router logits (the engine's renormalised
softmax), stored stacked: gate and up in one (E, 2f, d) tensor, down (E, d, f). The shared
MLP (shared_intermediate_size; 0: none) is a shared expert without a gate, gate and up
fused in shared_mlp.input_linear (Granite 4's, granite_hybrid.py). GraniteMoeSWA adds a
learned sink logit per head (ModelConfig.attention.sinks, GPT-OSS's), sliding-window layers
(layer_types; by default every fourth layer from the first global, the rest local) and a RoPE
base per layer, layer_rope_theta, 0 meaning NoPE (rope_pattern): the global layers' bases must
be one value and the local layers' another (rope_local_theta). GraniteMoe(Shared) checkpoints
name the experts input_linear / output_linear and the router router.layer; GraniteMoeSWA's
are transformers' own names (experts.gate_up_proj, experts.down_proj, router.weight), as
transformers saves them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

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
from engine.models.families.granite_hybrid import MULTIPLIERS, _experts

MOE = LAYER + "block_sparse_moe."


def _base(theta) -> bool:
    """A layer_rope_theta entry: a RoPE base, or 0 for none."""
    return isinstance(theta, int | float) and not isinstance(theta, bool) and theta >= 0


class _GraniteMoe(Family):
    """Llama with Granite's multipliers and stacked softmax-over-top-k experts."""

    moe = True
    shared_mlp: ClassVar[bool] = False
    """The class has the shared MLP (shared_intermediate_size)."""
    fixed = {"router_score": "softmax", "router_renormalize": True}  # softmax over the top-k logits
    hf_defaults = {
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "attention_multiplier": 1.0,
        "shared_intermediate_size": 0,
    }
    unsupported_flags = ("attention_bias",)
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {"attention_bias": False, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        where = f"config.json ({self.architecture})"
        experts = self.hf_value(hf, "num_local_experts")
        if not experts:
            raise ConfigError(f"{where}: num_local_experts must be > 0 ({self.name} is a mixture of experts)")
        fields: dict[str, Any] = {
            "num_experts": experts,
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "attention_scale": float(self.hf_value(hf, "attention_multiplier")),
        }
        for key in MULTIPLIERS:
            value = float(self.hf_value(hf, key, 1.0))
            fields[key] = None if value == 1.0 else value
        shared = self.hf_value(hf, "shared_intermediate_size") if self.shared_mlp else 0
        if shared:
            width = hf["intermediate_size"]
            fields.update(num_shared_experts=1, shared_expert_mlp_dim=None if shared == width else shared)
        return fields

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = {
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "attention_multiplier": cfg.attention.scale,
            **{key: flat_keys.value(cfg, key) or 1.0 for key in MULTIPLIERS},
        }
        if self.shared_mlp:
            hf["shared_intermediate_size"] = cfg.shared_mlp_dim
        return hf

    def expert_tensors(self) -> list[TensorSpec]:
        """The router and the stacked experts (Granite 4's names)."""
        return _experts()

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        specs = self.expert_tensors()
        if cfg.moe.num_shared_experts:
            specs += [
                TensorSpec(
                    ("mlp", "w_shared_gate_dg"),
                    LAYER + "shared_mlp.input_linear.weight",
                    1,
                    fused_with=(("mlp", "w_shared_up_dg"),),
                ),
                TensorSpec(("mlp", "w_shared_down_gd"), LAYER + "shared_mlp.output_linear.weight", 1),
            ]
        return specs


@register_family
class GraniteMoe(_GraniteMoe):
    name = "granitemoe"
    architecture = "GraniteMoeForCausalLM"
    model_type = "granitemoe"


@register_family
class GraniteMoeShared(_GraniteMoe):
    name = "granitemoeshared"
    architecture = "GraniteMoeSharedForCausalLM"
    model_type = "granitemoeshared"
    shared_mlp = True


@register_family
class GraniteMoeSWA(_GraniteMoe):
    name = "granitemoe_swa"
    architecture = "GraniteMoeSWAForCausalLM"
    model_type = "granitemoe_swa"
    shared_mlp = True
    fixed = {**_GraniteMoe.fixed, "attention_sinks": True}
    hf_defaults = {**_GraniteMoe.hf_defaults, "sliding_window": 128}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        return ["full_attention" if i % 4 == 0 else "sliding_attention" for i in range(num_layers)]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = super().rope_from_hf(hf, where)
        layers = hf["num_hidden_layers"]
        thetas = hf.get("layer_rope_theta") or [rope["rope_theta"]] * layers
        if not isinstance(thetas, list) or len(thetas) != layers or any(not _base(t) for t in thetas):
            raise ConfigError(f"{where}: layer_rope_theta must give {layers} RoPE bases >= 0 (0: no RoPE)")
        local = [t == "sliding_attention" for t in self.layer_types(hf, layers)]
        bases = {kind: {float(t) for t, x in zip(thetas, local, strict=False) if t and x == kind} for kind in (0, 1)}
        if len(bases[0]) > 1 or len(bases[1]) > 1:
            raise ConfigError(
                f"{where}: layer_rope_theta {thetas} is not supported: the global layers' nonzero bases must be "
                "one value and the sliding layers' another"
            )
        theta = next(iter(bases[0]), rope["rope_theta"])
        local_theta = next(iter(bases[1]), theta)
        if local_theta != theta and rope["rope_scaling"] is not None:
            raise ConfigError(
                f"{where}: sliding layers with a RoPE base of their own and rope scaling are not supported"
            )
        uses_rope = [bool(t) for t in thetas]
        return {
            "rope_theta": theta,
            "rope_scaling": rope["rope_scaling"],
            "rope_local_theta": None if local_theta == theta else local_theta,
            "rope_pattern": None if all(uses_rope) else shortest_period(uses_rope),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        pattern = cfg.rope.pattern or [True]
        local_theta = cfg.rope.local_theta or cfg.rope.theta
        thetas = [
            (local_theta if local else cfg.rope.theta) if pattern[i % len(pattern)] else 0
            for i, local in enumerate(cfg.layer_is_local())
        ]
        windows = layer_types_to_hf(cfg)
        return {
            **super().extra_hf_keys(cfg),
            **windows,
            "sliding_window": windows["sliding_window"] or self.hf_defaults["sliding_window"],
            "layer_rope_theta": thetas,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [*super().attention_tensors(cfg), TensorSpec(("attn", "sinks_n"), LAYER + "self_attn.sinks", None)]

    def expert_tensors(self) -> list[TensorSpec]:
        granite4 = {spec.path: spec for spec in _experts()}
        return [
            TensorSpec(("mlp", "w_router_de"), MOE + "router.weight", 1),
            dataclasses.replace(granite4[("mlp", "w_gate_edf")], hf_name=MOE + "experts.gate_up_proj"),
            dataclasses.replace(granite4[("mlp", "w_down_efd")], hf_name=MOE + "experts.down_proj"),
        ]

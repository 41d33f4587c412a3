"""Hy3 (HYV3ForCausalLM, model_type hy_v3; tencent/Hy3-preview): grouped-query attention with
a QK norm over DeepSeek-V3's mixture of experts.

The attention is Apertus's (Llama's with an RMSNorm over head_dim on queries and keys before
RoPE: ModelConfig.qk_norm); the layers `mlp_layer_types` marks dense (by default the first)
have a gated MLP of intermediate_size, the rest a mixture of experts chosen by sigmoid scores
plus a choosing bias, no groups, the chosen weights renormalised and scaled by
router_scaling_factor, beside shared experts as one gated MLP of num_shared_experts *
moe_intermediate_size (engine/models/moe.py). Checkpoints name the router
`mlp.router.gate`, the bias `mlp.expert_bias`, the shared experts `mlp.shared_mlp` and store
one tensor per expert, as transformers saves them; the multi-token-prediction layer after the
last (`model.layers.{num_hidden_layers}.`, which transformers skips) is skipped by conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, TensorSpec, qk_norm_tensors, register_family
from engine.models.families.routed_gqa import RoutedGqa, ffn_fields, mlp_layer_types

NAMES = {
    "mlp.gate.weight": "mlp.router.gate.weight",
    "mlp.gate.e_score_correction_bias": "mlp.expert_bias",
    "mlp.shared_experts.": "mlp.shared_mlp.",
}
"""DeepSeek-V3's names (families/deepseek.py) -> Hy3's checkpoints'."""


def published_keys(cfg: ModelConfig) -> dict[str, Any]:
    """Hy3-preview's config.json keys beside transformers': its expert width, QK norm, chosen
    weights renormalised, and the dense layers as a count (only where they are the first ones)."""
    dense = [kind == "dense" for kind in mlp_layer_types(cfg)]
    prefix = {"first_k_dense_replace": sum(dense)} if dense == [i < sum(dense) for i in range(len(dense))] else {}
    return {"expert_hidden_dim": cfg.moe_mlp_dim, "qk_norm": True, "route_norm": True, **prefix}


@register_family
class HYV3(RoutedGqa):
    name = "hy_v3"
    architecture = "HYV3ForCausalLM"
    model_type = "hy_v3"
    fixed = {**RoutedGqa.fixed, "qk_norm": True, "router_renormalize": True}
    experts_key = "num_experts"
    shared_key = "num_shared_experts"
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "num_experts": 192,
        "num_experts_per_tok": 8,
        "num_shared_experts": 1,
        "moe_intermediate_size": 1536,
        "router_scaling_factor": 2.826,
        "initializer_range": 0.006,
    }
    unsupported_flags = ("attention_bias", "mlp_bias")
    hf_constants = {
        "attention_bias": False,
        "mlp_bias": False,
        "output_router_logits": False,
        # the float32 sum of routed and shared experts: the engine adds them in its compute dtype
        "enable_moe_fp32_combine": True,
    }

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        return {
            "num_experts": self.hf_value(hf, "num_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "num_shared_experts": self.hf_value(hf, "num_shared_experts"),
            "router_scale": float(self.hf_value(hf, "router_scaling_factor")),
            **ffn_fields([t == "sparse" for t in types]),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "num_shared_experts": cfg.moe.num_shared_experts,
            "router_scaling_factor": cfg.moe.router_scale,
            "mlp_layer_types": mlp_layer_types(cfg),
            # the published config's keys, which vLLM 0.32's HYV3 reads (transformers 5 has others)
            **published_keys(cfg),
        }

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        specs = []
        for spec in super().mlp_tensors(cfg):
            name = spec.hf_name.removeprefix(LAYER)
            for ours, theirs in NAMES.items():
                name = name.replace(ours, theirs)
            specs.append(dataclasses.replace(spec, hf_name=LAYER + name))
        return specs

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return name.startswith(f"model.layers.{cfg.num_layers}.")  # the multi-token-prediction layer

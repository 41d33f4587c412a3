"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM, model_type glm4_moe_lite).

DeepSeek-V3's layers (families/deepseek.py): multi-head latent attention with compressed
queries and RoPE on adjacent pairs (rope_interleave), and GLM-4.5's mixture of experts, which
is DeepSeek-V3's (sigmoid scores, a choosing bias, group-limited top-k, renormalised and
scaled weights, shared experts). Which layers are dense is `mlp_layer_types` (by default the
first): the leading ones as first_dense_layers, any other mix as ffn_pattern.

The multi-token-prediction layer published checkpoints carry after the last layer
(`model.layers.{num_hidden_layers}.`, which transformers' class skips and has no module for)
is skipped by conversion.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import register_family
from engine.models.families.deepseek import DeepseekV3
from engine.models.families.routed_gqa import ffn_fields, mlp_layer_types


@register_family
class Glm4MoeLite(DeepseekV3):
    name = "glm4_moe_lite"
    architecture = "Glm4MoeLiteForCausalLM"
    model_type = "glm4_moe_lite"
    hf_defaults = {
        "max_position_embeddings": 202752,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "n_routed_experts": 64,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1536,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.8,
        "kv_lora_rank": 512,
        "q_lora_rank": 768,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "rope_interleave": True,
    }

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        return {**super().extra_fields_from_hf(hf), **ffn_fields([t == "sparse" for t in types]), "mtp_layers": 0}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = super().extra_hf_keys(cfg)
        # Glm4MoeLiteConfig has mlp_layer_types instead; published config.json files (and vLLM)
        # keep first_k_dense_replace, where the dense layers are the first ones
        dense = [t == "dense" for t in mlp_layer_types(cfg)]
        if dense != [i < sum(dense) for i in range(len(dense))]:
            del keys["first_k_dense_replace"]
        keys.pop("num_nextn_predict_layers", None)
        return {**keys, "mlp_layer_types": mlp_layer_types(cfg)}

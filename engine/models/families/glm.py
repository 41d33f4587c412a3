"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM, model_type glm4_moe).

Grouped-query attention with biases on q, k and v (attention_bias), optional QK norm
(use_qk_norm) and partial RoPE (partial_rotary_factor: the first half of each head rotated,
ModelConfig.rope.rotary_dim); the first first_k_dense_replace layers have a dense MLP (the
`dense_blocks` stack), the rest DeepSeek-V3's mixture of experts: sigmoid scores, a routing
bias that only chooses (e_score_correction_bias), group-limited top-k, renormalised and
scaled weights, shared experts. Checkpoints store one tensor per expert, as transformers
saves them; the multi-token-prediction layer published checkpoints carry after the last
layer (num_nextn_predict_layers) is ModelConfig.mtp_layers, converted and exported as
DeepSeek-V3's (families/base.py: mtp_tensors).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    mtp_copy,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
)
from engine.models.families.base import rope_parameters_to_hf as _rope_parameters
from engine.models.families.deepseek import routed_and_shared_experts


@register_family
class Glm4Moe(Family):
    name = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    model_type = "glm4_moe"
    moe = True
    fixed = {"router_score": "sigmoid", "router_bias": True}
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.5,
    }
    unsupported_flags = ()  # attention_bias is the q/k/v biases (qkv_bias)
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {"output_router_logits": False}

    def _partial_rotary_factor(self, hf: dict) -> float:
        return float(
            (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or self.hf_value(hf, "partial_rotary_factor")
        )

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        )
        rope.pop("partial_rotary_factor", None)  # rotary_dim, below
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = int(head_dim * self._partial_rotary_factor(hf))
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ConfigError(
                f"config.json ({self.architecture}): partial_rotary_factor gives {rotary} rotary dimensions of "
                f"head_dim {head_dim}; they must be even and at most head_dim"
            )
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        return {
            "rotary_dim": None if rotary == head_dim else rotary,
            "qkv_bias": bool(hf.get("attention_bias")),
            "qk_norm": bool(hf.get("use_qk_norm")),
            "num_experts": hf.get("n_routed_experts") or self.hf_defaults["n_routed_experts"],
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "num_shared_experts": self.hf_value(hf, "n_shared_experts"),
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
            "router_groups": self.hf_value(hf, "n_group"),
            "router_group_top": self.hf_value(hf, "topk_group"),
            "router_scale": float(self.hf_value(hf, "routed_scaling_factor")),
            "first_dense_layers": self.hf_value(hf, "first_k_dense_replace"),
            "mtp_layers": hf.get("num_nextn_predict_layers") or 0,
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        factor = (cfg.rope.rotary_dim or cfg.attention.head_dim) / cfg.attention.head_dim
        return {
            "rope_parameters": {
                **_rope_parameters(cfg.rope.theta, cfg.rope.scaling),
                "partial_rotary_factor": factor,
            },
            "partial_rotary_factor": factor,  # where published configs (and transformers 4) have it
            "attention_bias": cfg.attention.qkv_bias,
            "use_qk_norm": cfg.attention.qk_norm,
            "n_routed_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "n_shared_experts": cfg.moe.num_shared_experts,
            "norm_topk_prob": cfg.moe.router_renormalize,
            "n_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_group_top,
            "routed_scaling_factor": cfg.moe.router_scale,
            "first_k_dense_replace": cfg.moe.first_dense_layers,
            "num_nextn_predict_layers": cfg.mtp_layers,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        biases = [
            TensorSpec(
                ("attn", f"b{x}_{'nh' if x == 'q' else 'kh'}"), LAYER + f"self_attn.{x}_proj.bias", None, flatten=True
            )
            for x in "qkv"
        ]
        return [
            *super().attention_tensors(cfg),
            *(biases if cfg.attention.qkv_bias else []),
            *(qk_norm_tensors() if cfg.attention.qk_norm else []),
        ]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return routed_and_shared_experts()

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        # The multi-token-prediction layer's embedding and head copies (GLM-4.5 ships one layer).
        return mtp_copy(name, cfg)

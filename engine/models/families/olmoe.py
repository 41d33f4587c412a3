"""OLMoE (OlmoeForCausalLM) and FlexOlmo (FlexOlmoForCausalLM): softmax top-k mixtures of
experts as wide as intermediate_size (renormalised as norm_topk_prob says) with OLMo 2's QK
norm, one RMSNorm over all heads' dimensions of the projected queries (keys)
(qk_norm_across_heads). OLMoE keeps Llama's pre-norms; FlexOlmo has OLMo 2's norm placement,
x + norm(sublayer(x)) (pre_norms false, post_norms true). Checkpoints store one tensor per
expert (`experts.{j}.`), as transformers saves them.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, qk_norm_tensors, register_family
from engine.models.families.moe import _experts


@register_family
class Olmoe(Family):
    name = "olmoe"
    architecture = "OlmoeForCausalLM"
    model_type = "olmoe"
    moe = True
    fixed = {"qk_norm": True, "qk_norm_across_heads": True, "router_score": "softmax"}
    hf_defaults = {
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
    }
    unsupported_flags = ("attention_bias",)
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {
        "attention_bias": False,
        "clip_qkv": None,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.01,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("clip_qkv") is not None:
            raise ConfigError(f"{where}: clip_qkv={hf['clip_qkv']} is not supported (only null, no clamping)")
        head_dim, width, heads = hf.get("head_dim"), hf.get("hidden_size"), hf.get("num_attention_heads")
        if head_dim is not None and width is not None and heads is not None and head_dim * heads != width:
            # OlmoeAttention's q_norm is hidden_size wide: heads x head_dim must be hidden_size
            raise ConfigError(
                f"{where}: head_dim {head_dim} x num_attention_heads must be hidden_size ({width}) for {self.name}"
            )
        return super().config_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        # transformers 5 may write num_experts as num_local_experts (an attribute_map alias)
        experts = hf.get("num_experts") or self.hf_value(hf, "num_local_experts", self.hf_defaults["num_experts"])
        return {
            "num_experts": experts,
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "norm_topk_prob": cfg.moe.router_renormalize,
        }

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors(flatten=True)

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return _experts("mlp.", "gate_proj", "up_proj", "down_proj")


@register_family
class FlexOlmo(Olmoe):
    name = "flex_olmo"
    architecture = "FlexOlmoForCausalLM"
    model_type = "flex_olmo"
    fixed = {**Olmoe.fixed, "pre_norms": False, "post_norms": True}
    hf_defaults = {
        **Olmoe.hf_defaults,
        "rope_theta": 500_000.0,
        "rms_norm_eps": 1e-6,
        "num_experts": 7,
        "num_experts_per_tok": 5,
    }
    hf_constants = {k: v for k, v in Olmoe.hf_constants.items() if k != "clip_qkv"}  # FlexOlmoConfig has none

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        return Family.config_from_hf(self, hf, where)  # OLMo 2's attention: its norms fit any head_dim

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [spec for spec in super().attention_tensors(cfg) if spec.path[0] != "attn_norm"]

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec(("post_attn_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_feedforward_layernorm.weight", None),
        ]

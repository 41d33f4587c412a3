"""PhiMoE (PhimoeForCausalLM; microsoft/Phi-3.5-MoE-instruct): Mixtral's layers and tensor
names with LayerNorms (weight and bias, epsilon `rms_norm_eps`), q/k/v/o biases
(`attention_bias`), a bias on the LM head (`lm_head_bias`), and SparseMixer routing
(ModelConfig.moe.sparsemixer_eps from `router_jitter_noise`: engine/models/moe.py's
sparsemixer, transformers' inference path; its training-time sampling is not run).

LongRoPE (`rope_type: longrope`) as Phi-3's, its cos/sin scaled by `short_mscale` /
`long_mscale`, which must be equal (the engine's attention_factor for both regimes).
`input_jitter_noise` is training-only noise the engine does not add. LoRA: q/k/v/o.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, TensorSpec, register_family, rope_from_hf
from engine.models.families.gpt2 import layer_norm
from engine.models.families.moe import Mixtral


@register_family
class PhiMoE(Mixtral):
    name = "phimoe"
    architecture = "PhimoeForCausalLM"
    model_type = "phimoe"
    fixed = {**Mixtral.fixed, "norm_kind": "layer", "norm_bias": True}
    hf_defaults = {
        **Mixtral.hf_defaults,
        "rope_theta": 1_000_000.0,
        "num_local_experts": 16,
        "router_jitter_noise": 0.01,
    }
    unsupported_flags = ()
    hf_constants = {"output_router_logits": False, "router_aux_loss_coef": 0.001, "input_jitter_noise": 0.0}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        fields = super().config_from_hf({**hf, "router_jitter_noise": 0.0}, where)  # Mixtral's refusal: not here
        bias = bool(hf.get("attention_bias", False))
        return {
            **fields,
            "qkv_bias": bias,
            "attention_out_bias": bias,
            "lm_head_bias": bool(hf.get("lm_head_bias", False)),
            "router_sparsemixer_eps": self.hf_value(hf, "router_jitter_noise"),
        }

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta"), **(hf.get("rope_scaling") or {})}
        )
        if rope.get("rope_type", rope.get("type")) != "longrope":
            theta, scaling = rope_from_hf(rope, where)
            return {"rope_theta": theta, "rope_scaling": scaling}
        if rope.get("short_mscale") != rope.get("long_mscale"):
            raise ConfigError(
                f"{where}: rope short_mscale {rope.get('short_mscale')} and long_mscale {rope.get('long_mscale')} "
                "differ; only one scale for both is supported"
            )
        original = rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
        head_dim = hf["hidden_size"] // hf["num_attention_heads"]
        for key in ("short_factor", "long_factor"):
            if not isinstance(rope.get(key), list) or len(rope[key]) != head_dim // 2:
                raise ConfigError(f"{where}: rope {key} must list {head_dim // 2} numbers (one per rotated pair)")
        if not original:
            raise ConfigError(f"{where}: rope type 'longrope' needs original_max_position_embeddings")
        scaling = {
            "kind": "longrope",
            "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"],
            "original_max_position": original,
            "factor": self.hf_value(hf, "max_position_embeddings") / original,
            "attention_factor": rope.get("short_mscale"),
        }
        return {"rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        scaling = cfg.rope.scaling
        if scaling is not None and scaling.kind == "longrope":
            rope = {
                "rope_type": "longrope",
                "rope_theta": cfg.rope.theta,
                "short_factor": list(scaling.short_factor or []),
                "long_factor": list(scaling.long_factor or []),
                "short_mscale": scaling.attention_factor,
                "long_mscale": scaling.attention_factor,
                "original_max_position_embeddings": scaling.original_max_position,
            }
            hf["rope_parameters"], hf["rope_scaling"] = rope, {k: v for k, v in rope.items() if k != "rope_theta"}
        return {
            **hf,
            "attention_bias": cfg.attention.qkv_bias,
            "lm_head_bias": cfg.head.bias,
            "router_jitter_noise": cfg.moe.sparsemixer_eps,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        specs = [
            *layer_norm("attn_norm", LAYER + "input_layernorm"),
            *[s for s in super().attention_tensors(cfg) if s.path[0] != "attn_norm"],
        ]
        if cfg.attention.qkv_bias:
            specs += [
                TensorSpec(("attn", "bq_nh"), LAYER + "self_attn.q_proj.bias", None, flatten=True),
                TensorSpec(("attn", "bk_kh"), LAYER + "self_attn.k_proj.bias", None, flatten=True),
                TensorSpec(("attn", "bv_kh"), LAYER + "self_attn.v_proj.bias", None, flatten=True),
                TensorSpec(("attn", "bo_d"), LAYER + "self_attn.o_proj.bias", None),
            ]
        return specs

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return layer_norm("mlp_norm", LAYER + "post_attention_layernorm")

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        top = [s for s in top if s.path[0] != "final_norm"] + layer_norm("final_norm", "model.norm")
        if cfg.head.bias:
            top.append(TensorSpec(("lm_head_bias_v",), "lm_head.bias", None))
        return top, per_layer

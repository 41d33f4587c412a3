"""DeepSeek-V3 (DeepseekV3ForCausalLM; Kimi K2 is this architecture) and DeepSeek-V2
(DeepseekV2ForCausalLM, below: the softmax router).

Multi-head latent attention (engine/models/mla.py) in every layer; the first
first_k_dense_replace layers have a dense MLP and form their own layer stack (`dense_blocks`),
the rest a mixture of experts: sigmoid scores, a routing bias that only chooses
(e_score_correction_bias), group-limited top-k (n_group, topk_group), the chosen weights
renormalised (norm_topk_prob) and scaled (routed_scaling_factor), plus shared experts.
Checkpoints store one tensor per expert (`experts.{j}.`), as transformers saves them.

The multi-token-prediction layer published checkpoints carry after the last layer
(num_nextn_predict_layers, `model.layers.{num_hidden_layers}.`; transformers' MtpModel) is
ModelConfig.mtp_layers: converted and exported with the rest (base.mtp_tensors), or left
out by conversion when the checkpoint has none (transformers' save_pretrained writes none).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import EXPERT, LAYER, Family, TensorSpec, mtp_copy, mtp_tensors, register_family


def _attention(stack: str, q_lora: bool) -> list[TensorSpec]:
    """The norms and the latent attention of one layer of `stack`."""
    attn = LAYER + "self_attn."
    if q_lora:
        query = [
            TensorSpec(("attn", "wq_a_dq"), attn + "q_a_proj.weight", 1, stack=stack),
            TensorSpec(("attn", "q_norm", "scale"), attn + "q_a_layernorm.weight", None, stack=stack),
            TensorSpec(("attn", "wq_b_qnh"), attn + "q_b_proj.weight", 1, stack=stack),
        ]
    else:
        query = [TensorSpec(("attn", "wq_dnh"), attn + "q_proj.weight", 1, stack=stack)]
    return [
        TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None, stack=stack),
        *query,
        TensorSpec(("attn", "wkv_a_dx"), attn + "kv_a_proj_with_mqa.weight", 1, stack=stack),
        TensorSpec(("attn", "kv_norm", "scale"), attn + "kv_a_layernorm.weight", None, stack=stack),
        TensorSpec(("attn", "wkv_b_cny"), attn + "kv_b_proj.weight", 1, stack=stack),
        TensorSpec(("attn", "wo_nwd"), attn + "o_proj.weight", 2, stack=stack),
        TensorSpec(("mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", None, stack=stack),
    ]


def _dense_mlp() -> list[TensorSpec]:
    return [
        TensorSpec(("mlp", f"w_{x}_{dims}"), LAYER + f"mlp.{x}_proj.weight", 1, stack="dense_blocks")
        for x, dims in (("gate", "df"), ("up", "df"), ("down", "fd"))
    ]


def routed_and_shared_experts(bias: bool = True) -> list[TensorSpec]:
    """A DeepSeek-style mixture of experts: the router, its score bias (DeepSeek-V3's sigmoid
    router; not `bias`: DeepSeek-V2's softmax one has none), the experts (one tensor each) and
    the shared experts (also GLM-4.5's, families/glm.py)."""
    expert, shared = LAYER + "mlp." + EXPERT, LAYER + "mlp.shared_experts."
    return [
        TensorSpec(("mlp", "w_router_de"), LAYER + "mlp.gate.weight", 1),
        *([TensorSpec(("mlp", "b_router_e"), LAYER + "mlp.gate.e_score_correction_bias", None)] if bias else []),
        *(
            TensorSpec(("mlp", f"w_{x}_{dims}"), expert + f"{x}_proj.weight", 1, experts=True)
            for x, dims in (("gate", "edf"), ("up", "edf"), ("down", "efd"))
        ),
        *(
            TensorSpec(("mlp", f"w_shared_{x}_{dims}"), shared + f"{x}_proj.weight", 1)
            for x, dims in (("gate", "dg"), ("up", "dg"), ("down", "gd"))
        ),
    ]


@register_family
class DeepseekV3(Family):
    name = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    model_type = "deepseek_v3"
    moe = True
    fixed = {"router_score": "sigmoid", "router_bias": True}
    hf_defaults = {
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "rope_interleave": True,
    }
    unsupported_flags: ClassVar[tuple[str, ...]] = ("attention_bias",)
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {
        "attention_bias": False,
        "pretraining_tp": 1,
        "output_router_logits": False,
    }

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        nope, rope = self.hf_value(hf, "qk_nope_head_dim"), self.hf_value(hf, "qk_rope_head_dim")
        expert_mlp_dim, value_dim = self.hf_value(hf, "moe_intermediate_size"), self.hf_value(hf, "v_head_dim")
        return {
            # MLA has no key-value heads: transformers' num_key_value_heads must equal the heads
            "num_kv_heads": hf["num_attention_heads"],
            "head_dim": nope + rope,
            "rope_head_dim": rope,
            "v_head_dim": None if value_dim == nope + rope else value_dim,
            "kv_lora_rank": self.hf_value(hf, "kv_lora_rank"),
            # null is DeepSeek-V2-Lite's "no query compression", not "the default"
            "q_lora_rank": hf["q_lora_rank"] if "q_lora_rank" in hf else self.hf_defaults["q_lora_rank"],
            "rope_interleave": bool(self.hf_value(hf, "rope_interleave")),
            "num_experts": (
                hf.get("n_routed_experts") or hf.get("num_local_experts") or self.hf_defaults["n_routed_experts"]
            ),
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
        # DeepseekV3Config's key (its num_mtp_layers); a subclass whose config class lacks it
        # (DeepSeek-V3.2's, GLM-5's) writes it only for a model that has the layer
        mtp = {"num_nextn_predict_layers": cfg.mtp_layers} if cfg.mtp_layers or type(self) is DeepseekV3 else {}
        return {
            **mtp,
            "head_dim": cfg.mla.rope_head_dim,
            "qk_head_dim": cfg.attention.head_dim,  # as transformers writes them
            "qk_nope_head_dim": cfg.attention.head_dim - cfg.mla.rope_head_dim,
            "qk_rope_head_dim": cfg.mla.rope_head_dim,
            "v_head_dim": cfg.value_head_dim,
            "kv_lora_rank": cfg.mla.kv_lora_rank,
            "q_lora_rank": cfg.mla.q_lora_rank,
            "rope_interleave": cfg.rope.interleave,
            "n_routed_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "n_shared_experts": cfg.moe.num_shared_experts,
            "norm_topk_prob": cfg.moe.router_renormalize,
            "n_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_group_top,
            "routed_scaling_factor": cfg.moe.router_scale,
            "first_k_dense_replace": cfg.moe.first_dense_layers,
            # DeepSeek's own keys, which published config.json files carry and transformers 5
            # drops: vLLM builds the score bias only for noaux_tc and scores by softmax without
            # scoring_func (a KeyError on the bias at load)
            "topk_method": "noaux_tc" if cfg.moe.router_bias else "greedy",
            "scoring_func": cfg.moe.router_score,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        per_layer = []
        for stack, _ in cfg.layer_stacks():
            per_layer += _attention(stack, cfg.mla.q_lora_rank is not None)
            mlp = _dense_mlp() if stack.endswith("dense_blocks") else routed_and_shared_experts(cfg.moe.router_bias)
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in mlp]  # (GLM-5's index_shared_ too)
        mtp_top, mtp_layer = mtp_tensors(cfg, per_layer)
        return top + mtp_top, per_layer + mtp_layer

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        # The multi-token-prediction layer's copies of the embedding and head (DeepSeek-V3 and R1
        # ship one layer, num_nextn_predict_layers: 1), or all of it where the config has none;
        # any other extra layer is a config/weights mismatch convert names.
        return mtp_copy(name, cfg)


@register_family
class DeepseekV2(DeepseekV3):
    """DeepSeek-V2 and V2-Lite (DeepseekV2ForCausalLM): DeepSeek-V3's layers with a softmax
    router and no score bias, the k weights not renormalised (transformers' class ignores
    norm_topk_prob) but scaled by routed_scaling_factor, and either plain top-k (topk_method
    greedy) or group-limited top-k whose groups are scored by their best expert
    (group_limited_greedy; DeepSeek-V3 sums the two best). RoPE always rotates adjacent pairs."""

    name = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    model_type = "deepseek_v2"
    fixed = {
        "router_score": "softmax",
        "router_bias": False,
        "router_renormalize": False,
        "router_group_score": "max",
        "rope_interleave": True,
    }
    hf_defaults = {
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "n_routed_experts": 64,
        "num_experts_per_tok": 6,  # transformers' is None (which it cannot run); V2's and V2-Lite's
        "moe_intermediate_size": 1407,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "first_k_dense_replace": 0,
        "topk_method": "greedy",
        "norm_topk_prob": False,
        "rope_interleave": True,
    }
    unsupported_flags = ("attention_bias", "mlp_bias")
    hf_constants = {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1, "output_router_logits": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # Keys of DeepSeek's own code that transformers' class ignores: only the values it runs.
        method = self.hf_value(hf, "topk_method")
        if method not in ("greedy", "group_limited_greedy"):
            raise ConfigError(f"{where}: topk_method '{method}' is not supported (greedy, group_limited_greedy)")
        for key, value in (("norm_topk_prob", False), ("moe_layer_freq", 1), ("scoring_func", "softmax")):
            if hf.get(key) not in (None, value):
                raise ConfigError(
                    f"{where}: {key}={hf[key]!r} is not supported ({self.architecture} runs {key}={value!r})"
                )
        return super().config_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        fields = super().extra_fields_from_hf(hf)
        grouped = self.hf_value(hf, "topk_method") == "group_limited_greedy"
        fields.pop("rope_interleave")  # fixed: always adjacent pairs
        return {
            **fields,
            "router_renormalize": False,
            "router_groups": hf["n_group"] if grouped else 1,
            "router_group_top": hf["topk_group"] if grouped else 1,
            "mtp_layers": 0,
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = super().extra_hf_keys(cfg)
        del keys["rope_interleave"]
        grouped = cfg.moe.router_groups > 1
        return {
            **keys,
            "topk_method": "group_limited_greedy" if grouped else "greedy",
            "n_group": cfg.moe.router_groups if grouped else None,
            "topk_group": cfg.moe.router_group_top if grouped else None,
        }

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return False  # DeepSeek-V2 has no multi-token-prediction layer

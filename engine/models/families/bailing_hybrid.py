"""Ling 3 (inclusionAI/Ling-3.0-Flash; transformers' bailing_hybrid, BailingHybridForCausalLM).

Kimi Linear's layout (engine/models/families/kimi_linear.py): Kimi Delta Attention layers
(`linear_attention`) and, the last of every layer_group_size, multi-head latent attention
(`full_attention`), each layer's feed-forward a dense MLP (the first first_k_dense_replace) or
DeepSeek-V3's mixture of experts (sigmoid router with a score-correction bias, group-limited
top-k, renormalised and scaled weights, shared experts). Ling 3 differs: its delta layers' forget
and output gates are one projection each (f_proj, g_proj: KimiDeltaSpec.full_rank_gates) and
the forget gate is bounded, kda_lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (kda_safe_gate:
KimiDeltaSpec.gate_lower_bound); its latent attention has interleaved RoPE and a sigmoid gate per
head (g_proj: attention.head_gate). Checkpoints name both mixers `attention.` (o_proj `dense`) and
the embedding `word_embeddings`, as transformers saves them.

The per-layer SwiGLU clipping limits (expert_swiglu_limit_list, share_expert_swiglu_limit_list)
are read at zero (no clipping) only. The multi-token-prediction layers the published checkpoints
carry after the decoder (num_nextn_predict_layers, model.layers.{num_hidden_layers}.) are skipped
at conversion, as transformers skips them, and not written back.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    EXPERT,
    LAYER,
    TensorSpec,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)
from engine.models.families.kimi_linear import KimiLinear

ATTN, MLP = LAYER + "attention.", LAYER + "mlp."


def _kimi_delta() -> list[TensorSpec]:
    return [
        *(TensorSpec(("attn", f"w{x}_dhk"), ATTN + f"{x}_proj.weight", 1) for x in "qkv"),
        *(TensorSpec(("attn", f"conv_{x}_c1k"), ATTN + f"{x}_conv1d.weight", None) for x in "qkv"),
        TensorSpec(("attn", "a_log_11h1"), ATTN + "A_log", None, flatten=True),
        TensorSpec(("attn", "dt_bias_x"), ATTN + "dt_bias", None),
        TensorSpec(("attn", "w_f_dhk"), ATTN + "f_proj.weight", 1),
        TensorSpec(("attn", "w_b_dh"), ATTN + "b_proj.weight", 1),
        TensorSpec(("attn", "w_g_dhk"), ATTN + "g_proj.weight", 1),
        TensorSpec(("attn", "norm_k"), ATTN + "o_norm.weight", None),
        TensorSpec(("attn", "wo_hkd"), ATTN + "dense.weight", 2),
    ]


def _mla(q_lora: bool) -> list[TensorSpec]:
    if q_lora:
        query = [
            TensorSpec(("attn", "wq_a_dq"), ATTN + "q_a_proj.weight", 1),
            TensorSpec(("attn", "q_norm", "scale"), ATTN + "q_a_layernorm.weight", None),
            TensorSpec(("attn", "wq_b_qnh"), ATTN + "q_b_proj.weight", 1),
        ]
    else:
        query = [TensorSpec(("attn", "wq_dnh"), ATTN + "q_proj.weight", 1)]
    return [
        *query,
        TensorSpec(("attn", "wkv_a_dx"), ATTN + "kv_a_proj_with_mqa.weight", 1),
        TensorSpec(("attn", "kv_norm", "scale"), ATTN + "kv_a_layernorm.weight", None),
        TensorSpec(("attn", "wkv_b_cny"), ATTN + "kv_b_proj.weight", 1),
        TensorSpec(("attn", "w_head_gate_dn"), ATTN + "g_proj.weight", 1),
        TensorSpec(("attn", "wo_nwd"), ATTN + "dense.weight", 2),
    ]


def _mlp(moe: bool) -> list[TensorSpec]:
    if not moe:
        return [TensorSpec(("mlp", f"w_{x}_{d}"), MLP + f"{x}_proj.weight", 1) for x, d in _GATED]
    return [
        TensorSpec(("mlp", "w_router_de"), MLP + "gate.weight", 1),
        TensorSpec(("mlp", "b_router_e"), MLP + "gate.expert_bias", None),
        *(TensorSpec(("mlp", f"w_{x}_e{d}"), MLP + EXPERT + f"{x}_proj.weight", 1, experts=True) for x, d in _GATED),
        *(
            TensorSpec(("mlp", f"w_shared_{x}_{d}"), MLP + f"shared_experts.{x}_proj.weight", 1)
            for x, d in (("gate", "dg"), ("up", "dg"), ("down", "gd"))
        ),
    ]


_GATED = (("gate", "df"), ("up", "df"), ("down", "fd"))


@register_family
class BailingHybrid(KimiLinear):
    name = "bailing_hybrid"
    architecture = "BailingHybridForCausalLM"
    model_type = "bailing_hybrid"
    fixed = {"router_score": "sigmoid", "router_bias": True, "rope_interleave": True, "attention_head_gate": True}
    hf_defaults = {
        **KimiLinear.hf_defaults,
        "vocab_size": 157184,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "moe_intermediate_size": 768,
        "num_experts": 512,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "num_expert_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 2,
        "layer_group_size": 6,
        "short_conv_kernel_size": 4,
        "kda_safe_gate": True,
        "kda_lower_bound": -5.0,
        "rope_theta": 6_000_000.0,
        "head_dim": 128,
    }
    hf_constants = {**KimiLinear.hf_constants, "mtp_loss_scaling_factor": 0.0}

    def layer_kinds(self, hf: dict, layers: int, where: str) -> tuple[list[str], list[str]]:
        group = self.hf_value(hf, "layer_group_size")
        types = hf.get("layer_types") or [
            "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(layers)
        ]
        dense = self.hf_value(hf, "first_k_dense_replace")
        mlp = hf.get("mlp_layer_types") or ["dense" if i < dense else "sparse" for i in range(layers)]
        return super().layer_kinds({**hf, "layer_types": types, "mlp_layer_types": mlp}, layers, where)

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        layers = hf.get("num_hidden_layers")
        for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list", "swiglu_limits"):
            if any(hf.get(key) or []):
                raise ConfigError(f"{where}: {key} {hf[key]} is not supported (SwiGLU clipping: zeros only)")
        # The delta layers' sizes: transformers writes linear_*; an original config.json has
        # only head_dim (the delta heads' width; transformers rewrites head_dim to the rotary one)
        # and num_attention_heads
        linear_dim = hf.get("linear_head_dim") or self.hf_value(hf, "head_dim")
        kernel = hf.get("linear_conv_kernel_dim") or self.hf_value(hf, "short_conv_kernel_size")
        fields = super().config_from_hf(
            {
                **hf,
                "linear_head_dim": linear_dim,
                "linear_num_heads": hf.get("linear_num_heads") or hf.get("num_attention_heads"),
                "linear_conv_kernel_dim": kernel,
                "first_k_dense_replace": self.hf_value(hf, "first_k_dense_replace"),
            },
            where,
        )
        rope = hf.get("rope_parameters") or {"rope_theta": self.hf_value(hf, "rope_theta")}
        theta, scaling = rope_from_hf({"max_position_embeddings": fields["max_seq_len"], **rope}, where)
        safe = self.hf_value(hf, "kda_safe_gate")
        fields["gated_delta"] = {
            **fields["gated_delta"],
            "full_rank_gates": True,
            "gate_lower_bound": float(self.hf_value(hf, "kda_lower_bound")) if safe else None,
        }
        assert layers == fields["num_layers"]
        return {**fields, "rope_theta": theta, "rope_scaling": scaling}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        gd = cfg.gated_delta
        assert gd is not None
        layers = cfg.layer_pattern()
        types = hf["layer_types"]
        groups = [
            g
            for g in range(1, cfg.num_layers + 1)
            if types == self.layer_kinds({"layer_group_size": g, "first_k_dense_replace": 0}, cfg.num_layers, "")[0]
        ]
        dense = next((i for i, layer in enumerate(layers) if layer.ffn == "moe"), cfg.num_layers)
        bound = gd.gate_lower_bound
        return {
            **hf,
            "head_dim": cfg.mla.rope_head_dim,
            "short_conv_kernel_size": gd.conv_kernel,
            "layer_group_size": groups[0] if groups else self.hf_defaults["layer_group_size"],
            "first_k_dense_replace": dense,
            "kda_safe_gate": bound is not None,
            "kda_lower_bound": self.hf_defaults["kda_lower_bound"] if bound is None else bound,
            "num_nextn_predict_layers": 0,
            "expert_swiglu_limit_list": [0] * cfg.num_layers,
            "share_expert_swiglu_limit_list": [0] * cfg.num_layers,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "rope_theta": cfg.rope.theta,
        }

    embedding_name = "model.word_embeddings.weight"

    def mixer_and_ffn_tensors(self, cfg: ModelConfig, layer) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """Kimi Linear's layers under Ling's names (attention.*, dense, the MLP's own)."""
        mixer = _kimi_delta() if layer.mixer == "kimi_delta" else _mla(cfg.mla.q_lora_rank is not None)
        return mixer, _mlp(layer.ffn == "moe")

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """The multi-token-prediction layers after the decoder's (transformers skips them too)."""
        parts = name.split(".")
        return name.startswith("model.layers.") and parts[2].isdigit() and int(parts[2]) >= cfg.num_layers

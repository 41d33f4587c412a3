"""MiniCPM 5 MoE (MiniCPM5MoeForCausalLM; openbmb/MiniCPM5-15B-A2.5B): Llama's attention with
a sigmoid output gate over DeepSeek-V3's mixture of experts.

The query projection also yields each head's gate (transformers' q_gate_proj, published as
`self_attn.q_proj`: per head its head_dim query rows, then head_dim gate rows, as
Qwen3-Next's; ModelConfig.attention_output_gate), with no QK norm and RoPE over whole heads;
the layers `mlp_layer_types` marks dense have a gated MLP, the rest DeepSeek-V3's experts:
sigmoid scores plus a choosing bias, group-limited top-k (groups scored by their two best),
renormalised and scaled weights, shared experts as one gated MLP (engine/models/moe.py).
Checkpoints store one tensor per expert, as transformers saves them.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import register_family
from engine.models.families.routed_gqa import RoutedGqa, ffn_fields, mlp_layer_types


@register_family
class MiniCPM5Moe(RoutedGqa):
    name = "minicpm5_moe"
    architecture = "MiniCPM5MoeForCausalLM"
    also_architectures = ("MiniCPM5MoEForCausalLM",)  # the published spelling transformers renames
    model_type = "minicpm5_moe"
    fixed = {**RoutedGqa.fixed, "attention_output_gate": True}
    hf_defaults = {
        "max_position_embeddings": 524288,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 5000000.0,
        "n_routed_experts": 160,
        "num_experts_per_tok": 16,
        "moe_intermediate_size": 512,
        "n_shared_experts": 1,
        "routed_scaling_factor": 3.66,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
    }
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False, "output_router_logits": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("use_gated_attention") is False:
            raise ConfigError(f"{where}: use_gated_attention=false is not supported (MiniCPM5's attention is gated)")
        if hf.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ConfigError(f"{where}: partial_rotary_factor is not supported (transformers rotates whole heads)")
        return super().config_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types")
        if types is None:  # transformers' default: first_k_dense_replace (1) dense layers first
            first = hf.get("first_k_dense_replace", 1)
            types = ["dense" if i < first else "sparse" for i in range(layers)]
        return {**self.router_fields(hf), **ffn_fields([t == "sparse" for t in types])}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**self.router_keys(cfg), "mlp_layer_types": mlp_layer_types(cfg)}

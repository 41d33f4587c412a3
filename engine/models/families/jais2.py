"""Jais 2 (Jais2ForCausalLM; inceptionai/Jais-2-8B-Chat): Llama's attention and names with
LayerNorms (weight and bias, `layer_norm_eps`), biases on q, k, v and o (`attention_bias`),
and an ungated MLP, down(relu2(up(x))) with biases (`mlp_bias`; Nemotron's MLP). LoRA: every
projection but gate_proj, which it has not.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, register_family
from engine.models.families.gpt2 import activation_of, layer_norm


@register_family
class Jais2(Family):
    name = "jais2"
    architecture = "Jais2ForCausalLM"
    model_type = "jais2"
    fixed = {"norm_kind": "layer", "norm_bias": True, "mlp_gated": False}
    hf_defaults = {"max_position_embeddings": 8192, "tie_word_embeddings": False}
    unsupported_flags = ()
    hf_constants = {}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # Llama's keys, but for the norms' epsilon, the activation and the biases
        fields = super().config_from_hf({**hf, "hidden_act": "silu"}, where)
        bias = hf.get("attention_bias", True) is not False
        return {
            **fields,
            "norm_eps": hf.get("layer_norm_eps") or 1e-5,
            "activation": activation_of(hf, "hidden_act", "relu2", where),
            "qkv_bias": bias,
            "attention_out_bias": bias,
            "mlp_bias": hf.get("mlp_bias", True) is not False,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["rms_norm_eps"]
        return {
            **hf,
            "layer_norm_eps": cfg.norm.eps,
            "attention_bias": cfg.attention.qkv_bias,
            "mlp_bias": cfg.mlp.bias,
        }

    def activation_to_hf(self, cfg: ModelConfig) -> str:
        return {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.mlp.activation, cfg.mlp.activation)

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

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        specs = [
            TensorSpec(("mlp", "w_up_df"), LAYER + "mlp.up_proj.weight", 1),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.down_proj.weight", 1),
        ]
        if cfg.mlp.bias:
            specs += [
                TensorSpec(("mlp", "b_up_f"), LAYER + "mlp.up_proj.bias", None),
                TensorSpec(("mlp", "b_down_d"), LAYER + "mlp.down_proj.bias", None),
            ]
        return specs

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        top = [s for s in top if s.path[0] != "final_norm"] + layer_norm("final_norm", "model.norm")
        return top, per_layer

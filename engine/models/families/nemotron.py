"""Nemotron (NemotronForCausalLM): Nemotron-3 8B, Minitron 4B and 8B.

Llama's projection names and a sequential residual, with LayerNorm1P norms (a bias, the
scale stored zero-centred: weight + 1; ModelConfig.norm.zero_centered), a non-gated MLP
(up_proj, down_proj) with squared ReLU, RoPE on the first half of each head by default
(`partial_rotary_factor`), and optional biases (`attention_bias`, `mlp_bias`).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import LAYER, Family, TensorSpec, register_family, rope_to_hf


@register_family
class Nemotron(Family):
    name = "nemotron"
    architecture = "NemotronForCausalLM"
    model_type = "nemotron"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        classic.require(hf, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), where)
        classic.require(hf, ("vocab_size",), where)
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d // n
        bias = bool(hf.get("attention_bias", False))
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": hf.get("num_key_value_heads") or n,
            "head_dim": head_dim,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings") or 4096,
            "norm_eps": hf.get("norm_eps") or 1e-5,
            **classic.partial_rope(hf, head_dim, where, factor=0.5),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "activation": classic.activation(hf, "hidden_act", "relu2", where),
            "init_std": hf.get("initializer_range") or 0.0134,
            "norm_kind": "layer",
            "norm_bias": True,
            "norm_zero_centered": True,
            "mlp_gated": False,
            "mlp_bias": bool(hf.get("mlp_bias", False)),
            "qkv_bias": bias,
            "attention_out_bias": bias,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "head_dim": cfg.attention.head_dim,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "norm_eps": cfg.norm.eps,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": classic.partial_rope_to_hf(cfg),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_to_hf(cfg.rope.scaling),
            "attention_bias": cfg.attention.qkv_bias,
            "attention_dropout": 0.0,
            "mlp_bias": cfg.mlp.bias,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            *classic.norm("final_norm", "model.norm", bias=True),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        bias = cfg.attention.qkv_bias
        per_layer = [
            *classic.norm("attn_norm", LAYER + "input_layernorm", bias=True),
            *classic.attention(LAYER + "self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"), bias, bias),
            *classic.norm("mlp_norm", LAYER + "post_attention_layernorm", bias=True),
            *classic.plain_mlp(LAYER + "mlp.", "up_proj", "down_proj", bias=cfg.mlp.bias),
        ]
        return top, per_layer

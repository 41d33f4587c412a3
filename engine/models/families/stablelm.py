"""StableLM (StableLmForCausalLM): StableLM-3B-4E1T, StableLM 2 1.6B and 12B.

Llama's gated SwiGLU MLP and projection names under LayerNorms with biases; RoPE on the
first quarter of each head by default (`partial_rotary_factor`); optional biases on q, k and
v (`use_qkv_bias`). `use_parallel_residual` (StableLM 2 12B): the input LayerNorm feeds both
sublayers, x + attn(ln(x)) + mlp(ln(x)), with no post-attention norm; `qk_layernorm`: a
LayerNorm without a bias per head on queries and keys, each head's its own tensor
(`q_layernorm.norms.{j}`; ModelConfig.attention.qk_norm_per_head).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import LAYER, Family, TensorSpec, gated_mlp_tensors, register_family, rope_to_hf


@register_family
class StableLm(Family):
    name = "stablelm"
    architecture = "StableLmForCausalLM"
    model_type = "stablelm"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        classic.require(hf, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), where)
        classic.require(hf, ("vocab_size",), where)
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        qk_norm = bool(hf.get("qk_layernorm", False))
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": hf.get("num_key_value_heads") or n,
            "head_dim": d // n,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings") or 4096,
            "norm_eps": hf.get("layer_norm_eps") or 1e-5,
            **classic.partial_rope(hf, d // n, where, factor=0.25),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "activation": classic.activation(hf, "hidden_act", "silu", where),
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "norm_bias": True,
            "residual": "parallel_shared_norm" if hf.get("use_parallel_residual") else "sequential",
            "qkv_bias": bool(hf.get("use_qkv_bias", False)),
            "qk_norm": qk_norm,
            "qk_norm_per_head": qk_norm,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "intermediate_size": cfg.mlp.dim,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "layer_norm_eps": cfg.norm.eps,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": classic.partial_rope_to_hf(cfg),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_to_hf(cfg.rope.scaling),
            "use_qkv_bias": cfg.attention.qkv_bias,
            "qk_layernorm": cfg.attention.qk_norm,
            "use_parallel_residual": cfg.block.residual == "parallel_shared_norm",
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            *classic.norm("final_norm", "model.norm", bias=True),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        per_layer = [
            *classic.norm("attn_norm", LAYER + "input_layernorm", bias=True),
            *classic.attention(
                LAYER + "self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"), cfg.attention.qkv_bias, False
            ),
            *gated_mlp_tensors(),
        ]
        if cfg.block.residual == "sequential":
            per_layer += classic.norm("mlp_norm", LAYER + "post_attention_layernorm", bias=True)
        if (
            cfg.attention.qk_norm
        ):  # a tensor per head (TensorSpec.experts: one per index of the layer's (heads, h) scale)
            names = [LAYER + f"self_attn.{x}_layernorm.norms.{{j}}.weight" for x in "qk"]
            per_layer += [
                TensorSpec(("attn", f"{x}_norm", "scale"), name, None, experts=True) for x, name in zip("qk", names)
            ]
        return top, per_layer

"""Phi-1, Phi-1.5 and Phi-2 (PhiForCausalLM).

One LayerNorm (with a bias) feeds both sublayers, x + attn(ln(x)) + mlp(ln(x)) (residual
parallel_shared_norm); biases on the q, k, v and output (`dense`) projections, on the
non-gated MLP (fc1, fc2; gelu_new) and on the LM head; RoPE on the first half of each head
by default (`partial_rotary_factor`). `qk_layernorm`: a LayerNorm over head_dim, shared by
the heads, on queries and keys before RoPE.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import Family, TensorSpec, register_family, rope_to_hf

LAYER = "model.layers.{i}."


@register_family
class Phi(Family):
    name = "phi"
    architecture = "PhiForCausalLM"
    model_type = "phi"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        classic.require(hf, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), where)
        classic.require(hf, ("vocab_size",), where)
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": hf.get("num_key_value_heads") or n,
            "head_dim": d // n,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings") or 2048,
            "norm_eps": hf.get("layer_norm_eps") or 1e-5,
            **classic.partial_rope(hf, d // n, where, factor=0.5),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "activation": classic.activation(hf, "hidden_act", "gelu_new", where),
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "norm_bias": True,
            "residual": "parallel_shared_norm",
            "mlp_gated": False,
            "mlp_bias": True,
            "qkv_bias": True,
            "attention_out_bias": True,
            "qk_norm": bool(hf.get("qk_layernorm", False)),
            "lm_head_bias": True,
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
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attention_dropout": 0.0,
            "hidden_act": {"gelu_tanh": "gelu_new"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "layer_norm_eps": cfg.norm.eps,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": classic.partial_rope_to_hf(cfg),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_to_hf(cfg.rope.scaling),
            "qk_layernorm": cfg.attention.qk_norm,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            *classic.norm("final_norm", "model.final_layernorm", bias=True),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        top.append(TensorSpec(("lm_head_bias_v",), "lm_head.bias", None))
        per_layer = [
            *classic.norm("attn_norm", LAYER + "input_layernorm", bias=True),
            *classic.attention(LAYER + "self_attn.", ("q_proj", "k_proj", "v_proj", "dense"), True, True),
            *classic.plain_mlp(LAYER + "mlp.", "fc1", "fc2", bias=True),
        ]
        if cfg.attention.qk_norm:
            for x in "qk":
                per_layer += classic.norm(f"attn/{x}_norm", LAYER + f"self_attn.{x}_layernorm", bias=True)
        return top, per_layer

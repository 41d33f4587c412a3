"""GPT-NeoX and Pythia (GPTNeoXForCausalLM).

LayerNorms with biases; a parallel residual, x + attn(ln1(x)) + mlp(ln2(x)), unless
`use_parallel_residual` is false; biases on every projection (`attention_bias`); a non-gated
MLP (dense_h_to_4h, dense_4h_to_h) with exact GELU; RoPE on the first quarter of each head by
default (`partial_rotary_factor`, formerly `rotary_pct`). q, k and v are one projection,
`query_key_value`, its rows grouped by head: (heads, 3, head_dim) (TensorSpec.fused_groups).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import Family, TensorSpec, register_family, rope_to_hf

LAYER = "gpt_neox.layers.{i}."


@register_family
class GPTNeoX(Family):
    name = "gpt_neox"
    architecture = "GPTNeoXForCausalLM"
    model_type = "gpt_neox"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        classic.require(hf, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), where)
        classic.require(hf, ("vocab_size",), where)
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        rope = {**hf, "rope_theta": hf.get("rope_theta") or hf.get("rotary_emb_base")}
        if hf.get("rotary_pct") is not None and hf.get("partial_rotary_factor") is None:
            rope["partial_rotary_factor"] = hf["rotary_pct"]
        bias = hf.get("attention_bias", True)
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": n,
            "head_dim": d // n,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings") or 2048,
            "norm_eps": hf.get("layer_norm_eps") or 1e-5,
            **classic.partial_rope(rope, d // n, where, factor=0.25),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "activation": classic.activation(hf, "hidden_act", "gelu", where),
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "norm_bias": True,
            "residual": "parallel" if hf.get("use_parallel_residual", True) else "sequential",
            "mlp_gated": False,
            "mlp_bias": True,
            "qkv_bias": bias,
            "attention_out_bias": bias,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "intermediate_size": cfg.mlp.dim,
            "hidden_act": {"gelu_tanh": "gelu_new"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "attention_dropout": 0.0,
            "hidden_dropout": 0.0,
            "classifier_dropout": 0.1,
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "layer_norm_eps": cfg.norm.eps,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "use_parallel_residual": cfg.block.residual == "parallel",
            "rope_parameters": classic.partial_rope_to_hf(cfg),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_to_hf(cfg.rope.scaling),
            "attention_bias": cfg.attention.qkv_bias,
            "is_decoder": False,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "gpt_neox.embed_in.weight", None),
            *classic.norm("final_norm", "gpt_neox.final_layer_norm", bias=True),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "embed_out.weight", 1))
        per_layer = [
            *classic.norm("attn_norm", LAYER + "input_layernorm", bias=True),
            *classic.norm("mlp_norm", LAYER + "post_attention_layernorm", bias=True),
            *classic.fused_qkv(
                LAYER + "attention.query_key_value", cfg.attention.qkv_bias, groups=cfg.attention.num_heads
            ),
            TensorSpec(("attn", "wo_nhd"), LAYER + "attention.dense.weight", 2),
            *([TensorSpec(("attn", "bo_d"), LAYER + "attention.dense.bias", None)] if cfg.attention.out_bias else []),
            *classic.plain_mlp(LAYER + "mlp.", "dense_h_to_4h", "dense_4h_to_h", bias=True),
        ]
        return top, per_layer

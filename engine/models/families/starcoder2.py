"""StarCoder2 (Starcoder2ForCausalLM): Llama's attention (grouped KV heads) with biases
(`use_bias`), a sliding window over every layer (`sliding_window`), LayerNorms with biases
(`norm_epsilon`) and a non-gated MLP (c_fc, c_proj; gelu_pytorch_tanh) with biases.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
    rope_to_hf,
)


@register_family
class Starcoder2(Family):
    name = "starcoder2"
    architecture = "Starcoder2ForCausalLM"
    model_type = "starcoder2"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        classic.require(hf, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), where)
        classic.require(hf, ("vocab_size",), where)
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        older = {"rope_theta": hf.get("rope_theta") or 10000.0, **(hf.get("rope_scaling") or {})}
        theta, scaling = rope_from_hf(hf.get("rope_parameters") or older, where)
        bias, window = bool(hf.get("use_bias", True)), hf.get("sliding_window")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": hf.get("num_key_value_heads") or n,
            "head_dim": hf.get("head_dim") or d // n,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings") or 4096,
            "norm_eps": hf.get("norm_epsilon") or 1e-5,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "activation": classic.activation(hf, "hidden_act", "gelu_pytorch_tanh", where),
            "attention_pattern": ["global" if window is None else "local"],
            "sliding_window": window,
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "norm_bias": True,
            "mlp_gated": False,
            "mlp_bias": bias,
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
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "hidden_act": {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "norm_epsilon": cfg.norm.eps,
            "use_cache": True,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_to_hf(cfg.rope.scaling),
            "sliding_window": cfg.attention.sliding_window if all(cfg.layer_is_local()) else None,
            "attention_dropout": 0.0,
            "residual_dropout": 0.0,
            "embedding_dropout": 0.0,
            "use_bias": cfg.mlp.bias,
            "tie_word_embeddings": cfg.tie_embeddings,
            # read by the attention though Starcoder2Config does not declare it
            **(
                {"head_dim": cfg.attention.head_dim}
                if cfg.attention.head_dim != cfg.d_model // cfg.attention.num_heads
                else {}
            ),
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            *classic.norm("final_norm", "model.norm", bias=True),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        bias = cfg.mlp.bias
        per_layer = [
            *classic.norm("attn_norm", LAYER + "input_layernorm", bias=True),
            *classic.attention(LAYER + "self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"), bias, bias),
            *classic.norm("mlp_norm", LAYER + "post_attention_layernorm", bias=True),
            *classic.plain_mlp(LAYER + "mlp.", "c_fc", "c_proj", bias=bias),
        ]
        return top, per_layer

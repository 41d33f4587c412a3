"""Cohere's Command R and R+ (CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM).

Llama's projection names and SwiGLU MLP under one LayerNorm without a bias that feeds both
sublayers, x + attn(ln(x)) + mlp(ln(x)) (residual parallel_shared_norm); RoPE on adjacent
pairs (rope_interleave); logits multiplied by `logit_scale` (ModelConfig.head.multiplier);
biases on q, k, v and o where `attention_bias`. Command R+ (`use_qk_norm`) has a LayerNorm
per head on queries and keys, its scale (heads, head_dim) (ModelConfig.attention.qk_norm_per_head).
Cohere 2 alternates sliding-window layers, which rotate, with global ones, which do not
(NoPE; `layer_types`, or the older `sliding_window_pattern`: every 4th global).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    gated_mlp_tensors,
    parse_layer_types,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
    rope_to_hf,
    shortest_period,
)


@register_family
class Cohere(Family):
    name = "cohere"
    architecture = "CohereForCausalLM"
    model_type = "cohere"
    rope_theta = 500000.0
    """transformers' default base of the class."""

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        classic.require(hf, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), where)
        classic.require(hf, ("vocab_size",), where)
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        older = {"rope_theta": hf.get("rope_theta") or self.rope_theta, **(hf.get("rope_scaling") or {})}
        theta, scaling = rope_from_hf(hf.get("rope_parameters") or older, where)
        qk_norm, bias = bool(hf.get("use_qk_norm", False)), bool(hf.get("attention_bias", False))
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": hf.get("num_key_value_heads") or n,
            "head_dim": hf.get("head_dim") or d // n,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings") or 8192,
            "norm_eps": hf.get("layer_norm_eps") or 1e-5,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "rope_interleave": True,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "activation": classic.activation(hf, "hidden_act", "silu", where),
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "residual": "parallel_shared_norm",
            "qkv_bias": bias,
            "attention_out_bias": bias,
            "qk_norm": qk_norm,
            "qk_norm_per_head": qk_norm,
            "logits_multiplier": float(hf.get("logit_scale") or 0.0625),
            **self.layer_fields(hf, where),
        }

    def layer_fields(self, hf: dict, where: str) -> dict[str, Any]:
        return {}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp.dim,
            "logit_scale": cfg.head.multiplier,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "hidden_act": cfg.mlp.activation,
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "layer_norm_eps": cfg.norm.eps,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "rope_theta": cfg.rope.theta,
            "rope_scaling": rope_to_hf(cfg.rope.scaling),
            "attention_bias": cfg.attention.qkv_bias,
            "attention_dropout": 0.0,
            **self.extra_hf_keys(cfg),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        # head_dim: read by the attention though CohereConfig does not declare it
        other_width = cfg.attention.head_dim != cfg.d_model // cfg.attention.num_heads
        return {"use_qk_norm": cfg.attention.qk_norm, **({"head_dim": cfg.attention.head_dim} if other_width else {})}

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        bias = cfg.attention.qkv_bias
        per_layer = [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            *classic.attention(LAYER + "self_attn.", ("q_proj", "k_proj", "v_proj", "o_proj"), bias, bias),
            *gated_mlp_tensors(),
        ]
        if cfg.attention.qk_norm:  # (heads, head_dim) scales, as HF stores them
            names = [LAYER + f"self_attn.{x}_norm.weight" for x in "qk"]
            per_layer += [TensorSpec(("attn", f"{x}_norm", "scale"), name, None) for x, name in zip("qk", names)]
        return top, per_layer


@register_family
class Cohere2(Cohere):
    name = "cohere2"
    architecture = "Cohere2ForCausalLM"
    model_type = "cohere2"
    rope_theta = 10000.0

    def layer_fields(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("use_qk_norm"):
            raise ConfigError(f"{where}: use_qk_norm=true is not a Cohere2ForCausalLM setting")
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:  # the older key: every sliding_window_pattern-th layer global
            period = hf.get("sliding_window_pattern") or 4
            types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
        local = parse_layer_types(types, layers, where)
        window = hf.get("sliding_window") or 4096
        return {
            "attention_pattern": ["local" if x else "global" for x in shortest_period(local)],
            "sliding_window": window if any(local) else None,
            "rope_pattern": None if all(local) else shortest_period(local),  # only the sliding layers rotate
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = cfg.layer_is_local()
        return {
            "sliding_window": cfg.attention.sliding_window or 4096,
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "head_dim": cfg.attention.head_dim,
        }

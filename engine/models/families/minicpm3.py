"""MiniCPM3 (MiniCPM3ForCausalLM; openbmb/MiniCPM3-4B): Llama with DeepSeek-V2's multi-head
latent attention and MiniCPM's muP scalings.

The attention is DeepSeek-V2's (engine/models/mla.py: compressed queries of q_lora_rank,
a kv_lora_rank latent plus a rotary key shared by the heads, value heads of v_head_dim,
hidden_size / heads by default) rotating (first half, second half) pairs, not DeepSeek's
interleaved ones; the MLP is Llama's. The scalings are Granite's multipliers under other
names: embeddings times scale_emb (ModelConfig.embedding.multiplier), each sublayer's output
times scale_depth / sqrt(num_hidden_layers) before the residual add (residual_multiplier),
the final hidden state divided by hidden_size / dim_model_base before the LM head, which is
the logits divided by it (logits_scaling).

MiniCPM3-4B's RoPE is LongRoPE with original_max_position_embeddings equal to
max_position_embeddings, so within the context only its short factors apply; the engine's
latent attention uses those alone, and a longer original context is refused.
"""

from __future__ import annotations

import math
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family, rope_from_hf
from engine.models.families.base import rope_parameters_to_hf as _rope_parameters
from engine.models.families.deepseek import _attention


def _short(value: float) -> float:
    """`value` at 12 significant digits where that is the same float's spelling back (1.4 for
    1.4 / sqrt(62) * sqrt(62)), so config.json keeps the published number; else `value`."""
    rounded = float(f"{value:.12g}")
    return rounded if math.isclose(rounded, value, rel_tol=1e-12) else value


@register_family
class MiniCPM3(Family):
    name = "minicpm3"
    architecture = "MiniCPM3ForCausalLM"
    model_type = "minicpm3"
    hf_defaults = {
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.1,
        "kv_lora_rank": 256,
        "q_lora_rank": 768,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 256,
    }

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or {
            "rope_theta": self.hf_value(hf, "rope_theta", 10000.0),
            **(hf.get("rope_scaling") or {}),
        }
        if rope.get("rope_type", rope.get("type")) != "longrope":
            theta, scaling = rope_from_hf(rope, where)
            return {"rope_theta": theta, "rope_scaling": scaling}
        length = self.hf_value(hf, "max_position_embeddings")
        original = rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings") or length
        if original != length:
            raise ConfigError(
                f"{where}: LongRoPE with original_max_position_embeddings ({original}) below max_position_embeddings "
                f"({length}) is not supported (latent attention uses the short factors only)"
            )
        pairs = self.hf_value(hf, "qk_rope_head_dim") // 2
        for key in ("short_factor", "long_factor"):
            if not isinstance(rope.get(key), list) or len(rope[key]) != pairs:
                raise ConfigError(f"{where}: rope_parameters.{key} must list {pairs} numbers (one per rotated pair)")
        scaling = {
            "kind": "longrope",
            "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"],
            "original_max_position": original,
            "factor": rope.get("factor") or 1.0,
            "attention_factor": rope.get("attention_factor"),
        }
        return {"rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        nope, rope = self.hf_value(hf, "qk_nope_head_dim"), self.hf_value(hf, "qk_rope_head_dim")
        value_dim = hf.get("v_head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        layers = hf["num_hidden_layers"]
        depth = hf.get("scale_depth", self.hf_defaults["scale_depth"])  # null: sqrt(layers), no scaling
        residual = 1.0 if depth is None else float(depth) / math.sqrt(layers)
        base = hf.get("dim_model_base", self.hf_defaults["dim_model_base"]) or hf["hidden_size"]
        embedding = float(self.hf_value(hf, "scale_emb"))
        logits = hf["hidden_size"] / base
        return {
            "num_kv_heads": hf["num_attention_heads"],  # latent attention: one key per query head
            "head_dim": nope + rope,
            "rope_head_dim": rope,
            "v_head_dim": None if value_dim == nope + rope else value_dim,
            "kv_lora_rank": self.hf_value(hf, "kv_lora_rank"),
            # null is "no query compression", not "the default"
            "q_lora_rank": hf["q_lora_rank"] if "q_lora_rank" in hf else self.hf_defaults["q_lora_rank"],
            "embedding_multiplier": None if embedding == 1.0 else embedding,
            "residual_multiplier": None if residual == 1.0 else residual,
            "logits_scaling": None if logits == 1.0 else logits,
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        scaling = cfg.rope.scaling
        rope = _rope_parameters(cfg.rope.theta, scaling)
        if scaling is not None and scaling.kind == "longrope":
            # as published configs write it: `type` (transformers 4's key) beside rope_type, no factor of 1
            rope = {**{k: v for k, v in rope.items() if k != "factor" or v != 1.0}, "type": "longrope"}
        logits = cfg.head.divisor or 1.0
        base = cfg.d_model / logits
        return {
            "rope_parameters": rope,
            "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if scaling is not None else None,
            "head_dim": cfg.mla.rope_head_dim,  # transformers' MiniCPM3Config: the rotary part
            "qk_head_dim": cfg.attention.head_dim,
            "qk_nope_head_dim": cfg.attention.head_dim - cfg.mla.rope_head_dim,
            "qk_rope_head_dim": cfg.mla.rope_head_dim,
            "v_head_dim": cfg.value_head_dim,
            "kv_lora_rank": cfg.mla.kv_lora_rank,
            "q_lora_rank": cfg.mla.q_lora_rank,
            "scale_emb": cfg.embedding.multiplier or 1.0,
            "scale_depth": _short((cfg.block.residual_multiplier or 1.0) * math.sqrt(cfg.num_layers)),
            "dim_model_base": int(base) if float(base).is_integer() else base,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return _attention("blocks", cfg.mla.q_lora_rank is not None)  # with post_attention_layernorm

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return []  # in attention_tensors

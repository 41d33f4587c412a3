"""Youtu-LLM (YoutuForCausalLM; tencent/Youtu-LLM-2B): Llama's layers with DeepSeek-V3's
multi-head latent attention and a dense gated MLP in every layer.

The attention is DeepSeek-V3's (engine/models/mla.py: compressed queries of q_lora_rank, a
kv_lora_rank latent plus a rotary key shared by the heads, value heads of v_head_dim, RoPE on
adjacent pairs by default: rope_interleave), under DeepSeek's tensor names; the MLP is Llama's.
transformers' YoutuConfig is DeepseekV3Config without the experts; its initializer_range
defaults to 2 / sqrt(5 hidden_size), the embeddings' to twice that.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family
from engine.models.families.deepseek import _attention


@register_family
class Youtu(Family):
    name = "youtu"
    architecture = "YoutuForCausalLM"
    model_type = "youtu"
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "rope_interleave": True,
    }
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        fields = super().config_from_hf(hf, where)
        if hf.get("initializer_range") is None:  # YoutuConfig's default
            fields["init_std"] = 2.0 / (5.0 * hf["hidden_size"]) ** 0.5
        return fields

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        nope, rope = self.hf_value(hf, "qk_nope_head_dim"), self.hf_value(hf, "qk_rope_head_dim")
        value_dim = self.hf_value(hf, "v_head_dim")
        return {
            "num_kv_heads": hf["num_attention_heads"],  # latent attention: one key per query head
            "head_dim": nope + rope,
            "rope_head_dim": rope,
            "v_head_dim": None if value_dim == nope + rope else value_dim,
            "kv_lora_rank": self.hf_value(hf, "kv_lora_rank"),
            # null is "no query compression", not "the default"
            "q_lora_rank": hf["q_lora_rank"] if "q_lora_rank" in hf else self.hf_defaults["q_lora_rank"],
            "rope_interleave": bool(self.hf_value(hf, "rope_interleave")),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "num_key_value_heads": cfg.attention.num_heads,
            "head_dim": cfg.mla.rope_head_dim,  # as transformers writes them
            "qk_head_dim": cfg.attention.head_dim,
            "qk_nope_head_dim": cfg.attention.head_dim - cfg.mla.rope_head_dim,
            "qk_rope_head_dim": cfg.mla.rope_head_dim,
            "v_head_dim": cfg.value_head_dim,
            "kv_lora_rank": cfg.mla.kv_lora_rank,
            "q_lora_rank": cfg.mla.q_lora_rank,
            "rope_interleave": cfg.rope.interleave,
            "embedding_initializer_range": 2.0 * cfg.init_std,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return _attention("blocks", cfg.mla.q_lora_rank is not None)  # with post_attention_layernorm

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return []  # in attention_tensors

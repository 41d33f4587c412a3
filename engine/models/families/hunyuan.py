"""Hunyuan dense (HunYuanDenseV1ForCausalLM; Hunyuan 0.5B to 7B): Llama with an RMSNorm over
head_dim on the queries and keys after RoPE (`self_attn.query_layernorm`, `key_layernorm`;
ModelConfig.attention.qk_norm_after_rope).

Its checkpoints stretch the RoPE base by a fixed NTK `alpha` (rope_scaling `{type: dynamic,
alpha: 1000}`, which transformers runs as `ntk_alpha`: base * alpha ** (head_dim / (head_dim -
2)), whatever the sequence's length). That is a plain RoPE of the stretched base, read as
rope_theta; export writes that base with no scaling, the same model. Plain `dynamic` scaling
(without alpha) is dynamic NTK, as for Llama (RopeScaling kind dynamic).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.families.base import LAYER, Family, TensorSpec, register_family, rope_from_hf


@register_family
class HunYuanDenseV1(Family):
    name = "hunyuan_v1_dense"
    architecture = "HunYuanDenseV1ForCausalLM"
    model_type = "hunyuan_v1_dense"
    fixed = {"qk_norm": True, "qk_norm_after_rope": True}
    hf_defaults = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    unsupported_flags = ("attention_bias", "mlp_bias")
    # HunYuanDenseV1Config has no mlp_bias. eod_token_id is a tokenizer's id that no model code
    # reads; like the other token ids it is not the architecture's, and export leaves it null.
    hf_constants = {"attention_bias": False, "pretraining_tp": 1, "eod_token_id": None}

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or {
            "rope_theta": self.hf_value(hf, "rope_theta", 10000.0),
            **(hf.get("rope_scaling") or {}),
        }
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "dynamic" or not rope.get("alpha"):
            return super().rope_from_hf(hf, where)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        base = float(rope.get("rope_theta", 10000.0)) * rope["alpha"] ** (head_dim / (head_dim - 2))
        theta, scaling = rope_from_hf({"rope_type": "default", "rope_theta": base}, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        if hf.get("use_cla"):
            where = f"config.json ({self.architecture})"
            raise ConfigError(f"{where}: use_cla=true (cross-layer KV sharing) is not supported")
        return {}

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec(("attn", "q_norm", "scale"), LAYER + "self_attn.query_layernorm.weight", None),
            TensorSpec(("attn", "k_norm", "scale"), LAYER + "self_attn.key_layernorm.weight", None),
        ]

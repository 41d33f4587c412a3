"""OLMo 1 (OlmoForCausalLM; OLMo-1B-hf, OLMo-7B-hf, OLMo-1.7-7B-hf): Llama's layers with a
LayerNorm that has neither scale nor bias (ModelConfig.norm.scale false; no norm tensors at
all), and queries, keys and values clamped to [-clip_qkv, clip_qkv] after their projections
(qkv_clip). Llama's tensor names otherwise, so LoRA adapts every projection.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family


@register_family
class Olmo(Family):
    name = "olmo"
    architecture = "OlmoForCausalLM"
    model_type = "olmo"
    fixed = {"norm_kind": "layer", "norm_scale": False, "norm_bias": False, "norm_eps": 1e-5}
    hf_defaults = {"max_position_embeddings": 2048, "tie_word_embeddings": False}
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        return {"qkv_clip": hf.get("clip_qkv")}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["rms_norm_eps"]  # OlmoLayerNorm's epsilon is fixed, 1e-5
        return {**hf, "clip_qkv": cfg.attention.qkv_clip}

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        norms = ("attn_norm", "mlp_norm", "final_norm")
        return [s for s in top if s.path[0] not in norms], [s for s in per_layer if s.path[0] not in norms]

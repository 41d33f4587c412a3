"""GLM-4 (GlmForCausalLM, THUDM/glm-4-9b-chat-hf) and GLM-4-0414 (Glm4ForCausalLM): dense
Llama-shaped models with GLM's attention and a fused MLP.

Attention: biases on q, k and v (`attention_bias`, true by default; ModelConfig.attention.qkv_bias),
RoPE on the first partial_rotary_factor (0.5 by default) of each head (ModelConfig.rope.rotary_dim)
rotating adjacent pairs (x0, x1), (x2, x3), ... (ModelConfig.rope.interleave). The MLP's gate
and up projections are one `gate_up_proj`, gate then up (TensorSpec.fused_with; one LoRA
module, as PEFT's). GLM-4-0414 adds a norm after each sublayer
(ModelConfig.block.post_norms): post_self_attn_layernorm and post_mlp_layernorm, while its
post_attention_layernorm stays the MLP's input norm.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, register_family, rope_from_hf
from engine.models.families.base import rope_parameters_to_hf as _rope_parameters


@register_family
class Glm(Family):
    name = "glm"
    architecture = "GlmForCausalLM"
    model_type = "glm"
    fixed = {"rope_interleave": True}
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1.5625e-07,
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
    }
    unsupported_flags = ()  # attention_bias is the q/k/v biases (qkv_bias)
    hf_constants = {}

    def _partial_rotary_factor(self, hf: dict) -> float:
        return float(
            (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or self.hf_value(hf, "partial_rotary_factor")
        )

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        )
        rope.pop("partial_rotary_factor", None)  # rotary_dim, below
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = int(head_dim * self._partial_rotary_factor(hf))
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ConfigError(
                f"config.json ({self.architecture}): partial_rotary_factor gives {rotary} rotary dimensions of "
                f"head_dim {head_dim}; they must be even and at most head_dim"
            )
        return {
            "rotary_dim": None if rotary == head_dim else rotary,
            "qkv_bias": bool(self.hf_value(hf, "attention_bias")),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        factor = (cfg.rope.rotary_dim or cfg.attention.head_dim) / cfg.attention.head_dim
        return {
            "rope_parameters": {**_rope_parameters(cfg.rope.theta, cfg.rope.scaling), "partial_rotary_factor": factor},
            "partial_rotary_factor": factor,  # where published configs (and transformers 4) have it
            "attention_bias": cfg.attention.qkv_bias,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        biases = [
            TensorSpec(
                ("attn", f"b{x}_{'nh' if x == 'q' else 'kh'}"), LAYER + f"self_attn.{x}_proj.bias", None, flatten=True
            )
            for x in "qkv"
        ]
        return [*super().attention_tensors(cfg), *(biases if cfg.attention.qkv_bias else [])]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [
            TensorSpec(("mlp", "w_gate_df"), LAYER + "mlp.gate_up_proj.weight", 1, fused_with=(("mlp", "w_up_df"),)),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.down_proj.weight", 1),
        ]


@register_family
class Glm4(Glm):
    name = "glm4"
    architecture = "Glm4ForCausalLM"
    model_type = "glm4"
    fixed = {**Glm.fixed, "post_norms": True}

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        # HF names: post_self_attn_layernorm after attention, post_attention_layernorm before the MLP.
        return [
            TensorSpec(("post_attn_norm", "scale"), LAYER + "post_self_attn_layernorm.weight", None),
            TensorSpec(("mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_mlp_layernorm.weight", None),
        ]

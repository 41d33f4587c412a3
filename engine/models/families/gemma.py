"""Gemma, Gemma 2 and Gemma 3 text (GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM).

All three: GeGLU, RMSNorm scales stored zero-centred (x * (1 + w)), embeddings scaled by
sqrt(d_model), tied embeddings by default. Gemma 2 adds a norm after each sublayer,
alternating local/global layers, `query_pre_attn_scalar` and logit soft-caps; Gemma 3 adds
QK-norm, five local layers per global one and its own RoPE base for local layers.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    layer_types_to_hf,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)

_GEMMA = {"norm_zero_centered": True, "scale_embeddings": True}
_FLAGS = {"attention_bias": False, "use_bidirectional_attention": None}


@register_family
class Gemma(Family):
    name = "gemma"
    architecture = "GemmaForCausalLM"
    model_type = "gemma"
    fixed = _GEMMA
    hf_defaults = {"max_position_embeddings": 8192, "tie_word_embeddings": True}
    hf_constants = _FLAGS

    def activation_from_hf(self, hf: dict) -> str:
        name = super().activation_from_hf(hf)
        return "gelu_pytorch_tanh" if name == "gelu" else name  # old Gemma configs; transformers reads tanh

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        # transformers 5 reads hidden_act; transformers 4's GemmaMLP reads hidden_activation.
        return {"hidden_activation": self.activation_to_hf(cfg)}


@register_family
class Gemma2(Family):
    name = "gemma2"
    architecture = "Gemma2ForCausalLM"
    model_type = "gemma2"
    fixed = {**_GEMMA, "post_norms": True}
    hf_defaults = {
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    }
    activation_key = "hidden_activation"
    hf_constants = _FLAGS

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        # An explicit null soft-cap means none, so these are not hf_value (which fills nulls).
        return {
            "query_pre_attn_scalar": self.hf_value(hf, "query_pre_attn_scalar"),
            "attn_logit_softcap": hf.get("attn_logit_softcapping", self.hf_defaults.get("attn_logit_softcapping")),
            "final_logit_softcap": hf.get("final_logit_softcapping", self.hf_defaults.get("final_logit_softcapping")),
        }

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        scalar = cfg.attention.query_pre_attn_scalar
        return {
            **layer_types_to_hf(cfg),
            "query_pre_attn_scalar": int(scalar) if scalar and scalar.is_integer() else scalar,  # an int field
            "attn_logit_softcapping": cfg.attention.softcap,
            "final_logit_softcapping": cfg.head.softcap,
        }

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        # Here post_attention_layernorm is the attention output's norm, not the MLP's input.
        return [
            TensorSpec(("post_attn_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("mlp_norm", "scale"), LAYER + "pre_feedforward_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_feedforward_layernorm.weight", None),
        ]


@register_family
class Gemma3(Gemma2):
    name = "gemma3"
    architecture = "Gemma3ForCausalLM"
    model_type = "gemma3_text"
    fixed = {**Gemma2.fixed, "qk_norm": True}
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    }
    hf_constants = {**_FLAGS, "use_bidirectional_attention": False}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(num_layers)]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # Global and local layers have their own RoPE: transformers 5 keys them by layer
        # type, older configs give the local base as rope_local_base_freq.
        rope = hf.get("rope_parameters")
        if rope and "full_attention" in rope:
            global_rope, local_rope = rope["full_attention"], rope.get("sliding_attention") or {}
        else:
            global_rope = {"rope_theta": self.hf_value(hf, "rope_theta"), **(hf.get("rope_scaling") or {})}
            local_rope = {"rope_theta": self.hf_value(hf, "rope_local_base_freq")}
        local_theta, local_scaling = rope_from_hf({"rope_theta": 10_000.0, **local_rope}, where)
        if local_scaling is not None:
            raise ConfigError(f"{where}: RoPE scaling of sliding-window layers is not supported")
        theta, scaling = rope_from_hf(global_rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        local_theta = cfg.rope.local_theta or cfg.rope.theta
        keys = {
            **super().extra_hf_keys(cfg),
            "rope_local_base_freq": local_theta,  # transformers 4
            "rope_parameters": {
                "full_attention": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
                "sliding_attention": rope_parameters_to_hf(local_theta, None),
            },
        }
        # The older key for the layer pattern: n-1 local layers then a global one, if it is that.
        period = len(cfg.attention.pattern)
        if cfg.attention.pattern == ["local"] * (period - 1) + ["global"]:
            keys.update(sliding_window_pattern=period, _sliding_window_pattern=period)
        return keys

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

"""GPT-OSS (GptOssForCausalLM): OpenAI's open-weight mixture of experts.

Every layer: attention with biases on q, k, v and o and a learned sink logit per head
(`attention_sinks`), a sliding window on every other layer from the first (`layer_types`),
YaRN RoPE; then a router with a bias (a Linear), softmax over the k best logits, and E
experts with biases and a clamped SwiGLU (engine/models/moe.py: clamped_swiglu).

transformers stores each layer's experts as stacked tensors, not one per expert:
`gate_up_proj` (E, d, 2f) holds gate and up interleaved (gate at even columns, up at odd),
already (in, out), as is `down_proj` (E, f, d). The tensor table splits and rejoins them
(TensorSpec.interleaved_with). Published checkpoints store the experts in MXFP4
(`quantization_config` quant_method "mxfp4": `gate_up_proj_blocks` and `_scales`, ...);
conversion dequantizes them exactly (engine/interop/hf/convert.py: dequantize_mxfp4). Other
quantization methods are refused: dequantize them first.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    layer_types_to_hf,
    register_family,
    rope_parameters_to_hf,
    rope_to_hf,
)

# transformers' GptOssConfig default when config.json has no RoPE settings
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@register_family
class GptOss(Family):
    name = "gpt_oss"
    architecture = "GptOssForCausalLM"
    model_type = "gpt_oss"
    moe = True
    fixed = {
        "qkv_bias": True,
        "attention_out_bias": True,
        "attention_sinks": True,
        "router_score": "softmax",
        "router_renormalize": True,
        "router_logits_bias": True,
        "expert_bias": True,
    }
    # softmax then renormalised top-k = transformers' softmax over the top-k logits
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000.0,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
    }
    unsupported_flags = ()  # attention_bias is the architecture: its absence is refused instead
    hf_constants = {"attention_bias": True, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        method = (hf.get("quantization_config") or {}).get("quant_method", "?")
        if hf.get("quantization_config") and method != "mxfp4":  # MXFP4 experts: dequantized on conversion
            raise ConfigError(
                f"{where}: quantization_config ({method}) is not supported; dequantize the weights "
                f"first (transformers: dequantize=True in its quantization config, then save_pretrained)"
            )
        if hf.get("attention_bias") is False:
            raise ConfigError(f"{where}: attention_bias=false is not supported (GPT-OSS's projections have biases)")
        return super().config_from_hf(hf, where)

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
            hf = {**hf, "rope_scaling": DEFAULT_ROPE}
        return super().rope_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        return {
            "num_experts": self.hf_value(hf, "num_local_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "swiglu_limit": float(self.hf_value(hf, "swiglu_limit")),
            "swiglu_alpha": float(self.hf_value(hf, "swiglu_alpha")),
        }

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        rope = {}
        if cfg.rope.scaling is not None and cfg.rope.scaling.kind == "yarn":  # written in full, as GptOssConfig does
            betas = {"beta_fast": cfg.rope.scaling.beta_fast, "beta_slow": cfg.rope.scaling.beta_slow}
            rope = {
                "rope_parameters": {**rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling), **betas},
                "rope_scaling": {**(rope_to_hf(cfg.rope.scaling) or {}), **betas},  # not None: the scaling is set
            }
        return {
            **rope,
            **layer_types_to_hf(cfg),
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "swiglu_limit": cfg.moe.swiglu_limit,
            "swiglu_alpha": cfg.moe.swiglu_alpha,
        }

    def extra_attention_tensors(self) -> list[TensorSpec]:
        biases = [
            TensorSpec(
                ("attn", f"b{x}_{'nh' if x == 'q' else 'kh'}"), LAYER + f"self_attn.{x}_proj.bias", None, flatten=True
            )
            for x in "qkv"
        ]
        return [
            *biases,
            TensorSpec(("attn", "bo_d"), LAYER + "self_attn.o_proj.bias", None),
            TensorSpec(("attn", "sinks_n"), LAYER + "self_attn.sinks", None),
        ]

    def mlp_tensors(self, cfg) -> list[TensorSpec]:
        experts = LAYER + "mlp.experts."
        return [
            TensorSpec(("mlp", "w_router_de"), LAYER + "mlp.router.weight", 1),
            TensorSpec(("mlp", "b_logits_e"), LAYER + "mlp.router.bias", None),
            TensorSpec(("mlp", "w_gate_edf"), experts + "gate_up_proj", None, interleaved_with=(("mlp", "w_up_edf"),)),
            TensorSpec(
                ("mlp", "b_gate_ef"), experts + "gate_up_proj_bias", None, interleaved_with=(("mlp", "b_up_ef"),)
            ),
            TensorSpec(("mlp", "w_down_efd"), experts + "down_proj", None),
            TensorSpec(("mlp", "b_down_ed"), experts + "down_proj_bias", None),
        ]

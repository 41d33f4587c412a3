"""OLMo 2 and OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): Llama with the norms moved.

Each sublayer's output is normalised before the residual add and its input is not,
x + norm(attn(x)) (ModelConfig.block.pre_norms false, post_norms true), and the QK norm is one
RMSNorm over all heads' dimensions of the projected queries (keys), before the heads are
split (qk_norm_across_heads): HF's (heads * head_dim,) scale. OLMo 3 adds sliding-window
layers (three local, one global by default) whose RoPE is unscaled, like Gemma 3's.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
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


@register_family
class Olmo2(Family):
    name = "olmo2"
    architecture = "Olmo2ForCausalLM"
    model_type = "olmo2"
    fixed = {"qk_norm": True, "qk_norm_across_heads": True, "pre_norms": False, "post_norms": True}
    hf_defaults = {"max_position_embeddings": 2048, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False}

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [spec for spec in super().attention_tensors(cfg) if spec.path[0] != "attn_norm"]

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors(flatten=True)

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec(("post_attn_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_feedforward_layernorm.weight", None),
        ]


@register_family
class Olmo3(Olmo2):
    name = "olmo3"
    architecture = "Olmo3ForCausalLM"
    model_type = "olmo3"
    hf_defaults = {**Olmo2.hf_defaults, "rope_theta": 500_000.0, "sliding_window": 4096}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        return ["sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(num_layers)]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # RoPE per layer type (transformers 5); an older file's rope_theta/rope_scaling are the
        # global layers', and the sliding layers' is the same base, unscaled.
        rope = hf.get("rope_parameters")
        default = {"rope_theta": self.hf_value(hf, "rope_theta")}
        if rope and "full_attention" in rope:
            global_rope = {**default, **(rope["full_attention"] or {})}
            local_rope = {**default, **(rope.get("sliding_attention") or {})}
        else:
            global_rope = {**default, **(rope or {}), **(hf.get("rope_scaling") or {})}
            local_rope = {"rope_theta": global_rope["rope_theta"]}
        local_theta, local_scaling = rope_from_hf(local_rope, where)
        if local_scaling is not None:
            raise ConfigError(f"{where}: RoPE scaling of sliding-window layers is not supported")
        theta, scaling = rope_from_hf(global_rope, where)
        same = scaling is None and local_theta == theta
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": None if same else local_theta}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local_theta = cfg.rope.local_theta or cfg.rope.theta
        return {
            **layer_types_to_hf(cfg),
            "rope_parameters": {
                "full_attention": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
                "sliding_attention": rope_parameters_to_hf(local_theta, None),
            },
        }

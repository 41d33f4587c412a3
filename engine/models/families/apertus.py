"""Apertus (ApertusForCausalLM; swiss-ai/Apertus-8B-2509, -70B-2509): Llama with a QK norm and
an ungated MLP whose activation is xIELU (engine/models/xielu.py).

Attention as Llama's plus an RMSNorm over head_dim on queries and keys before RoPE (as
Qwen 3); the layer's two norms are named attention_layernorm and feedforward_layernorm. The
MLP is down(xielu(up(x))) (ModelConfig.mlp.gated false, activation xielu) with the two
learned scalars of each layer's xIELU (`mlp.act_fn.alpha_p`, `alpha_n`); its constant `beta`
and `eps` buffers are skipped on conversion and written back on export (Family.
constant_tensors), since transformers fills buffers a checkpoint lacks with garbage. Without
RoPE settings transformers' default is Llama 3 scaling (base 12M, factor 8 over 8,192).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, qk_norm_tensors, register_family
from engine.models.specs import XIELU_BETA, XIELU_EPS

DEFAULT_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 12000000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 8192,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
}
"""transformers' ApertusConfig RoPE where config.json has none."""
CONSTANTS = ("beta", "eps")
"""The xIELU buffers of each layer (`mlp.act_fn.{name}`): engine/models/xielu.py's BETA, EPS."""


@register_family
class Apertus(Family):
    name = "apertus"
    architecture = "ApertusForCausalLM"
    model_type = "apertus"
    fixed = {"qk_norm": True, "mlp_gated": False}
    hf_defaults = {"max_position_embeddings": 65536, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    # transformers' ApertusMLP has no biases whatever mlp_bias says (published configs write it)
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False}

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("rope_parameters") is None and hf.get("rope_theta") is None and hf.get("rope_scaling") is None:
            hf = {**hf, "rope_parameters": DEFAULT_ROPE}
        return super().rope_from_hf(hf, where)

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [
            TensorSpec(("attn_norm", "scale"), LAYER + "attention_layernorm.weight", None),
            *super().attention_tensors(cfg)[1:],  # the projections
        ]

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return [TensorSpec(("mlp_norm", "scale"), LAYER + "feedforward_layernorm.weight", None)]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        xielu = (
            [
                TensorSpec(("mlp", "xielu_alpha_p"), LAYER + "mlp.act_fn.alpha_p", None),
                TensorSpec(("mlp", "xielu_alpha_n"), LAYER + "mlp.act_fn.alpha_n", None),
            ]
            if cfg.mlp.activation == "xielu"
            else []
        )
        return [
            TensorSpec(("mlp", "w_up_df"), LAYER + "mlp.up_proj.weight", 1),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.down_proj.weight", 1),
            *xielu,
        ]

    def constant_tensors(self, cfg: ModelConfig) -> dict[str, float]:
        if cfg.mlp.activation != "xielu":
            return {}
        values = dict(zip(CONSTANTS, (XIELU_BETA, XIELU_EPS), strict=True))
        return {f"model.layers.{i}.mlp.act_fn.{k}": values[k] for i in range(cfg.num_layers) for k in CONSTANTS}

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        layer = name.removeprefix("model.layers.").split(".", 1)
        return cfg.mlp.activation == "xielu" and len(layer) == 2 and layer[1] in {f"mlp.act_fn.{k}" for k in CONSTANTS}

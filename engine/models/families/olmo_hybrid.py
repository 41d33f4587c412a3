"""OLMo Hybrid (allenai/Olmo-Hybrid-7B; transformers' olmo_hybrid, OlmoHybridForCausalLM).

Gated DeltaNet layers (`linear_attention`) among OLMo 3 attention layers (`full_attention`, by
default every fourth). The attention layers are OLMo 3's: post-norms only, x + norm(attn(x)),
the QK norm one RMSNorm over all heads (qk_norm_across_heads), RoPE (none when rope_parameters
has no rope_theta). The linear layers are pre-norm, x + mixer(norm(x)) (block.linear_pre_norms),
engine/models/gated_delta_block.py's mixer with q, k, v, the output gate g, b and a each a
projection of its own (q_proj, k_proj, v_proj: slices of the engine's one w_qkv_dc), the write
strength 2 sigmoid(b) (linear_allow_neg_eigval: beta_scale 2) and its gated output norm's
epsilon 1e-5 (transformers fixes it). The linear_a_log_*/linear_dt_* keys are initialisation
ranges of transformers' class, not the model: read at any value, written at transformers'
defaults.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    gated_mlp_tensors,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
    shortest_period,
)

GATED_NORM_EPS = 1e-5
"""The epsilon of the linear layers' gated output norm (OlmoHybridGatedDeltaNet fixes it)."""
INIT_KEYS = {
    "linear_a_log_min": 0.0,
    "linear_a_log_max": 16.0,
    "linear_dt_min": 0.001,
    "linear_dt_max": 0.1,
    "linear_dt_init_floor": 1e-4,
}
"""transformers' initialisation ranges of the linear layers' A_log and dt_bias (its defaults)."""


@register_family
class OlmoHybrid(Family):
    name = "olmo_hybrid"
    architecture = "OlmoHybridForCausalLM"
    model_type = "olmo_hybrid"
    fixed = {"qk_norm": True, "qk_norm_across_heads": True, "pre_norms": False, "post_norms": True}
    hf_defaults = {
        "max_position_embeddings": 65536,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "linear_conv_kernel_dim": 4,
        "linear_allow_neg_eigval": True,
    }
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False, **INIT_KEYS}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if self.activation_from_hf(hf) != "silu":  # also the linear layers' convolution activation
            raise ConfigError(f"{where}: hidden_act '{self.activation_from_hf(hf)}' is not supported (silu)")
        fields = super().config_from_hf(hf, where)
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        fields["head_dim"] = d // heads  # OlmoHybridConfig has no head_dim key
        layers = fields["num_layers"]
        types = hf.get("layer_types") or [
            "full_attention" if i % 4 == 3 or (layers < 4 and i == layers - 1) else "linear_attention"
            for i in range(layers)
        ]
        if len(types) != layers or set(types) - {"linear_attention", "full_attention"}:
            raise ConfigError(
                f"{where}: layer_types must be {layers} entries of linear_attention or full_attention, not {types}"
            )
        key_heads = hf.get("linear_num_key_heads") or heads
        value_heads = hf.get("linear_num_value_heads") or heads
        if key_heads != value_heads:  # transformers' layer does not repeat key heads over value heads
            raise ConfigError(
                f"{where}: linear_num_key_heads {key_heads} must equal linear_num_value_heads {value_heads}"
            )
        key_dim = hf.get("linear_key_head_dim") or int(0.75 * d / key_heads)
        mixers = ["gated_delta" if t == "linear_attention" else "attention" for t in types]
        return {
            **fields,
            "mixer_pattern": shortest_period(mixers),
            "linear_pre_norms": True,
            "rope_pattern": None if self._theta(hf) is not None else [False],
            "gated_delta": {
                "num_key_heads": key_heads,
                "num_value_heads": value_heads,
                "key_head_dim": key_dim,
                "value_head_dim": hf.get("linear_value_head_dim") or 2 * key_dim,
                "conv_kernel": self.hf_value(hf, "linear_conv_kernel_dim"),
                "beta_scale": 2.0 if self.hf_value(hf, "linear_allow_neg_eigval") else 1.0,
                "norm_eps": GATED_NORM_EPS,
            },
        }

    def _theta(self, hf: dict) -> float | None:
        rope = hf.get("rope_parameters")
        return (rope or {}).get("rope_theta") if "rope_parameters" in hf else hf.get("rope_theta", 10000.0)

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(hf.get("rope_parameters") or {})
        if self._theta(hf) is None:  # NoPE: transformers builds no rotary embedding
            return {"rope_theta": 10000.0, "rope_scaling": None}
        theta, scaling = rope_from_hf(
            {"max_position_embeddings": self.hf_value(hf, "max_position_embeddings"), **rope}, where
        )
        return {"rope_theta": theta, "rope_scaling": scaling}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        for key in ("head_dim", "rope_theta", "rope_scaling", "pretraining_tp"):
            hf.pop(key, None)
        gd = cfg.gated_delta
        assert gd is not None  # every OLMo Hybrid has linear layers
        nope = cfg.rope.pattern is not None and not any(cfg.rope.pattern)
        kinds = [layer.mixer for layer in cfg.layer_pattern()]
        return {
            **hf,
            "rope_parameters": None if nope else rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "layer_types": ["linear_attention" if kind == "gated_delta" else "full_attention" for kind in kinds],
            "linear_num_key_heads": gd.num_key_heads,
            "linear_num_value_heads": gd.num_value_heads,
            "linear_key_head_dim": gd.key_head_dim,
            "linear_value_head_dim": gd.value_head_dim,
            "linear_conv_kernel_dim": gd.conv_kernel,
            "linear_allow_neg_eigval": gd.beta_scale == 2.0,
        }

    def mixer_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        # The names the checkpoints store (transformers renames them on loading: its conversion
        # mapping's attention_layer_norm -> input_layernorm, feedforward_layer_norm ->
        # post_attention_layernorm, q/k/v_conv1d -> one conv1d).
        if layer.mixer == "attention":  # OLMo 3's: no input norm, norms after attention and MLP
            return [
                *[spec for spec in self.attention_tensors(cfg) if spec.path[0] != "attn_norm"],
                *qk_norm_tensors(flatten=True),
                TensorSpec(("post_attn_norm", "scale"), LAYER + "feedforward_layer_norm.weight", None),
                TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_feedforward_layernorm.weight", None),
            ]
        gd = cfg.gated_delta
        assert gd is not None
        attn, keys = LAYER + "linear_attn.", gd.num_key_heads * gd.key_head_dim
        values = gd.num_value_heads * gd.value_head_dim
        return [
            TensorSpec(("attn_norm", "scale"), LAYER + "attention_layer_norm.weight", None),
            TensorSpec(("attn", "a_log_v"), attn + "A_log", None),
            TensorSpec(("attn", "dt_bias_v"), attn + "dt_bias", None),
            TensorSpec(("attn", "w_qkv_dc"), attn + "q_proj.weight", 1, last_axis_slice=(0, keys)),
            TensorSpec(("attn", "w_qkv_dc"), attn + "k_proj.weight", 1, last_axis_slice=(keys, 2 * keys)),
            TensorSpec(("attn", "w_qkv_dc"), attn + "v_proj.weight", 1, last_axis_slice=(2 * keys, 2 * keys + values)),
            TensorSpec(("attn", "w_a_dv"), attn + "a_proj.weight", 1),
            TensorSpec(("attn", "w_b_dv"), attn + "b_proj.weight", 1),
            TensorSpec(("attn", "w_z_dvh"), attn + "g_proj.weight", 1),
            TensorSpec(("attn", "w_out_vhd"), attn + "o_proj.weight", 2),
            *[
                TensorSpec(
                    ("attn", "conv_c1k"),
                    attn + f"{part}_conv1d.weight",
                    None,
                    last_axis_slice=bounds,
                    slice_axis=0,
                    any_split=True,
                )
                for part, bounds in (("q", (0, keys)), ("k", (keys, 2 * keys)), ("v", (2 * keys, 2 * keys + values)))
            ],
            TensorSpec(("attn", "norm_h"), attn + "o_norm.weight", None),
            TensorSpec(("mlp_norm", "scale"), LAYER + "feedforward_layer_norm.weight", None),
        ]

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return []  # each layer kind's, in mixer_tensors

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return gated_mlp_tensors()

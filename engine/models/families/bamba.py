"""Bamba (ibm-ai-platform/Bamba-9B; transformers' bamba): each layer is a Mamba2 mixer or, at
attn_layer_indices, grouped-query attention with RoPE on the first half of each head (partial
rotary factor 0.5, which transformers fixes), then a gated SiLU MLP (`feed_forward.*`), each
sublayer as x + sublayer(RMSNorm(x)). In the engine the Mamba2 layers form the stack
`mamba2_blocks`, the attention ones `blocks`.

The Mamba2 mixer (`mamba.*`) is engine/models/mamba2.py's, its gated norm's epsilon the
model's rms_norm_eps. z_loss_coefficient is a transformers training loss term, not the model:
read at any value, written as 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    gated_mlp_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
    shortest_period,
)
from engine.models.families.nemotron_h import (
    mamba2_of,
    mamba2_tensors,
    time_step_limit_from_hf,
    time_step_limit_to_hf,
)

ROTARY_FRACTION = 0.5
"""The rotated share of each attention head (BambaConfig sets partial_rotary_factor to it)."""


def mamba2_fields(hf: dict, family: Family, d: int, where: str) -> dict[str, Any]:
    """ModelConfig.mamba2 of the mamba_* keys Bamba's (and Zamba2's) config.json files share."""
    heads = family.hf_value(hf, "mamba_n_heads")
    inner = family.hf_value(hf, "mamba_expand") * d
    head_dim = hf.get("mamba_d_head")
    head_dim = inner // heads if head_dim in (None, "auto") else head_dim
    if head_dim * heads != inner:
        raise ConfigError(f"{where}: mamba_n_heads x mamba_d_head must be mamba_expand x hidden_size ({inner})")
    return {
        "num_heads": heads,
        "head_dim": head_dim,
        "state_size": family.hf_value(hf, "mamba_d_state"),
        "n_groups": family.hf_value(hf, "mamba_n_groups"),
        "conv_kernel": family.hf_value(hf, "mamba_d_conv"),
        "chunk_size": family.hf_value(hf, "mamba_chunk_size"),
        "conv_bias": family.hf_value(hf, "mamba_conv_bias"),
        "proj_bias": family.hf_value(hf, "mamba_proj_bias"),
        "dt_limit": time_step_limit_from_hf(hf.get("time_step_limit"), where),
    }


@register_family
class Bamba(Family):
    name = "bamba"
    architecture = "BambaForCausalLM"
    model_type = "bamba"
    hf_defaults = {
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "mamba_n_heads": 128,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
    }
    unsupported_flags = ("attention_bias", "mlp_bias")
    hf_constants = {
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_cache": True,
        "num_logits_to_keep": 1,
        "z_loss_coefficient": 0.0,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        for key in keys:
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        for key in self.unsupported_flags:
            if hf.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act '{hf['hidden_act']}' is not supported (silu)")
        d, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
        attention = set(hf.get("attn_layer_indices") or [])
        if attention - set(range(layers)):
            raise ConfigError(f"{where}: attn_layer_indices {sorted(attention)} must be layers below {layers}")
        head_dim = hf.get("head_dim") or d // heads  # transformers reads an undeclared head_dim key
        if head_dim % 4:
            raise ConfigError(f"{where}: head_dim {head_dim} must be a multiple of 4 (half of it rotary, in pairs)")
        rope = dict(hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0)})
        rope.pop("partial_rotary_factor", None)  # ROTARY_FRACTION, whatever it says
        theta, scaling = rope_from_hf(
            {"max_position_embeddings": self.hf_value(hf, "max_position_embeddings"), **rope}, where
        )
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": head_dim,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": self.hf_value(hf, "rms_norm_eps"),
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            "rope_theta": theta,
            "rope_scaling": scaling,
            "rotary_dim": int(head_dim * ROTARY_FRACTION),
            "mixer_pattern": shortest_period(["attention" if i in attention else "mamba2" for i in range(layers)]),
            "mamba2": mamba2_fields(hf, self, d, where),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        m = mamba2_of(cfg)
        rope = {**rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling), "partial_rotary_factor": ROTARY_FRACTION}
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            **(
                {}
                if cfg.attention.head_dim == cfg.d_model // cfg.attention.num_heads
                else {"head_dim": cfg.attention.head_dim}
            ),
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm.eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope,
            "attn_layer_indices": [i for i, layer in enumerate(cfg.layer_pattern()) if layer.mixer == "attention"],
            "mamba_n_heads": m.num_heads,
            "mamba_d_head": m.head_dim,
            "mamba_n_groups": m.n_groups,
            "mamba_d_state": m.state_size,
            "mamba_d_conv": m.conv_kernel,
            "mamba_expand": m.num_heads * m.head_dim // cfg.d_model,
            "mamba_chunk_size": m.chunk_size,
            "mamba_conv_bias": m.conv_bias,
            "mamba_proj_bias": m.proj_bias,
            "time_step_limit": time_step_limit_to_hf(m.dt_limit),
            **self.hf_constants,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.final_layernorm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            if layers[indices[0]].mixer == "mamba2":
                mixer = mamba2_tensors(LAYER + "mamba.", cfg)
            else:
                mixer = self.attention_tensors(cfg)[1:]
            specs = [
                TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
                *mixer,
                TensorSpec(("mlp_norm", "scale"), LAYER + "pre_ff_layernorm.weight", None),
                *gated_mlp_tensors("feed_forward."),
            ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

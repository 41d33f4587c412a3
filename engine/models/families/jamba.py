"""Jamba (ai21labs/Jamba-v0.1, AI21-Jamba-Mini-1.5 / Large-1.5; transformers' jamba): layer i is
grouped-query attention without RoPE where i % attn_layer_period == attn_layer_offset, else a
Mamba1 mixer (engine/models/mamba1.py) with learned RMSNorms on dt's input, B and C; its
feed-forward is a mixture of experts where i % expert_layer_period == expert_layer_offset, else
a gated SiLU MLP, each sublayer as x + sublayer(RMSNorm(x)).

The experts: a softmax over all num_experts router logits, the top-k weights not renormalised,
each expert a gated MLP of intermediate_size (the dense layers' width too), stored one tensor
per expert (`feed_forward.experts.{j}.gate_proj` ...) beside `feed_forward.router`. num_experts
1 is a dense model. In the engine the stacks are `mamba1_blocks` / `blocks` (expert layers) and
`mamba1_dense_blocks` / `dense_blocks` (MLP layers).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    EXPERT,
    LAYER,
    Family,
    TensorSpec,
    gated_mlp_tensors,
    register_family,
    shortest_period,
)
from engine.models.families.mamba import mamba1_of, mamba1_tensors

MOE = LAYER + "feed_forward."


def period_of(flags: list[bool], key: str, cfg: ModelConfig) -> tuple[int, int]:
    """(period, offset) with flags[i] == (i % period == offset) for every layer: Jamba's
    *_layer_period and *_layer_offset of a per-layer pattern; a pattern they cannot say is
    refused in one sentence."""
    layers = len(flags)
    for period in range(1, layers + 2):
        for offset in range(period):
            if all(flag == (i % period == offset) for i, flag in enumerate(flags)):
                return period, offset
    raise ConfigError(
        f"model: family 'jamba' places its {key} layers every {key}_layer_period layers from {key}_layer_offset; "
        f"this model's ({[i for i, flag in enumerate(flags) if flag]}) are not so placed"
    )


@register_family
class Jamba(Family):
    name = "jamba"
    architecture = "JambaForCausalLM"
    model_type = "jamba"
    peft_refuses = {"dt_proj": "transformers' Jamba reads dt_proj.weight directly: PEFT's adapter there does nothing"}
    moe = None  # num_experts 1: dense
    fixed = {"rope_pattern": [False], "router_score": "softmax", "router_renormalize": False}
    hf_defaults = {
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "num_experts": 16,
        "num_experts_per_tok": 2,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": "auto",
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
    }
    unsupported_flags = ()
    hf_constants = {
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_cache": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "use_mamba_kernels": True,
        "use_mambapy": False,
        "use_associative_scan": True,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        for key in keys:
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act '{hf['hidden_act']}' is not supported (silu)")
        d, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
        value = self.hf_value
        attention = [i % value(hf, "attn_layer_period") == value(hf, "attn_layer_offset") for i in range(layers)]
        experts = value(hf, "num_experts")
        rank = value(hf, "mamba_dt_rank")
        fields = {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or d // heads,  # transformers reads an undeclared head_dim key
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": value(hf, "max_position_embeddings"),
            "norm_eps": value(hf, "rms_norm_eps"),
            "tie_embeddings": value(hf, "tie_word_embeddings"),
            "init_std": value(hf, "initializer_range"),
            "mixer_pattern": shortest_period(["attention" if a else "mamba1" for a in attention]),
            "mamba1": {
                "inner": value(hf, "mamba_expand") * d,
                "state_size": value(hf, "mamba_d_state"),
                "dt_rank": math.ceil(d / 16) if rank == "auto" else rank,
                "conv_kernel": value(hf, "mamba_d_conv"),
                "conv_bias": value(hf, "mamba_conv_bias"),
                "proj_bias": value(hf, "mamba_proj_bias"),
                "bcdt_norm": "weighted",
                "bcdt_norm_eps": value(hf, "rms_norm_eps"),
            },
            **self.fixed,
        }
        if experts > 1:  # else every layer's JambaMLP
            moe = [i % value(hf, "expert_layer_period") == value(hf, "expert_layer_offset") for i in range(layers)]
            if not any(moe):
                raise ConfigError(f"{where}: expert_layer_offset puts experts in none of the {layers} layers")
            fields.update(
                num_experts=experts,
                experts_per_token=value(hf, "num_experts_per_tok"),
                ffn_pattern=None if all(moe) else shortest_period(["moe" if m else "mlp" for m in moe]),
            )
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        m, layers = mamba1_of(cfg), cfg.layer_pattern()
        attention_period, attention_offset = period_of([x.mixer == "attention" for x in layers], "attn", cfg)
        expert_period, expert_offset = 2, 1  # transformers' defaults, read by no layer of a dense model
        if cfg.is_moe:
            expert_period, expert_offset = period_of([x.ffn == "moe" for x in layers], "expert", cfg)
        if m.inner % cfg.d_model or m.bcdt_norm_eps != cfg.norm.eps:
            raise ConfigError(
                "model: family 'jamba' has mamba1.inner a whole multiple of d_model and mamba1.bcdt_norm_eps = norm_eps"
            )
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
            "num_experts": cfg.moe.num_experts if cfg.is_moe else 1,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "expert_layer_period": expert_period,
            "expert_layer_offset": expert_offset,
            "attn_layer_period": attention_period,
            "attn_layer_offset": attention_offset,
            "mamba_d_state": m.state_size,
            "mamba_d_conv": m.conv_kernel,
            "mamba_expand": m.inner // cfg.d_model,
            "mamba_dt_rank": m.dt_rank,
            "mamba_conv_bias": m.conv_bias,
            "mamba_proj_bias": m.proj_bias,
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
            layer = layers[indices[0]]
            if layer.mixer == "mamba1":
                mixer = mamba1_tensors(LAYER + "mamba.", cfg)
            else:
                mixer = self.attention_tensors(cfg)[1:]
            if layer.ffn == "moe":
                ffn = [
                    TensorSpec(("mlp", "w_router_de"), MOE + "router.weight", 1),
                    TensorSpec(("mlp", "w_gate_edf"), MOE + EXPERT + "gate_proj.weight", 1, experts=True),
                    TensorSpec(("mlp", "w_up_edf"), MOE + EXPERT + "up_proj.weight", 1, experts=True),
                    TensorSpec(("mlp", "w_down_efd"), MOE + EXPERT + "down_proj.weight", 1, experts=True),
                ]
            else:
                ffn = gated_mlp_tensors("feed_forward.")
            specs = [
                TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
                *mixer,
                TensorSpec(("mlp_norm", "scale"), LAYER + "pre_ff_layernorm.weight", None),
                *ffn,
            ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

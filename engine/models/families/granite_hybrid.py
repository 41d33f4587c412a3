"""Granite 4 hybrid (ibm-granite/granite-4.0-h-*; transformers' granitemoehybrid): each layer is
a Mamba2 mixer or an attention mixer (no RoPE unless position_embedding_type is "rope"),
then a gated MLP (`shared_mlp`, gate and up fused in input_linear), with Granite's
multipliers: embeddings times embedding_multiplier, each sublayer's output times
residual_multiplier before the residual add, attention scores times attention_multiplier
(not head_dim^-0.5), logits divided by logits_scaling.

The dense hybrids (num_local_experts 0: H-Micro, H-1B, H-350M) and the mixture-of-experts
ones (H-Tiny, H-Small) are supported: in those every layer's feed-forward is num_local_experts
experts of intermediate_size (softmax over the top-k router logits, engine/models/moe.py's
renormalised softmax; stacked `block_sparse_moe.input_linear` (E, 2f, d) with gate then up,
`output_linear` (E, d, f)) plus the shared MLP of shared_intermediate_size as a shared expert.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine import flat_keys
from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    register_family,
    rope_parameters_to_hf,
    shortest_period,
)
from engine.models.families.nemotron_h import (
    mamba2_of,
    mamba2_tensors,
    time_step_limit_from_hf,
    time_step_limit_to_hf,
)

KINDS = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "attention", "attention": "attention"}
"""layer_types (transformers 5's names, and the published configs' older ones) -> the mixer kind."""
MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "logits_scaling")
"""config.json keys that are the ModelConfig fields of the same name, 1.0 meaning None."""
MLP = ("w_gate_df", "w_up_df", "w_down_fd")
MOE = LAYER + "block_sparse_moe."


def _experts() -> list[TensorSpec]:
    """The router and the stacked experts: input_linear (E, 2f, d) gate then up, output_linear (E, d, f)."""
    return [
        TensorSpec(("mlp", "w_router_de"), MOE + "router.layer.weight", 1),
        TensorSpec(
            ("mlp", "w_gate_edf"),
            MOE + "input_linear.weight",
            None,
            concatenated_with=(("mlp", "w_up_edf"),),
            swap_last=True,
        ),
        TensorSpec(("mlp", "w_down_efd"), MOE + "output_linear.weight", None, swap_last=True),
    ]


@register_family
class GraniteHybrid(Family):
    name = "granite_hybrid"
    architecture = "GraniteMoeHybridForCausalLM"
    model_type = "granitemoehybrid"
    moe = None  # dense and expert models
    hf_defaults = {
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_expand": 2,
        "mamba_n_heads": 128,
        "attention_multiplier": 1.0,
    }
    unsupported_flags = ("attention_bias",)
    hf_constants = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_cache": True,
        # the experts' keys, unread by a model without experts, at transformers' defaults
        "num_local_experts": 0,
        "num_experts_per_tok": 2,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "shared_intermediate_size",
            "vocab_size",
        ):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        for key in self.unsupported_flags:
            if hf.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported")
        experts = hf.get("num_local_experts", 8)  # (transformers' default is 8)
        if experts and hf.get("intermediate_size") is None:
            raise ConfigError(f"{where}: missing key 'intermediate_size' (the experts' width)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act '{hf['hidden_act']}' is not supported (silu)")
        d, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
        types = hf.get("layer_types") or hf.get("layers_block_type") or ["linear_attention"] * layers
        unknown = sorted(set(types) - set(KINDS))
        if unknown or len(types) != layers:
            raise ConfigError(f"{where}: layer_types must name {layers} layers of {', '.join(KINDS)}")
        position = hf.get("position_embedding_type")
        if position not in (None, "nope", "rope"):
            raise ConfigError(f"{where}: position_embedding_type '{position}' is not supported (rope, nope, null)")
        mamba_heads = self.hf_value(hf, "mamba_n_heads")
        inner = self.hf_value(hf, "mamba_expand") * d
        head_dim = hf.get("mamba_d_head")
        head_dim = inner // mamba_heads if head_dim in (None, "auto") else head_dim
        if head_dim * mamba_heads != inner:
            raise ConfigError(f"{where}: mamba_n_heads x mamba_d_head must be mamba_expand x hidden_size ({inner})")
        multipliers = {}
        for key in MULTIPLIERS:
            value = float(self.hf_value(hf, key, 1.0))
            multipliers[key] = None if value == 1.0 else value
        rope = self.rope_from_hf(hf, where)  # kept (and written back) by NoPE models too
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            # transformers reads an undeclared head_dim key where config.json has one
            "head_dim": hf.get("head_dim") or d // heads,
            "mlp_dim": hf["shared_intermediate_size"],
            "max_seq_len": self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": self.hf_value(hf, "rms_norm_eps"),
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            **rope,
            "rope_pattern": None if position == "rope" else [False],
            "mixer_pattern": shortest_period([KINDS[t] for t in types]),
            "mamba2": {
                "num_heads": mamba_heads,
                "head_dim": head_dim,
                "state_size": self.hf_value(hf, "mamba_d_state"),
                "n_groups": self.hf_value(hf, "mamba_n_groups"),
                "conv_kernel": self.hf_value(hf, "mamba_d_conv"),
                "chunk_size": self.hf_value(hf, "mamba_chunk_size"),
                "conv_bias": self.hf_value(hf, "mamba_conv_bias"),
                "proj_bias": self.hf_value(hf, "mamba_proj_bias"),
                "dt_limit": time_step_limit_from_hf(hf.get("time_step_limit"), where),
            },
            "attention_scale": float(self.hf_value(hf, "attention_multiplier")),
            **multipliers,
            **(self._experts_from_hf(hf, experts) if experts else {}),
        }

    def _experts_from_hf(self, hf: dict, experts: int) -> dict[str, Any]:
        """The expert models' fields: every layer's experts beside the shared MLP (a shared expert)."""
        width, shared = hf["intermediate_size"], hf["shared_intermediate_size"]
        return {
            "num_experts": experts,
            "experts_per_token": hf.get("num_experts_per_tok") or 2,
            "expert_mlp_dim": width,
            "router_score": "softmax",
            "router_renormalize": True,  # softmax over the top-k logits
            "num_shared_experts": 1,
            "shared_expert_mlp_dim": None if shared == width else shared,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        m, rope = mamba2_of(cfg), cfg.rope.pattern is None
        kinds = {"mamba2": "linear_attention", "attention": "full_attention"}
        hf = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.moe_mlp_dim if cfg.is_moe else cfg.mlp.dim,  # the experts' width
            "shared_intermediate_size": cfg.shared_mlp_dim if cfg.is_moe else cfg.mlp.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm.eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "position_embedding_type": "rope" if rope else None,
            "layer_types": [kinds[layer.mixer] for layer in cfg.layer_pattern()],
            **(
                {}
                if cfg.attention.head_dim == cfg.d_model // cfg.attention.num_heads
                else {"head_dim": cfg.attention.head_dim}
            ),
            "mamba_n_heads": m.num_heads,
            "mamba_n_groups": m.n_groups,
            "mamba_d_state": m.state_size,
            "mamba_d_head": m.head_dim,
            "mamba_d_conv": m.conv_kernel,
            "mamba_expand": m.num_heads * m.head_dim // cfg.d_model,
            "mamba_chunk_size": m.chunk_size,
            "mamba_conv_bias": m.conv_bias,
            "mamba_proj_bias": m.proj_bias,
            "time_step_limit": time_step_limit_to_hf(m.dt_limit),
            "attention_multiplier": cfg.attention.scale,
            **{key: flat_keys.value(cfg, key) or 1.0 for key in MULTIPLIERS},
            **self.hf_constants,
        }
        if cfg.is_moe:
            hf.update(num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.experts_per_token)
        return hf

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            if layers[indices[0]].mixer == "mamba2":
                mixer = mamba2_tensors(LAYER + "mamba.", cfg)
            else:
                mixer = [
                    TensorSpec(("attn", w), LAYER + f"self_attn.{x}_proj.weight", 2 if x == "o" else 1)
                    for w, x in (("wq_dnh", "q"), ("wk_dkh", "k"), ("wv_dkh", "v"), ("wo_nhd", "o"))
                ]
            shared = ("w_shared_gate_dg", "w_shared_up_dg", "w_shared_down_gd") if cfg.is_moe else MLP
            specs = [
                TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
                *mixer,
                TensorSpec(("mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
                *(_experts() if cfg.is_moe else []),
                TensorSpec(
                    ("mlp", shared[0]), LAYER + "shared_mlp.input_linear.weight", 1, fused_with=(("mlp", shared[1]),)
                ),
                TensorSpec(("mlp", shared[2]), LAYER + "shared_mlp.output_linear.weight", 1),
            ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

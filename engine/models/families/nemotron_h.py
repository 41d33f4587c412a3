"""Nemotron-H (nvidia/Nemotron-H-4B/8B/47B/56B, Nemotron Nano 2; transformers' nemotron_h): a
hybrid whose every layer is ONE of a Mamba2 mixer, an attention mixer (no RoPE: the Mamba2
layers carry position), or an MLP, each as x + sublayer(RMSNorm(x)).

transformers names a layer's kind in `layers_block_type` (older config.json files:
`hybrid_override_pattern`, one character a layer: M Mamba2, * attention, - MLP, E experts). In
the engine a layer is a (mixer, feed-forward) pair with one of the two "none":
M = (mamba2, none), * = (attention, none), - = (none, mlp), E = (none, moe). The MLP is not
gated: down(relu(up(x))^2).

The mixture-of-experts layers (E, Nemotron 3) are engine/models/moe.py's experts without a gate
(mlp_gated false: each expert down(relu2(up(x))), published as mixer.experts.{j}.up_proj /
down_proj), DeepSeek-V3's router (sigmoid scores, e_score_correction_bias choosing only,
n_group / topk_group groups scored by their two best, norm_topk_prob, routed_scaling_factor)
and one ungated shared expert of moe_shared_expert_intermediate_size (transformers builds one
whatever n_shared_experts says). moe_latent_size (experts in a projected space) is refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.config import ConfigError
from engine.models.config import Mamba2Config, ModelConfig
from engine.models.families.base import EXPERT, Family, TensorSpec, register_family, shortest_period

PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
"""hybrid_override_pattern's characters -> layers_block_type's names."""
KINDS = {
    "linear_attention": ("mamba2", "none"),
    "full_attention": ("attention", "none"),
    "mlp": ("none", "mlp"),
    "moe": ("none", "moe"),
}
"""layers_block_type -> the engine's (mixer, ffn)."""
LAYER = "backbone.layers.{i}."  # transformers saves NemotronHForCausalLM's model as `backbone`, as published
MOE = LAYER + "mixer."
MAMBA_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_dt_limit": "time_step_limit",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
}
"""Older config.json keys transformers still reads (NemotronHConfig.__post_init__)."""


def mamba2_of(cfg: ModelConfig) -> Mamba2Config:
    """cfg.mamba2, which a model with Mamba2 layers has (ModelConfig checks)."""
    assert cfg.mamba2 is not None
    return cfg.mamba2


def mamba2_tensors(prefix: str, cfg: ModelConfig) -> list[TensorSpec]:
    """A Mamba2 mixer's tensors (engine/models/mamba2.py) under `prefix` (with `{i}` for the
    layer: `backbone.layers.{i}.mixer.`, `model.layers.{i}.mamba.`): transformers' Mamba2 layers
    all name them alike."""
    specs = [
        TensorSpec(("attn", "w_in_dp"), prefix + "in_proj.weight", 1),
        TensorSpec(("attn", "conv_c1k"), prefix + "conv1d.weight", None),
        TensorSpec(("attn", "dt_bias_h"), prefix + "dt_bias", None),
        TensorSpec(("attn", "a_log_h"), prefix + "A_log", None),
        TensorSpec(("attn", "d_h"), prefix + "D", None),
        TensorSpec(("attn", "norm_f"), prefix + "norm.weight", None),
        TensorSpec(("attn", "w_out_fd"), prefix + "out_proj.weight", 1),
    ]
    if mamba2_of(cfg).conv_bias:
        specs.insert(2, TensorSpec(("attn", "conv_bias_c"), prefix + "conv1d.bias", None))
    if mamba2_of(cfg).proj_bias:
        specs.insert(1, TensorSpec(("attn", "b_in_p"), prefix + "in_proj.bias", None))
        specs.append(TensorSpec(("attn", "b_out_d"), prefix + "out_proj.bias", None))
    return specs


def time_step_limit_from_hf(value, where: str) -> list[float] | None:
    """ModelConfig's Mamba2 dt_limit of config.json's time_step_limit (None: transformers'
    default (0, inf), no clamp)."""
    if value is None:
        return None
    low, high = (float(v["__float__"] if isinstance(v, dict) else v) for v in value)
    if low == 0.0 and math.isinf(high):
        return None
    if not 0 <= low < high:
        raise ConfigError(f"{where}: time_step_limit {list(value)} must be two increasing numbers >= 0")
    return [low, high]


def time_step_limit_to_hf(limit) -> list[float]:
    """config.json's time_step_limit (export writes the infinity as transformers does)."""
    return [0.0, float("inf")] if limit is None else list(limit)


@register_family
class NemotronH(Family):
    name = "nemotron_h"
    architecture = "NemotronHForCausalLM"
    model_type = "nemotron_h"
    peft_refuses = {"out_proj": "PEFT refuses LoRA on a Mamba model's out_proj"}
    moe = None  # dense and expert models
    fixed = {"mlp_gated": False, "activation": "relu2", "rope_pattern": [False]}
    hf_defaults = {
        "vocab_size": 131072,
        "max_position_embeddings": 4096,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 128,
        "use_conv_bias": True,
        "use_bias": False,
        "num_key_value_heads": 8,
        "head_dim": 128,
    }
    unsupported_flags = ("attention_bias", "mlp_bias")
    hf_constants = {
        "attention_bias": False,
        "mlp_bias": False,
        # NemotronHConfig's keys the dense model does not read (initialisation, kernels, the
        # experts and multi-token-prediction layers it has none of), at transformers' defaults
        "num_logits_to_keep": 1,
        "use_mamba_kernels": True,
        "expand": 2,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "mamba_proj_bias": False,
        "mamba_ssm_cache_dtype": "float32",
        "n_routed_experts": 8,
        "output_router_logits": False,
        "n_shared_experts": 1,
        "moe_intermediate_size": 7688,
        "moe_shared_expert_intermediate_size": 7688,
        "moe_latent_size": None,
        "moe_shared_expert_overlap": True,
        "num_experts_per_tok": 2,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "mtp_layers_block_type": ["full_attention", "moe"],
        "residual_in_fp32": False,
        "hidden_dropout": 0.0,
        "rescale_prenorm_residual": True,
    }

    def block_types(self, hf: dict, where: str) -> list[str]:
        """transformers' layers_block_type, or the older hybrid_override_pattern read as it."""
        types = hf.get("layers_block_type") or hf.get("layer_types")
        if types is None:
            pattern = hf.get("hybrid_override_pattern")
            if not pattern:
                raise ConfigError(f"{where}: missing key 'layers_block_type' (or 'hybrid_override_pattern')")
            unknown = sorted(set(pattern) - set(PATTERN))
            if unknown:
                raise ConfigError(f"{where}: hybrid_override_pattern has '{unknown[0]}' (valid: M, *, -, E)")
            types = [PATTERN[c] for c in pattern]
        legacy = {"mamba": "linear_attention", "attention": "full_attention"}  # remap_legacy_layer_types
        types = [legacy.get(t, t) for t in types]
        unknown = sorted(set(types) - set(KINDS))
        if unknown:
            raise ConfigError(f"{where}: layer type '{unknown[0]}' is not supported ({', '.join(KINDS)})")
        if "moe" in types and hf.get("moe_latent_size") is not None:
            raise ConfigError(f"{where}: moe_latent_size (the experts in a projected space) is not supported; null is")
        return types

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        hf = {**hf, **{new: hf[old] for old, new in MAMBA_ALIASES.items() if hf.get(old) is not None}}
        for key in ("hidden_size", "num_attention_heads", "intermediate_size", "mamba_num_heads", "mamba_head_dim"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        for key in self.unsupported_flags:
            if hf.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported")
        for key, expected in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if hf.get(key, expected) != expected:
                raise ConfigError(f"{where}: {key} '{hf[key]}' is not supported ({expected})")
        types = self.block_types(hf, where)
        heads = hf["num_attention_heads"]
        return {
            "family": self.name,
            "vocab_size": self.hf_value(hf, "vocab_size"),
            "d_model": hf["hidden_size"],
            "num_layers": len(types),
            "num_heads": heads,
            "num_kv_heads": self.hf_value(hf, "num_key_value_heads") or heads,
            "head_dim": self.hf_value(hf, "head_dim") or hf["hidden_size"] // heads,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": self.hf_value(hf, "layer_norm_epsilon"),
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            "mixer_pattern": shortest_period([KINDS[t][0] for t in types]),
            "ffn_pattern": shortest_period([KINDS[t][1] for t in types]),
            "mamba2": {
                "num_heads": hf["mamba_num_heads"],
                "head_dim": hf["mamba_head_dim"],
                "state_size": self.hf_value(hf, "ssm_state_size", 128),
                "n_groups": self.hf_value(hf, "n_groups"),
                "conv_kernel": self.hf_value(hf, "conv_kernel"),
                "chunk_size": self.hf_value(hf, "chunk_size"),
                "conv_bias": self.hf_value(hf, "use_conv_bias"),
                "proj_bias": self.hf_value(hf, "use_bias"),
                "dt_limit": time_step_limit_from_hf(hf.get("time_step_limit"), where),
            },
            **(self._experts_from_hf(hf) if "moe" in types else {}),
            **self.fixed,
        }

    def _experts_from_hf(self, hf: dict) -> dict[str, Any]:
        """The expert layers' fields (NemotronHMoE): DeepSeek-V3's router, one shared expert."""

        def value(key):  # transformers' defaults are hf_constants'
            return self.hf_value(hf, key, self.hf_constants[key])

        width = value("moe_intermediate_size")
        shared = value("moe_shared_expert_intermediate_size")
        return {
            "num_experts": value("n_routed_experts"),
            "experts_per_token": value("num_experts_per_tok"),
            "expert_mlp_dim": width,
            "router_score": "sigmoid",
            "router_bias": True,
            "router_renormalize": bool(value("norm_topk_prob")),
            "router_groups": value("n_group"),
            "router_group_top": value("topk_group"),
            "router_scale": float(value("routed_scaling_factor")),
            "num_shared_experts": 1,
            "shared_expert_mlp_dim": None if shared == width else shared,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """NemotronHConfig's keys (transformers 5 writes layers_block_type, not num_hidden_layers)."""
        kinds = {v: k for k, v in KINDS.items()}
        types = [kinds[(layer.mixer, layer.ffn)] for layer in cfg.layer_pattern()]
        m = mamba2_of(cfg)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "layers_block_type": types,
            "tie_word_embeddings": cfg.tie_embeddings,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "head_dim": cfg.attention.head_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "attention_dropout": 0.0,
            "sliding_window": None,
            "intermediate_size": cfg.mlp.dim,
            "mlp_hidden_act": "relu2",
            "ssm_state_size": m.state_size,
            "mamba_num_heads": m.num_heads,
            "mamba_head_dim": m.head_dim,
            "mamba_hidden_act": "silu",
            "n_groups": m.n_groups,
            "conv_kernel": m.conv_kernel,
            "time_step_limit": time_step_limit_to_hf(m.dt_limit),
            "use_conv_bias": m.conv_bias,
            "chunk_size": m.chunk_size,
            "use_bias": m.proj_bias,
            "initializer_range": cfg.init_std,
            "layer_norm_epsilon": cfg.norm.eps,
            "use_cache": True,
            **self.hf_constants,
            **(self._experts_to_hf(cfg) if cfg.is_moe else {}),
        }

    def _experts_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "n_routed_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "moe_shared_expert_intermediate_size": cfg.shared_mlp_dim,
            "norm_topk_prob": cfg.moe.router_renormalize,
            "n_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_group_top,
            "routed_scaling_factor": cfg.moe.router_scale,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "backbone.embeddings.weight", None),
            TensorSpec(("final_norm", "scale"), "backbone.norm_f.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            layer = layers[indices[0]]
            if layer.mixer == "mamba2":
                specs = [
                    TensorSpec(("attn_norm", "scale"), LAYER + "norm.weight", None),
                    *mamba2_tensors(LAYER + "mixer.", cfg),
                ]
            elif layer.mixer == "attention":
                specs = [
                    TensorSpec(("attn_norm", "scale"), LAYER + "norm.weight", None),
                    *(
                        TensorSpec(("attn", w), LAYER + f"mixer.{x}_proj.weight", 2 if x == "o" else 1)
                        for w, x in (("wq_dnh", "q"), ("wk_dkh", "k"), ("wv_dkh", "v"), ("wo_nhd", "o"))
                    ),
                ]
            elif layer.ffn == "moe":  # the router, its choosing bias, the experts, the shared expert
                specs = [
                    TensorSpec(("mlp_norm", "scale"), LAYER + "norm.weight", None),
                    TensorSpec(("mlp", "w_router_de"), MOE + "gate.weight", 1),
                    TensorSpec(("mlp", "b_router_e"), MOE + "gate.e_score_correction_bias", None),
                    TensorSpec(("mlp", "w_up_edf"), MOE + EXPERT + "up_proj.weight", 1, experts=True),
                    TensorSpec(("mlp", "w_down_efd"), MOE + EXPERT + "down_proj.weight", 1, experts=True),
                    TensorSpec(("mlp", "w_shared_up_dg"), MOE + "shared_experts.up_proj.weight", 1),
                    TensorSpec(("mlp", "w_shared_down_gd"), MOE + "shared_experts.down_proj.weight", 1),
                ]
            else:  # an MLP layer
                specs = [
                    TensorSpec(("mlp_norm", "scale"), LAYER + "norm.weight", None),
                    TensorSpec(("mlp", "w_up_df"), LAYER + "mixer.up_proj.weight", 1),
                    TensorSpec(("mlp", "w_down_fd"), LAYER + "mixer.down_proj.weight", 1),
                ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

    def module_name(self, hf_name: str) -> str:
        """transformers saves NemotronHForCausalLM's `model` as `backbone` (as published)."""
        return "model." + hf_name.removeprefix("backbone.") if hf_name.startswith("backbone.") else hf_name

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """Multi-token-prediction layers (`mtp.*`), which transformers does not load either."""
        return name.startswith("mtp.")

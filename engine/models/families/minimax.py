"""MiniMax-M2 (MiniMaxM2ForCausalLM, model_type minimax_m2).

Grouped-query attention whose QK norm is one RMSNorm over all heads' dimensions of the
projected queries (keys), as OLMo 2's (qk_norm_across_heads: HF's (heads * head_dim,)
scales), with RoPE on the first `rotary_dim` dimensions of each head (ModelConfig.rope.rotary_dim;
transformers 5 reads the published `rotary_dim` as partial_rotary_factor). Every layer is a
mixture of experts as wide as intermediate_size, Mixtral's names (`block_sparse_moe.`,
`experts.{j}.w1/w3/w2`), routed as DeepSeek-V3 is without groups or shared experts: sigmoid
scores, a bias that only chooses (e_score_correction_bias), the k weights renormalised.

The published config.json also carries MiniMax's own keys (use_qk_norm, scoring_func,
use_routing_bias, shared_intermediate_size, ...) that transformers' class ignores: the
values it hard-codes are read, anything else is refused.

Its multi-token-prediction modules (`use_mtp`, `num_mtp_modules`: tensors under
model.layers.{num_hidden_layers + i}., as vLLM names them) have no modeling in transformers
5.25, nor in MiniMax's own code, so their math is unknown here: conversion skips them with a
message (as vLLM's loader does), and export writes the model without them.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    EXPERT,
    LAYER,
    Family,
    TensorSpec,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)

# MiniMax's keys transformers' MiniMaxM2ForCausalLM ignores, and the value its math has.
_HARD_CODED = {
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "shared_intermediate_size": 0,
}


@register_family
class MiniMaxM2(Family):
    name = "minimax_m2"
    architecture = "MiniMaxM2ForCausalLM"
    model_type = "minimax_m2"
    moe = True
    fixed = {
        "qk_norm": True,
        "qk_norm_across_heads": True,
        "router_score": "sigmoid",
        "router_bias": True,
        "router_renormalize": True,
    }
    hf_defaults = {
        "max_position_embeddings": 196608,
        "tie_word_embeddings": False,
        "rope_theta": 5_000_000.0,
        "rms_norm_eps": 1e-6,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
    }
    unsupported_flags = ()
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {"router_jitter_noise": 0.0, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported (only 0)")
        for key, value in _HARD_CODED.items():
            if hf.get(key) is not None and hf[key] != value:
                raise ConfigError(
                    f"{where}: {key}={hf[key]!r} is not supported ({self.architecture} runs {key}={value!r})"
                )
        return super().config_from_hf(hf, where)

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """The multi-token-prediction modules: the layers after the decoder's."""
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        return layer.isdigit() and int(layer) >= cfg.num_layers

    def _rotary_dim(self, hf: dict) -> int:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        if factor is None and hf.get("rotary_dim") is not None:
            return int(hf["rotary_dim"])
        return int(head_dim * float(factor or hf.get("partial_rotary_factor") or 1.0))

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta"), **(hf.get("rope_scaling") or {})}
        )
        rope.pop("partial_rotary_factor", None)  # rotary_dim, below
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = self._rotary_dim(hf)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ConfigError(
                f"config.json ({self.architecture}): rotary_dim {rotary} of head_dim {head_dim} "
                "must be even and at most head_dim"
            )
        return {
            "rotary_dim": None if rotary == head_dim else rotary,
            "num_experts": self.hf_value(hf, "num_local_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        rope = rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling)
        keys: dict[str, Any] = {
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "rope_parameters": rope,
            # the published checkpoints' router keys (their config.json, MiniMax's code): vLLM's
            # MiniMax-M2 reads them (without them it cannot build the router, nor load its
            # e_score_correction_bias); transformers ignores them
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
        }
        if cfg.rope.rotary_dim is not None:  # as transformers writes it, and the published key
            rope["partial_rotary_factor"] = cfg.rope.rotary_dim / cfg.attention.head_dim
            keys["rotary_dim"] = cfg.rope.rotary_dim
        return keys

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors(flatten=True)

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        moe, expert = LAYER + "block_sparse_moe.", LAYER + "block_sparse_moe." + EXPERT
        return [
            TensorSpec(("mlp", "w_router_de"), moe + "gate.weight", 1),
            TensorSpec(("mlp", "b_router_e"), moe + "e_score_correction_bias", None),
            TensorSpec(("mlp", "w_gate_edf"), expert + "w1.weight", 1, experts=True),
            TensorSpec(("mlp", "w_up_edf"), expert + "w3.weight", 1, experts=True),
            TensorSpec(("mlp", "w_down_efd"), expert + "w2.weight", 1, experts=True),
        ]

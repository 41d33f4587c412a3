"""Mixtures of experts: Mixtral (MixtralForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM).

Both replace the layers' MLP by a softmax router over E SwiGLU experts, k per token
(engine/models/moe.py). Mixtral is Mistral's attention with experts as wide as
intermediate_size and the k weights renormalised; Qwen3-MoE is Qwen3's attention (QK-norm)
with narrower experts (moe_intermediate_size) and renormalisation as norm_topk_prob says. A
Qwen3-MoE layer may keep a dense MLP instead (mlp_only_layers, decoder_sparse_step): those
form the `dense_blocks` stack (ModelConfig.ffn_pattern).
Checkpoints store one tensor per expert (`experts.{j}.`), as transformers saves them.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.families.base import (
    EXPERT,
    LAYER,
    TensorSpec,
    qk_norm_tensors,
    register_family,
    shortest_period,
)
from engine.models.families.mistral import Mistral
from engine.models.families.qwen import _Qwen


def _experts(prefix: str, gate: str, up: str, down: str) -> list[TensorSpec]:
    """The router (`prefix`gate) and the stacked experts' three projections."""
    expert = LAYER + prefix + EXPERT
    return [
        TensorSpec(("mlp", "w_router_de"), LAYER + prefix + "gate.weight", 1),
        TensorSpec(("mlp", "w_gate_edf"), expert + f"{gate}.weight", 1, experts=True),
        TensorSpec(("mlp", "w_up_edf"), expert + f"{up}.weight", 1, experts=True),
        TensorSpec(("mlp", "w_down_efd"), expert + f"{down}.weight", 1, experts=True),
    ]


@register_family
class Mixtral(Mistral):
    name = "mixtral"
    architecture = "MixtralForCausalLM"
    model_type = "mixtral"
    moe = True
    fixed = {"router_score": "softmax", "router_renormalize": True}
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {"router_jitter_noise": 0.0, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported (only 0)")
        return super().config_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        return {
            "num_experts": self.hf_value(hf, "num_local_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
        }

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        return {
            **super().extra_hf_keys(cfg),
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
        }

    def mlp_tensors(self, cfg) -> list[TensorSpec]:
        return _experts("block_sparse_moe.", "w1", "w3", "w2")


@register_family
class Qwen3Moe(_Qwen):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    model_type = "qwen3_moe"
    moe = True
    fixed = {"qk_norm": True, "router_score": "softmax"}
    hf_defaults = {
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "sliding_window": 4096,
    }
    hf_constants = {"attention_bias": False, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        step = self.hf_value(hf, "decoder_sparse_step")
        if not isinstance(step, int) or step < 1:
            raise ConfigError(f"{where}: decoder_sparse_step must be a whole number >= 1, got {step!r}")
        dense = hf.get("mlp_only_layers") or []
        layers = hf["num_hidden_layers"]
        if any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
            raise ConfigError(f"{where}: mlp_only_layers must list layers in [0, {layers}), got {dense}")
        return super().config_from_hf(hf, where)

    @staticmethod
    def moe_layers(hf: dict, num_layers: int, step: int) -> list[bool]:
        """transformers' rule: layer i has experts unless in mlp_only_layers, and when (i + 1) % step == 0."""
        dense = set(hf.get("mlp_only_layers") or [])
        return [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        # Qwen3MoeConfig has no max_window_layers: a window, when used, is every layer's.
        local = hf.get("use_sliding_window") and self.hf_value(hf, "sliding_window") is not None
        return ["sliding_attention" if local else "full_attention"] * num_layers

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        # transformers 5 writes num_experts as num_local_experts (an attribute_map alias).
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        moe = self.moe_layers(hf, hf["num_hidden_layers"], self.hf_value(hf, "decoder_sparse_step"))
        return {
            "ffn_pattern": None if all(moe) else ["moe" if x else "mlp" for x in shortest_period(moe)],
            "num_experts": hf.get("num_experts") or self.hf_value(hf, "num_local_experts", 128),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
        }

    def extra_hf_keys(self, cfg) -> dict[str, Any]:
        local = all(cfg.layer_is_local())  # only an all-local pattern is expressible
        moe = [layer.ffn == "moe" for layer in cfg.layer_pattern()]
        # the sparse step that gives this pattern, if one does; else every dense layer listed
        step = next((s for s in range(1, cfg.num_layers + 1) if moe == self.moe_layers({}, cfg.num_layers, s)), 1)
        dense = [i for i, x in enumerate(moe) if not x and (i + 1) % step == 0]
        return {
            "decoder_sparse_step": step,
            "mlp_only_layers": dense,
            "use_sliding_window": local,
            "sliding_window": cfg.attention.sliding_window if local else None,
            # published checkpoints (and transformers 4) say num_experts, transformers 5 its alias
            "num_experts": cfg.moe.num_experts,
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "norm_topk_prob": cfg.moe.router_renormalize,
        }

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

    def mlp_tensors(self, cfg) -> list[TensorSpec]:
        return _experts("mlp.", "gate_proj", "up_proj", "down_proj")

"""Hunyuan MoE (HunYuanMoEV1ForCausalLM, model_type hunyuan_v1_moe; Hunyuan-A13B).

Llama's attention with RMSNorm over head_dim on queries and keys after RoPE
(query_layernorm, key_layernorm: ModelConfig.attention.qk_norm_after_rope). Every layer has a softmax
router over `num_experts` experts (mlp.gate.wg), its top-k (moe_topk) renormalised, and a
shared MLP beside them (shared_mlp); transformers builds the experts and the shared MLP as
wide as intermediate_size (the published moe_intermediate_size and num_shared_expert lists
it ignores). num_experts and moe_topk may be per-layer lists in config.json: read when all
their entries are equal.

RoPE: Hunyuan's "dynamic" scaling with a fixed `alpha` (transformers' ntk_alpha) only
stretches the base, to rope_theta * alpha ** (head_dim / (head_dim - 2)): converted as that
rope_theta, exported as a plain RoPE of it (the same frequencies). Checkpoints store one
tensor per expert (`experts.{j}.`), as transformers saves them.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import EXPERT, LAYER, Family, TensorSpec, register_family, rope_from_hf


@register_family
class HunYuanMoeV1(Family):
    name = "hunyuan_v1_moe"
    architecture = "HunYuanMoEV1ForCausalLM"
    model_type = "hunyuan_v1_moe"
    moe = True
    fixed = {
        "qk_norm": True,
        "qk_norm_after_rope": True,
        "router_score": "softmax",
        "router_renormalize": True,
        "num_shared_experts": 1,
    }
    hf_defaults = {
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "num_experts": 1,
        "moe_topk": 1,
    }
    unsupported_flags = ("attention_bias",)  # biases on q, k, v and o: not in Hunyuan-A13B
    # Its tokenizer's document and separator ids are unknown to a checkpoint: null, as export
    # writes the other token ids it does not know.
    hf_constants = {
        "attention_bias": False,
        "pretraining_tp": 1,
        "output_router_logits": False,
        "eod_token_id": None,
        "sep_token_id": None,
    }

    def _per_model(self, hf: dict, key: str, where: str) -> int:
        """A config.json value that may be a per-layer list, as one number."""
        value = self.hf_value(hf, key)
        if isinstance(value, list):
            if len(set(value)) != 1:
                raise ConfigError(f"{where}: {key} must be the same for every layer, got {value}")
            value = value[0]
        return value

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        )
        if rope.get("rope_type", rope.get("type")) == "dynamic" and rope.get("alpha"):
            if rope.get("factor", 1.0) != 1.0:
                raise ConfigError(f"{where}: RoPE type 'dynamic' with alpha needs factor 1, got {rope['factor']}")
            dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
            theta = float(rope.get("rope_theta", 10000.0)) * rope["alpha"] ** (dim / (dim - 2))
            return {"rope_theta": theta, "rope_scaling": None}
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        experts, top = self._per_model(hf, "num_experts", where), self._per_model(hf, "moe_topk", where)
        return {**super().config_from_hf(hf, where), "num_experts": experts, "experts_per_token": top}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        # moe_topk per layer, as Hunyuan-A13B publishes it
        return {"num_experts": cfg.moe.num_experts, "moe_topk": [cfg.moe.experts_per_token] * cfg.num_layers}

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return [
            TensorSpec(("attn", f"{x}_norm", "scale"), LAYER + f"self_attn.{name}_layernorm.weight", None)
            for x, name in (("q", "query"), ("k", "key"))
        ]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        expert, shared = LAYER + "mlp." + EXPERT, LAYER + "mlp.shared_mlp."
        return [
            TensorSpec(("mlp", "w_router_de"), LAYER + "mlp.gate.wg.weight", 1),
            *(
                TensorSpec(("mlp", f"w_{x}_{dims}"), expert + f"{x}_proj.weight", 1, experts=True)
                for x, dims in (("gate", "edf"), ("up", "edf"), ("down", "efd"))
            ),
            *(
                TensorSpec(("mlp", f"w_shared_{x}_{dims}"), shared + f"{x}_proj.weight", 1)
                for x, dims in (("gate", "dg"), ("up", "dg"), ("down", "gd"))
            ),
        ]

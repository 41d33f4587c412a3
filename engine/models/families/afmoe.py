"""AFMoE (AfmoeForCausalLM; Arcee's Trinity models).

Grouped-query attention with RMSNorm over head_dim on queries and keys, RoPE on the
sliding-window layers only (the global ones, every global_attn_every_n_layers-th, are NoPE:
ModelConfig.rope.pattern), and an output gate: the attention's output times
sigmoid(x . gate_proj) per head and dimension before o_proj
(ModelConfig.attention.output_gate, whose engine weight wq_dnh holds each head's query and
gate side by side: HF's q_proj and gate_proj are its two halves, TensorSpec.last_axis_slice).
Each sublayer's input and output are normalised (ModelConfig.block.post_norms: input_layernorm,
post_attention_layernorm, pre_mlp_layernorm, post_mlp_layernorm). The first num_dense_layers
layers are dense; the rest route by sigmoid scores plus a choosing bias (`expert_bias`, a
frozen parameter in transformers: ModelConfig.moe.router_bias), renormalise the chosen weights and
scale them by route_scale, beside shared experts. mup_enabled multiplies the embeddings by
sqrt(hidden_size) (ModelConfig.embedding.scale).

Checkpoints store one tensor per expert (`experts.{j}.`), as transformers saves them.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import (
    EXPERT,
    LAYER,
    Family,
    TensorSpec,
    layer_types_to_hf,
    qk_norm_tensors,
    register_family,
    shortest_period,
)


@register_family
class Afmoe(Family):
    name = "afmoe"
    architecture = "AfmoeForCausalLM"
    model_type = "afmoe"
    moe = True
    fixed = {
        "qk_norm": True,
        "post_norms": True,
        "attention_output_gate": True,
        "router_score": "sigmoid",
        "router_bias": True,
        "router_renormalize": True,
    }
    hf_defaults = {
        "max_position_embeddings": 16384,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "head_dim": 128,
        "moe_intermediate_size": 1408,
        "num_experts": 64,
        "num_experts_per_tok": 6,
        "num_shared_experts": 2,
        "route_scale": 1.0,
        "num_dense_layers": 1,
        "global_attn_every_n_layers": 4,
        "sliding_window": 1024,
    }
    unsupported_flags = ("attention_bias",)  # biases on q, k, v and o: not in the Trinity models
    hf_constants = {"attention_bias": False, "output_router_logits": False}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        every = self.hf_value(hf, "global_attn_every_n_layers")
        return ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        rope = [t == "sliding_attention" for t in self.layer_types(hf, layers)]  # the global layers are NoPE
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        return {
            "head_dim": self.hf_value(hf, "head_dim"),
            "rope_pattern": None if all(rope) else shortest_period(rope),
            "num_experts": self.hf_value(hf, "num_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "num_shared_experts": self.hf_value(hf, "num_shared_experts"),
            "router_scale": float(self.hf_value(hf, "route_scale")),
            "first_dense_layers": min(self.hf_value(hf, "num_dense_layers"), layers),
            "scale_embeddings": bool(hf.get("mup_enabled")),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = cfg.layer_is_local()
        every = next(
            (n for n in range(1, cfg.num_layers + 2) if local == [(i + 1) % n != 0 for i in range(len(local))]), None
        )
        return {
            **layer_types_to_hf(cfg),
            "global_attn_every_n_layers": every or self.hf_defaults["global_attn_every_n_layers"],
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "num_shared_experts": cfg.moe.num_shared_experts,
            "route_scale": cfg.moe.router_scale,
            "num_dense_layers": cfg.moe.first_dense_layers,
            "mup_enabled": cfg.embedding.scale,
            # the published configs' keys, which vLLM's AFMoE reads and transformers 5 drops
            "score_func": cfg.moe.router_score,
            "route_norm": cfg.moe.router_renormalize,
            "n_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_group_top,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        h, attn = cfg.attention.head_dim, LAYER + "self_attn."
        query, key, value, out = super().attention_tensors(cfg)[1:]
        return [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            TensorSpec(query.path, query.hf_name, 1, last_axis_slice=(0, h)),
            key,
            value,
            out,
            TensorSpec(query.path, attn + "gate_proj.weight", 1, last_axis_slice=(h, 2 * h)),
            *qk_norm_tensors(),
        ]

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        # post_attention_layernorm is the attention output's norm; pre_mlp_layernorm the MLP's input's
        return [
            TensorSpec(("post_attn_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("mlp_norm", "scale"), LAYER + "pre_mlp_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_mlp_layernorm.weight", None),
        ]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        expert, shared = LAYER + "mlp." + EXPERT, LAYER + "mlp.shared_experts."
        return [
            TensorSpec(("mlp", "w_router_de"), LAYER + "mlp.router.gate.weight", 1),
            TensorSpec(("mlp", "b_router_e"), LAYER + "mlp.expert_bias", None),
            *(
                TensorSpec(("mlp", f"w_{x}_{dims}"), expert + f"{x}_proj.weight", 1, experts=True)
                for x, dims in (("gate", "edf"), ("up", "edf"), ("down", "efd"))
            ),
            *(
                TensorSpec(("mlp", f"w_shared_{x}_{dims}"), shared + f"{x}_proj.weight", 1)
                for x, dims in (("gate", "dg"), ("up", "dg"), ("down", "gd"))
                if cfg.moe.num_shared_experts
            ),
        ]

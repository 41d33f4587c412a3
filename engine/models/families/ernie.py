"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM, model_type ernie4_5_moe).

Llama's attention with RoPE on adjacent pairs (ModelConfig.rope.interleave) and tied
embeddings by default. A layer has experts when (i + 1) % moe_layer_interval == 0 and
moe_layer_start_index <= i <= moe_layer_end_index, else a dense MLP: the first layers as
first_dense_layers, any other mix as ffn_pattern. The router takes a softmax over the experts
and chooses its top-k by those probabilities plus a per-expert bias (`moe_statics`, a frozen
parameter of shape (1, E) in transformers: ModelConfig.moe.router_bias, which only chooses),
renormalises the k chosen probabilities, and the shared experts (moe_num_shared_experts of
moe_intermediate_size, one gated MLP) add their output.

Checkpoints store one tensor per expert (`experts.{j}.`), as transformers saves them. The
multi-token-prediction weights published checkpoints carry (`mtp_*`, which transformers'
model skips) are skipped by conversion.
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, register_family
from engine.models.families.deepseek import routed_and_shared_experts
from engine.models.families.routed_gqa import ffn_fields


@register_family
class Ernie45Moe(Family):
    name = "ernie4_5_moe"
    architecture = "Ernie4_5_MoeForCausalLM"
    model_type = "ernie4_5_moe"
    moe = True
    fixed = {"router_score": "softmax", "router_bias": True, "router_renormalize": True, "rope_interleave": True}
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "moe_intermediate_size": 1536,
        "moe_k": 6,
        "moe_num_experts": 64,
        "moe_num_shared_experts": 2,
        "moe_layer_start_index": 1,
        "moe_layer_end_index": -1,
        "moe_layer_interval": 1,
    }
    unsupported_flags = ("use_bias",)  # biases on every projection and the LM head: not in ERNIE 4.5
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {
        "use_bias": False,
        "moe_norm_min": 1e-12,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "num_nextn_predict_layers": None,  # no multi-token-prediction weights written
    }

    @staticmethod
    def moe_layers(num_layers: int, start: int, end: int, interval: int) -> list[bool]:
        """transformers' rule: experts in layer i when (i + 1) % interval == 0 and start <= i <= end."""
        end = num_layers - 1 if end == -1 else end
        return [(i + 1) % interval == 0 and start <= i <= end for i in range(num_layers)]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        moe = self.moe_layers(
            hf["num_hidden_layers"],
            self.hf_value(hf, "moe_layer_start_index"),
            self.hf_value(hf, "moe_layer_end_index"),
            self.hf_value(hf, "moe_layer_interval"),
        )
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        return {
            # transformers 5 writes num_experts and num_experts_per_tok as their aliases moe_*
            "num_experts": hf.get("num_experts") or self.hf_value(hf, "moe_num_experts"),
            "experts_per_token": hf.get("num_experts_per_tok") or self.hf_value(hf, "moe_k"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "num_shared_experts": self.hf_value(hf, "moe_num_shared_experts"),
            **ffn_fields(moe),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["attention_dropout"]  # Ernie4_5_MoeConfig has none
        return hf

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = [layer.ffn == "moe" for layer in cfg.layer_pattern()]
        start = moe.index(True) if any(moe) else cfg.num_layers
        end = max((i for i, x in enumerate(moe) if x), default=cfg.num_layers - 1)
        # the interval that gives this pattern, if one does (else the round trip names the field)
        interval = next(
            (s for s in range(1, cfg.num_layers + 1) if moe == self.moe_layers(cfg.num_layers, start, end, s)), 1
        )
        return {
            "moe_num_experts": cfg.moe.num_experts,
            "moe_k": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "moe_num_shared_experts": cfg.moe.num_shared_experts,
            "moe_layer_start_index": start,
            "moe_layer_end_index": end,
            "moe_layer_interval": interval,
        }

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        # transformers' (1, E) statics: in_dims 1 writes the engine's (E,) bias as one row of E
        bias = TensorSpec(("mlp", "b_router_e"), LAYER + "mlp.moe_statics.e_score_correction_bias", 1)
        specs = [bias if spec.path == ("mlp", "b_router_e") else spec for spec in routed_and_shared_experts()]
        if not cfg.moe.num_shared_experts:
            specs = [spec for spec in specs if not spec.path[-1].startswith("w_shared_")]
        return specs

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        # The multi-token-prediction module of published checkpoints (model.mtp_block.0..., mtp_emb_norm...).
        return name.startswith(("model.mtp", "mtp"))

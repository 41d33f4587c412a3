"""JetMoE (JetMoeForCausalLM): Llama's pre-norm layer whose attention is a mixture of
attention heads and whose MLP a mixture of experts, both routed top-k of num_local_experts
(softmax over the k best logits) and both with a bias on their output.

The attention (engine/models/moa.py, ModelConfig.attention.experts): keys and values from one
kv_proj of num_key_value_heads heads of kv_channels, each token's queries and output from k
expert projection pairs, num_key_value_heads heads each (num_attention_heads = kv heads * k).
The experts are stored stacked: the attention's input_linear (E, kv h, d) and output_linear
(E, d, kv h), the MLP's input_linear (E, 2f, d), gate then up, and output_linear (E, d, f).
The layers' RMSNorms have transformers' default epsilon 1e-6 whatever rms_norm_eps says; only
the final norm reads it (ModelConfig.head.norm_eps).
"""

from __future__ import annotations

from typing import Any

from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)

LAYER_EPS = 1e-6
"""JetMoeRMSNorm's default, which the decoder layers' norms keep."""


@register_family
class JetMoe(Family):
    name = "jetmoe"
    architecture = "JetMoeForCausalLM"
    model_type = "jetmoe"
    moe = True

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("kv_channels") is None and hf.get("head_dim") is not None:  # JetMoeConfig's alias of it
            hf = {**hf, "kv_channels": hf["head_dim"]}
        classic.require(hf, ("hidden_size", "num_hidden_layers", "num_key_value_heads", "kv_channels"), where)
        classic.require(hf, ("vocab_size", "intermediate_size"), where)
        eps = hf.get("rms_norm_eps") or LAYER_EPS
        experts, k = hf.get("num_local_experts") or 8, hf.get("num_experts_per_tok") or 2
        kv = hf["num_key_value_heads"]
        theta, scaling = rope_from_hf(
            hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta") or 10000.0}, where
        )
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"],
            "num_heads": kv * k,
            "num_kv_heads": kv,
            "head_dim": hf["kv_channels"],
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": hf.get("max_position_embeddings") or 4096,
            "norm_eps": LAYER_EPS,
            "final_norm_eps": None if eps == LAYER_EPS else eps,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "activation": classic.activation(hf, "activation_function", "silu", where),
            "init_std": hf.get("initializer_range") or 0.01,
            "num_experts": experts,
            "experts_per_token": k,
            "router_score": "softmax",
            "router_renormalize": True,
            "attention_experts": experts,
            "moe_output_bias": True,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_layers,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "num_attention_heads": cfg.attention.num_heads,
            "kv_channels": cfg.attention.head_dim,
            "intermediate_size": cfg.mlp.dim,
            "max_position_embeddings": cfg.max_seq_len,
            "activation_function": cfg.mlp.activation,
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "output_router_logits": False,
            "aux_loss_coef": 0.01,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "rms_norm_eps": cfg.head.norm_eps or cfg.norm.eps,
            "initializer_range": cfg.init_std,
            "attention_dropout": 0.0,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        moa, mlp = LAYER + "self_attention.experts.", LAYER + "mlp."
        per_layer = [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            TensorSpec(("attn", "w_router_de"), moa + "router.layer.weight", 1),
            TensorSpec(("attn", "wq_edq"), moa + "input_linear.weight", None, swap_last=True),
            TensorSpec(("attn", "wo_eqd"), moa + "output_linear.weight", None, swap_last=True),
            TensorSpec(("attn", "bo_d"), moa + "bias", None),
            TensorSpec(
                ("attn", "wk_dkh"), LAYER + "self_attention.kv_proj.weight", 1, fused_with=(("attn", "wv_dkh"),)
            ),
            TensorSpec(("mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("mlp", "w_router_de"), mlp + "router.layer.weight", 1),
            TensorSpec(
                ("mlp", "w_gate_edf"),
                mlp + "input_linear.weight",
                None,
                concatenated_with=(("mlp", "w_up_edf"),),
                swap_last=True,
            ),
            TensorSpec(("mlp", "w_down_efd"), mlp + "output_linear.weight", None, swap_last=True),
            TensorSpec(("mlp", "b_out_d"), mlp + "bias", None),
        ]
        return top, per_layer

"""DBRX (DbrxForCausalLM; databricks/dbrx-base, dbrx-instruct): a mixture of experts with
LayerNorms without bias (norm_1, norm_2, norm_f), one fused Wqkv (rows q, k, v) whose output
is clamped to [-clip_qkv, clip_qkv] (qkv_clip), RoPE, and SwiGLU experts routed by a softmax
over all experts, its top k renormalised (`moe_normalize_expert_weights` 1: their sum).

config.json nests the attention's and the experts' settings (`attn_config`, `ffn_config`,
each a whole transformers config, written here as transformers writes them). The experts are
three stacked tensors (E * f, d) (TensorSpec.merged_rows): w1 (gate) and v1 (up) as
Linear weights, w2 (down) as (f, d) per expert. `moe_jitter_eps` is training-only noise
the engine does not add. LoRA adapts Wqkv and out_proj, not the experts.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family, rope_from_hf, rope_parameters_to_hf

LAYER = "transformer.blocks.{i}."
NESTED = {
    "architectures": None,
    "output_hidden_states": False,
    "return_dict": True,
    "dtype": None,
    "chunk_size_feed_forward": 0,
    "is_encoder_decoder": False,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "problem_type": None,
    "_name_or_path": "",
    "model_type": "",
    "output_attentions": False,
}
"""The keys transformers writes into each nested config (DbrxAttentionConfig, DbrxFFNConfig)."""
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


@register_family
class Dbrx(Family):
    name = "dbrx"
    architecture = "DbrxForCausalLM"
    model_type = "dbrx"
    moe = True

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("d_model", "n_heads", "n_layers", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        attn, ffn = hf.get("attn_config") or {}, hf.get("ffn_config") or {}
        d, n = hf["d_model"], hf["n_heads"]
        if d % n:
            raise ConfigError(f"{where}: d_model {d} is not a multiple of n_heads {n}")
        act = (ffn.get("ffn_act_fn") or {"name": "silu"}).get("name", "silu")
        if act not in ACTIVATIONS:
            raise ConfigError(f"{where}: ffn_config.ffn_act_fn '{act}' is not supported ({', '.join(ACTIVATIONS)})")
        normalize = ffn.get("moe_normalize_expert_weights", 1.0)
        if normalize not in (None, 1, 1.0):
            raise ConfigError(
                f"{where}: ffn_config.moe_normalize_expert_weights={normalize} is not supported (1: renormalised, "
                "or null)"
            )
        # transformers 5's rope_parameters where written; else the published attn_config.rope_theta
        # (transformers 5.25 itself reads such a file with its default 10000, not the model's base)
        rope = hf.get("rope_parameters") or {"rope_theta": attn.get("rope_theta", 10000.0)}
        theta, scaling = rope_from_hf(rope, where)
        f = ffn.get("ffn_hidden_size", 3584)
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["n_layers"],
            "num_heads": n,
            "num_kv_heads": attn.get("kv_n_heads", 1),
            "head_dim": d // n,
            "mlp_dim": f,
            "max_seq_len": hf.get("max_seq_len") or 2048,
            "norm_eps": 1e-5,  # torch's LayerNorm default, which DBRX keeps
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),  # transformers' class refuses true
            "activation": ACTIVATIONS[act],
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "qkv_clip": attn.get("clip_qkv"),
            "num_experts": ffn.get("moe_num_experts", 4),
            "experts_per_token": ffn.get("moe_top_k", 1),
            "router_renormalize": normalize is not None,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        act = {"gelu_tanh": "gelu_pytorch_tanh"}.get(cfg.mlp.activation, cfg.mlp.activation)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "d_model": cfg.d_model,
            "n_heads": cfg.attention.num_heads,
            "n_layers": cfg.num_layers,
            "max_seq_len": cfg.max_seq_len,
            "vocab_size": cfg.vocab_size,
            "resid_pdrop": 0.0,
            "emb_pdrop": 0.0,
            # rope_theta: transformers' DbrxAttention reads it there (and published configs have it)
            "attn_config": {
                **NESTED,
                "attn_pdrop": 0.0,
                "clip_qkv": cfg.attention.qkv_clip,
                "kv_n_heads": cfg.attention.num_kv_heads,
                "rope_theta": cfg.rope.theta,
            },
            "ffn_config": {
                **NESTED,
                "hidden_size": cfg.d_model,
                "ffn_act_fn": {"name": act},
                "ffn_hidden_size": cfg.moe_mlp_dim,
                "moe_num_experts": cfg.moe.num_experts,
                "moe_top_k": cfg.moe.experts_per_token,
                "moe_jitter_eps": None,
                "moe_loss_weight": 0.01,
                "moe_normalize_expert_weights": 1.0 if cfg.moe.router_renormalize else None,
            },
            "use_cache": True,
            "initializer_range": cfg.init_std,
            "output_router_logits": False,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "rope_theta": cfg.rope.theta,
            "tie_word_embeddings": cfg.tie_embeddings,
            "num_key_value_heads": cfg.attention.num_kv_heads,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "transformer.wte.weight", None),
            TensorSpec(("final_norm", "scale"), "transformer.norm_f.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        block, experts = LAYER + "norm_attn_norm.", LAYER + "ffn.experts.mlp."
        kv = (("attn", "wk_dkh"), ("attn", "wv_dkh"))
        per_layer = [
            TensorSpec(("attn_norm", "scale"), block + "norm_1.weight", None),
            TensorSpec(("attn", "wq_dnh"), block + "attn.Wqkv.weight", 1, fused_with=kv),
            TensorSpec(("attn", "wo_nhd"), block + "attn.out_proj.weight", 2),
            TensorSpec(("mlp_norm", "scale"), block + "norm_2.weight", None),
            TensorSpec(("mlp", "w_router_de"), LAYER + "ffn.router.layer.weight", 1),
            TensorSpec(("mlp", "w_gate_edf"), experts + "w1", None, swap_last=True, merged_rows=True),
            TensorSpec(("mlp", "w_up_edf"), experts + "v1", None, swap_last=True, merged_rows=True),
            TensorSpec(("mlp", "w_down_efd"), experts + "w2", None, merged_rows=True),
        ]
        return top, per_layer

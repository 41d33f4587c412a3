"""Falcon (FalconForCausalLM): Falcon 7B, 40B and 180B, Falcon 2 11B.

LayerNorms with biases; RoPE on every dim of each head; a non-gated MLP (dense_h_to_4h,
dense_4h_to_h; exact GELU); biases on every projection where `bias` is set. q, k and v are
one projection, `query_key_value`, whose rows come in one group per KV head: the group's
queries, then its key and value (TensorSpec.fused_groups). That one layout covers all three
of Falcon's: the new decoder architecture's (num_kv_heads groups), multi-query's (one group)
and the older per-head (heads, 3, head_dim) one (a group per head).

The residual: the new decoder architecture adds attention and MLP side by side, each on its
own LayerNorm (ln_attn, ln_mlp; residual parallel), or on one (`num_ln_in_parallel_attn` 1,
Falcon 2: parallel_shared_norm); the older one on one input_layernorm (`parallel_attn`), or
in sequence (post_attention_layernorm). ALiBi models (`alibi`: Falcon-RW) are refused.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import Family, TensorSpec, register_family, rope_from_hf, rope_parameters_to_hf

LAYER = "transformer.h.{i}."


@register_family
class Falcon(Family):
    name = "falcon"
    architecture = "FalconForCausalLM"
    model_type = "falcon"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("hidden_size") is None and hf.get("n_embed") is not None:  # the older name transformers takes
            hf = {**hf, "hidden_size": hf["n_embed"]}
        classic.require(hf, ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"), where)
        if hf.get("alibi"):
            raise ConfigError(f"{where}: alibi=true (Falcon-RW's ALiBi positions) is not supported yet (RoPE is)")
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        new = bool(hf.get("new_decoder_architecture", False))
        if new:
            kv = hf.get("num_kv_heads") or n
            lns = hf.get("num_ln_in_parallel_attn") or 2
            if lns == 1 and not hf.get("parallel_attn", True):
                raise ConfigError(f"{where}: num_ln_in_parallel_attn=1 needs parallel_attn=true")
            residual = "parallel" if lns == 2 else "parallel_shared_norm"
        else:
            kv = 1 if hf.get("multi_query", True) else n
            residual = "parallel_shared_norm" if hf.get("parallel_attn", True) else "sequential"
        older = {"rope_theta": hf.get("rope_theta") or 10000.0, **(hf.get("rope_scaling") or {})}
        theta, scaling = rope_from_hf(hf.get("rope_parameters") or older, where)
        bias = bool(hf.get("bias", False))
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": kv,
            "head_dim": d // n,
            "mlp_dim": hf.get("ffn_hidden_size") or 4 * d,
            "max_seq_len": hf.get("max_position_embeddings") or 2048,
            "norm_eps": hf.get("layer_norm_epsilon") or 1e-5,
            "rope_theta": theta,
            "rope_scaling": scaling,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "activation": classic.activation(hf, "activation", "gelu", where),
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "norm_bias": True,
            "residual": residual,
            "mlp_gated": False,
            "mlp_bias": bias,
            "qkv_bias": bias,
            "attention_out_bias": bias,
        }

    @staticmethod
    def _new_architecture(cfg: ModelConfig) -> bool:
        """Written as the new decoder architecture: two LayerNorms, or KV heads that are
        neither one (multi-query) nor every head (the older per-head layout)."""
        return cfg.block.residual == "parallel" or cfg.attention.num_kv_heads not in (1, cfg.attention.num_heads)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        new = self._new_architecture(cfg)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_ln_in_parallel_attn": (2 if cfg.block.residual == "parallel" else 1) if new else None,
            "layer_norm_epsilon": cfg.norm.eps,
            "initializer_range": cfg.init_std,
            "use_cache": True,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "num_kv_heads": cfg.attention.num_kv_heads if new else cfg.attention.num_heads,
            "alibi": False,
            "new_decoder_architecture": new,
            "multi_query": new or cfg.attention.num_kv_heads == 1,
            "parallel_attn": cfg.block.residual != "sequential",
            "bias": cfg.mlp.bias,
            "max_position_embeddings": cfg.max_seq_len,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "rope_theta": cfg.rope.theta,
            "ffn_hidden_size": cfg.mlp.dim,
            "activation": {"gelu_tanh": "gelu_new"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "tie_word_embeddings": cfg.tie_embeddings,
            "num_key_value_heads": cfg.attention.num_kv_heads,  # FalconConfig's property, which it writes too
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "transformer.word_embeddings.weight", None),
            *classic.norm("final_norm", "transformer.ln_f", bias=True),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        bias, attention = cfg.mlp.bias, LAYER + "self_attention."
        if cfg.block.residual == "parallel":
            norms = classic.norm("attn_norm", LAYER + "ln_attn", True)
            norms += classic.norm("mlp_norm", LAYER + "ln_mlp", True)
        else:
            norms = classic.norm("attn_norm", LAYER + "input_layernorm", True)
            if cfg.block.residual == "sequential":
                norms += classic.norm("mlp_norm", LAYER + "post_attention_layernorm", True)
        per_layer = [
            *norms,
            *classic.fused_qkv(attention + "query_key_value", bias, groups=cfg.attention.num_kv_heads),
            TensorSpec(("attn", "wo_nhd"), attention + "dense.weight", 2),
            *([TensorSpec(("attn", "bo_d"), attention + "dense.bias", None)] if bias else []),
            *classic.plain_mlp(LAYER + "mlp.", "dense_h_to_4h", "dense_4h_to_h", bias=bias),
        ]
        return top, per_layer

"""BLOOM (BloomForCausalLM; bigscience/bloom-560m ... bloom): ALiBi in place of positions
(ModelConfig.positions alibi), a LayerNorm on the token embeddings (embedding_norm), pre-norm
layers with LayerNorms (weight and bias), biases on every projection, an ungated MLP of
4 x hidden_size with BLOOM's tanh GELU, tied embeddings. `self_attention.query_key_value`
holds each head's query, key and value rows together, (heads, 3, head_dim)
(TensorSpec.fused_groups = heads).

The published checkpoints were saved from BloomModel, without `transformer.`
(Family.checkpoint_name). `apply_residual_connection_post_layernorm` (the residual taken
after the norm) is refused; `pretraining_tp` only orders the sums (export writes 1).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family
from engine.models.families.gpt2 import layer_norm

ROOT = "transformer."
LAYER = ROOT + "h.{i}."


@register_family
class Bloom(Family):
    name = "bloom"
    architecture = "BloomForCausalLM"
    model_type = "bloom"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        d = hf.get("hidden_size") or hf.get("n_embed")
        n, layers = hf.get("n_head") or hf.get("num_attention_heads"), hf.get("n_layer") or hf.get("num_hidden_layers")
        for key, value in (
            ("hidden_size", d),
            ("n_head", n),
            ("n_layer", layers),
            ("vocab_size", hf.get("vocab_size")),
        ):
            if value is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        if hf.get("apply_residual_connection_post_layernorm"):
            raise ConfigError(f"{where}: apply_residual_connection_post_layernorm=true is not supported")
        assert d is not None and n is not None  # checked above
        if d % n:
            raise ConfigError(f"{where}: hidden_size {d} is not a multiple of n_head {n}")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": layers,
            "num_heads": n,
            "num_kv_heads": n,
            "head_dim": d // n,
            "mlp_dim": 4 * d,
            "max_seq_len": 2048,  # ALiBi: no position table; the length BLOOM was trained at
            "norm_eps": hf.get("layer_norm_epsilon") or 1e-5,
            "tie_embeddings": hf.get("tie_word_embeddings", True) is not False,
            "activation": "gelu_tanh",
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "norm_bias": True,
            "mlp_gated": False,
            "mlp_bias": True,
            "qkv_bias": True,
            "attention_out_bias": True,
            "positions": "alibi",
            "embedding_norm": True,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "n_layer": cfg.num_layers,
            "n_head": cfg.attention.num_heads,
            "layer_norm_epsilon": cfg.norm.eps,
            "initializer_range": cfg.init_std,
            "use_cache": True,
            "apply_residual_connection_post_layernorm": False,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "pretraining_tp": 1,
            "slow_but_exact": False,
            "tie_word_embeddings": cfg.tie_embeddings,
        }

    def checkpoint_name(self, stored: str) -> str:
        # bigscience's checkpoints were saved from BloomModel: `h.0.`, `word_embeddings.`, no LM head
        return stored if stored.startswith((ROOT, "lm_head.")) else ROOT + stored

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), ROOT + "word_embeddings.weight", None),
            *layer_norm("embed_norm", ROOT + "word_embeddings_layernorm"),
            *layer_norm("final_norm", ROOT + "ln_f"),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        n = cfg.attention.num_heads
        attention = LAYER + "self_attention."
        per_layer = [
            *layer_norm("attn_norm", LAYER + "input_layernorm"),
            TensorSpec(
                ("attn", "wq_dnh"),
                attention + "query_key_value.weight",
                1,
                fused_with=(("attn", "wk_dkh"), ("attn", "wv_dkh")),
                fused_groups=n,
            ),
            TensorSpec(
                ("attn", "bq_nh"),
                attention + "query_key_value.bias",
                None,
                flatten=True,
                fused_with=(("attn", "bk_kh"), ("attn", "bv_kh")),
                fused_groups=n,
            ),
            TensorSpec(("attn", "wo_nhd"), attention + "dense.weight", 2),
            TensorSpec(("attn", "bo_d"), attention + "dense.bias", None),
            *layer_norm("mlp_norm", LAYER + "post_attention_layernorm"),
            TensorSpec(("mlp", "w_up_df"), LAYER + "mlp.dense_h_to_4h.weight", 1),
            TensorSpec(("mlp", "b_up_f"), LAYER + "mlp.dense_h_to_4h.bias", None),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.dense_4h_to_h.weight", 1),
            TensorSpec(("mlp", "b_down_d"), LAYER + "mlp.dense_4h_to_h.bias", None),
        ]
        return top, per_layer

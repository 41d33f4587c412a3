"""OPT (OPTForCausalLM; Meta's OPT-125M ... OPT-66B).

Pre-norm layers with LayerNorms (weight and bias, or neither: `layer_norm_elementwise_affine`),
learned positions whose row for position p is p + 2 (ModelConfig.embedding.position_offset; transformers
counts a row's positions over its attention mask, from its first real token), biases on every
projection (`enable_bias`), an ungated ReLU MLP (fc1, fc2), tensors under `model.decoder.`.

Refused, in one sentence each: OPT-350M's shape, post-norm layers (`do_layer_norm_before`
false) with embeddings narrower than the model (`word_embed_proj_dim`, its project_in and
project_out), and `_remove_final_layer_norm`.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family
from engine.models.families.gpt2 import activation_of, layer_norm

DECODER = "model.decoder."
LAYER = DECODER + "layers.{i}."
OFFSET = 2
"""OPTLearnedPositionalEmbedding's row offset (fairseq's padding rows)."""


@register_family
class OPT(Family):
    name = "opt"
    architecture = "OPTForCausalLM"
    model_type = "opt"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        d, n = hf["hidden_size"], hf["num_attention_heads"]
        if hf.get("do_layer_norm_before") is False:
            raise ConfigError(f"{where}: do_layer_norm_before=false (post-norm layers, OPT-350M) is not supported")
        if hf.get("word_embed_proj_dim", d) != d:
            raise ConfigError(
                f"{where}: word_embed_proj_dim {hf['word_embed_proj_dim']} is not supported (only hidden_size {d}: "
                "no project_in / project_out)"
            )
        if hf.get("_remove_final_layer_norm"):
            raise ConfigError(f"{where}: _remove_final_layer_norm=true is not supported")
        if d % n:
            raise ConfigError(f"{where}: hidden_size {d} is not a multiple of num_attention_heads {n}")
        affine, bias = hf.get("layer_norm_elementwise_affine", True), hf.get("enable_bias", True)
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": n,
            "num_kv_heads": n,
            "head_dim": d // n,
            "mlp_dim": hf["ffn_dim"],
            "max_seq_len": hf.get("max_position_embeddings") or 2048,
            "norm_eps": 1e-5,  # torch's LayerNorm default, which OPT's layers keep
            "tie_embeddings": hf.get("tie_word_embeddings", True) is not False,
            "activation": activation_of(hf, "activation_function", "relu", where),
            "init_std": hf.get("init_std") or 0.02,
            "norm_kind": "layer",
            "norm_scale": affine,
            "norm_bias": affine,
            "mlp_gated": False,
            "mlp_bias": bias,
            "qkv_bias": bias,
            "attention_out_bias": bias,
            "positions": "learned",
            "position_offset": OFFSET,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_layers,
            "ffn_dim": cfg.mlp.dim,
            "max_position_embeddings": cfg.max_seq_len,
            "do_layer_norm_before": True,
            "_remove_final_layer_norm": False,
            "word_embed_proj_dim": cfg.d_model,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "num_attention_heads": cfg.attention.num_heads,
            "activation_function": {"gelu_tanh": "gelu_new"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "layerdrop": 0.0,
            "init_std": cfg.init_std,
            "use_cache": True,
            "enable_bias": cfg.attention.qkv_bias,
            "layer_norm_elementwise_affine": cfg.norm.scale,
            "tie_word_embeddings": cfg.tie_embeddings,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        affine, bias = cfg.norm.scale, cfg.attention.qkv_bias
        top = [
            TensorSpec(("embed_vd",), DECODER + "embed_tokens.weight", None),
            TensorSpec(("pos_embed_pd",), DECODER + "embed_positions.weight", None),
            *(layer_norm("final_norm", DECODER + "final_layer_norm") if affine else []),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        projections = [
            TensorSpec(("attn", "wq_dnh"), LAYER + "self_attn.q_proj.weight", 1),
            TensorSpec(("attn", "wk_dkh"), LAYER + "self_attn.k_proj.weight", 1),
            TensorSpec(("attn", "wv_dkh"), LAYER + "self_attn.v_proj.weight", 1),
            TensorSpec(("attn", "wo_nhd"), LAYER + "self_attn.out_proj.weight", 2),
            TensorSpec(("mlp", "w_up_df"), LAYER + "fc1.weight", 1),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "fc2.weight", 1),
        ]
        biases = [
            TensorSpec(("attn", "bq_nh"), LAYER + "self_attn.q_proj.bias", None, flatten=True),
            TensorSpec(("attn", "bk_kh"), LAYER + "self_attn.k_proj.bias", None, flatten=True),
            TensorSpec(("attn", "bv_kh"), LAYER + "self_attn.v_proj.bias", None, flatten=True),
            TensorSpec(("attn", "bo_d"), LAYER + "self_attn.out_proj.bias", None),
            TensorSpec(("mlp", "b_up_f"), LAYER + "fc1.bias", None),
            TensorSpec(("mlp", "b_down_d"), LAYER + "fc2.bias", None),
        ]
        norms = [
            *layer_norm("attn_norm", LAYER + "self_attn_layer_norm"),
            *layer_norm("mlp_norm", LAYER + "final_layer_norm"),
        ]
        return top, projections + (biases if bias else []) + (norms if affine else [])

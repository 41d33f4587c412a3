"""MPT (MptForCausalLM; mosaicml/mpt-7b, mpt-30b): ALiBi in place of positions
(ModelConfig.positions alibi; slopes as MPT's build_mpt_alibi_tensor, alibi_bias_max 8),
LayerNorms without bias, no biases anywhere (`no_bias`), one fused Wqkv (rows q, k, v)
optionally clamped (`clip_qkv`), an ungated exact-GELU MLP of 4 x d_model (up_proj,
down_proj), tied embeddings.

transformers' class always uses ALiBi with alibi_bias_max 8 and an MLP of 4 x d_model, and
has no QK LayerNorm, prefix LM, biases or logit scale: config.json values saying otherwise are
refused in one sentence. config.json nests the attention's settings (`attn_config`, a whole
transformers config, written as transformers writes it). LoRA: q/k/v are fused (Wqkv), o is
out_proj; up_proj and down_proj are PEFT's names.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family
from engine.models.families.dbrx import NESTED

LAYER = "transformer.blocks.{i}."
REQUIRED = {  # config.json keys -> the only value transformers' class runs (or, absent, means)
    "no_bias": True,
    "logit_scale": None,
    "expansion_ratio": 4,
}
REQUIRED_ATTENTION = {
    "alibi": True,
    "alibi_bias_max": 8,
    "qk_ln": False,
    "prefix_lm": False,
    "attn_type": "multihead_attention",
}


@register_family
class Mpt(Family):
    name = "mpt"
    architecture = "MptForCausalLM"
    model_type = "mpt"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("d_model", "n_heads", "n_layers", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        attn = hf.get("attn_config") or {}
        for scope, table, required in (("", hf, REQUIRED), ("attn_config.", attn, REQUIRED_ATTENTION)):
            for key, value in required.items():
                if key in table and table[key] != value:
                    raise ConfigError(f"{where}: {scope}{key}={table[key]!r} is not supported (only {value!r})")
        d, n = hf["d_model"], hf["n_heads"]
        if d % n:
            raise ConfigError(f"{where}: d_model {d} is not a multiple of n_heads {n}")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["n_layers"],
            "num_heads": n,
            "num_kv_heads": n,
            "head_dim": d // n,
            "mlp_dim": 4 * d,
            "max_seq_len": hf.get("max_seq_len") or 2048,
            "norm_eps": hf.get("layer_norm_epsilon") or 1e-5,
            "tie_embeddings": hf.get("tie_word_embeddings", True) is not False,
            "activation": "gelu",
            "init_std": hf.get("initializer_range") or 0.02,
            "attention_scale": attn.get("softmax_scale"),
            "norm_kind": "layer",
            "mlp_gated": False,
            "qkv_clip": attn.get("clip_qkv"),
            "positions": "alibi",
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "d_model": cfg.d_model,
            "n_heads": cfg.attention.num_heads,
            "n_layers": cfg.num_layers,
            "expansion_ratio": 4,
            "max_seq_len": cfg.max_seq_len,
            "vocab_size": cfg.vocab_size,
            "resid_pdrop": 0.0,
            "layer_norm_epsilon": cfg.norm.eps,
            "emb_pdrop": 0.0,
            "learned_pos_emb": True,  # transformers' default, which its class ignores (ALiBi)
            "attn_config": {
                **NESTED,
                "attn_type": "multihead_attention",
                "attn_pdrop": 0,
                "attn_impl": "torch",
                "clip_qkv": cfg.attention.qkv_clip,
                "softmax_scale": cfg.attention.scale,
                "prefix_lm": False,
                "qk_ln": False,
                "attn_uses_sequence_id": False,
                "alibi": True,
                "alibi_bias_max": 8,
            },
            "init_device": "cpu",
            "logit_scale": None,
            "no_bias": True,
            "embedding_fraction": 1.0,
            "norm_type": "low_precision_layernorm",
            "use_cache": False,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "transformer.wte.weight", None),
            TensorSpec(("final_norm", "scale"), "transformer.norm_f.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        kv = (("attn", "wk_dkh"), ("attn", "wv_dkh"))
        per_layer = [
            TensorSpec(("attn_norm", "scale"), LAYER + "norm_1.weight", None),
            TensorSpec(("attn", "wq_dnh"), LAYER + "attn.Wqkv.weight", 1, fused_with=kv),
            TensorSpec(("attn", "wo_nhd"), LAYER + "attn.out_proj.weight", 2),
            TensorSpec(("mlp_norm", "scale"), LAYER + "norm_2.weight", None),
            TensorSpec(("mlp", "w_up_df"), LAYER + "ffn.up_proj.weight", 1),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "ffn.down_proj.weight", 1),
        ]
        return top, per_layer

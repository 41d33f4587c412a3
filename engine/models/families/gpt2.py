"""GPT-2 (GPT2LMHeadModel) and GPT-BigCode (GPTBigCodeForCausalLM; SantaCoder, StarCoder).

Pre-norm layers with LayerNorms (weight and bias), learned absolute positions (`wpe`) added
to the token embeddings, biases on every projection, a non-gated MLP (c_fc, c_proj) with
HF's gelu_new, and one fused projection for queries, keys and values (`c_attn`). GPT-2
stores its matrices as Conv1D, (in, out) (TensorSpec.in_out), c_attn's columns q, k, v;
GPT-BigCode as Linear (out, in), c_attn's rows the queries then one key and one value head
(`multi_query`), or without it each head's query, key and value rows together
(TensorSpec.fused_groups). The two share config.json's GPT-2 keys
(n_embd, n_layer, n_head, n_inner, n_positions).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family

LAYER = "transformer.h.{i}."
ACTIVATIONS = {
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu": "gelu",
    "relu": "relu",
    "relu2": "relu2",
    "silu": "silu",
    "swish": "silu",
}
"""config.json activation_function -> ModelConfig.mlp.activation (HF's gelu_new, gelu_pytorch_tanh
and gelu_fast are one tanh approximation)."""


def layer_norm(path: str, hf_prefix: str, bias: bool = True) -> list[TensorSpec]:
    """A LayerNorm's weight (and bias) as the engine's `path` scale (and bias)."""
    specs = [TensorSpec((*path.split("/"), "scale"), hf_prefix + ".weight", None)]
    return specs + ([TensorSpec((*path.split("/"), "bias"), hf_prefix + ".bias", None)] if bias else [])


def activation_of(hf: dict, key: str, default: str, where: str) -> str:
    name = hf.get(key) or default
    if name not in ACTIVATIONS:
        raise ConfigError(f"{where}: {key} '{name}' is not supported ({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def refuse_true(hf: dict, keys: tuple[str, ...], where: str) -> None:
    for key in keys:
        if hf.get(key):
            raise ConfigError(f"{where}: {key}=true is not supported")


@register_family
class GPT2(Family):
    name = "gpt2"
    architecture = "GPT2LMHeadModel"
    model_type = "gpt2"
    default_activation = "gelu_new"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("n_embd", "n_layer", "n_head", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        refuse_true(hf, ("add_cross_attention", "scale_attn_by_inverse_layer_idx"), where)
        d, n = hf["n_embd"], hf["n_head"]
        if d % n:
            raise ConfigError(f"{where}: n_embd {d} is not a multiple of n_head {n}")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["n_layer"],
            "num_heads": n,
            "num_kv_heads": self.kv_heads(hf, where),
            "head_dim": d // n,
            "mlp_dim": hf.get("n_inner") or 4 * d,
            "max_seq_len": hf.get("n_positions") or 1024,
            "norm_eps": hf.get("layer_norm_epsilon") or 1e-5,
            "tie_embeddings": hf.get("tie_word_embeddings", True) is not False,
            "activation": activation_of(hf, "activation_function", self.default_activation, where),
            "init_std": hf.get("initializer_range") or 0.02,
            # scale_attn_weights false: the scores are not divided by sqrt(head_dim)
            "attention_scale": None if hf.get("scale_attn_weights", True) else 1.0,
            "norm_kind": "layer",
            "norm_bias": True,
            "mlp_gated": False,
            "mlp_bias": True,
            "qkv_bias": True,
            "attention_out_bias": True,
            "positions": "learned",
        }

    def kv_heads(self, hf: dict, where: str) -> int:
        return hf["n_head"]

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.num_layers,
            "n_head": cfg.attention.num_heads,
            "n_inner": cfg.mlp.dim,
            "activation_function": {"gelu_tanh": self.default_activation}.get(cfg.mlp.activation, cfg.mlp.activation),
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "layer_norm_epsilon": cfg.norm.eps,
            "initializer_range": cfg.init_std,
            "scale_attn_weights": cfg.attention.scale is None,
            "use_cache": True,
            "add_cross_attention": False,
            "tie_word_embeddings": cfg.tie_embeddings,
            **self.extra_hf_keys(cfg),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "summary_type": "cls_index",
            "summary_use_proj": True,
            "summary_activation": None,
            "summary_proj_to_labels": True,
            "summary_first_dropout": 0.1,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "transformer.wte.weight", None),
            TensorSpec(("pos_embed_pd",), "transformer.wpe.weight", None),
            *layer_norm("final_norm", "transformer.ln_f"),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        per_layer = [
            *layer_norm("attn_norm", LAYER + "ln_1"),
            *self.attention(cfg),
            *layer_norm("mlp_norm", LAYER + "ln_2"),
            *self.mlp(),
        ]
        return top, per_layer

    def attention(self, cfg: ModelConfig) -> list[TensorSpec]:
        """c_attn (Conv1D: q, k, v along its columns) and c_proj, with biases."""
        qkv = (("attn", "wk_dkh"), ("attn", "wv_dkh"))
        biases = (("attn", "bk_kh"), ("attn", "bv_kh"))
        return [
            TensorSpec(("attn", "wq_dnh"), LAYER + "attn.c_attn.weight", 1, fused_with=qkv, in_out=True),
            TensorSpec(("attn", "bq_nh"), LAYER + "attn.c_attn.bias", None, flatten=True, fused_with=biases),
            TensorSpec(("attn", "wo_nhd"), LAYER + "attn.c_proj.weight", 2, in_out=True),
            TensorSpec(("attn", "bo_d"), LAYER + "attn.c_proj.bias", None),
        ]

    def mlp(self) -> list[TensorSpec]:
        return [
            TensorSpec(("mlp", "w_up_df"), LAYER + "mlp.c_fc.weight", 1, in_out=True),
            TensorSpec(("mlp", "b_up_f"), LAYER + "mlp.c_fc.bias", None),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.c_proj.weight", 1, in_out=True),
            TensorSpec(("mlp", "b_down_d"), LAYER + "mlp.c_proj.bias", None),
        ]

    def checkpoint_name(self, stored: str) -> str:
        # openai-community/gpt2 and its sizes were saved from GPT2Model: `h.0.`, `wte.`, no LM head
        return stored if stored.startswith(("transformer.", "lm_head.")) else "transformer." + stored

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        # Older checkpoints saved GPT-2's causal mask buffers (attn.bias, attn.masked_bias).
        return name.endswith((".attn.bias", ".attn.masked_bias"))


@register_family
class GPTBigCode(GPT2):
    """GPT-2 with Linear layers and multi-query attention (`multi_query`: one KV head; false:
    every head its own)."""

    name = "gpt_bigcode"
    architecture = "GPTBigCodeForCausalLM"
    model_type = "gpt_bigcode"
    default_activation = "gelu_pytorch_tanh"

    def kv_heads(self, hf: dict, where: str) -> int:
        return 1 if hf.get("multi_query", True) else hf["n_head"]

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "attention_softmax_in_fp32": True,
            "scale_attention_softmax_in_fp32": True,
            "multi_query": cfg.attention.num_kv_heads == 1,
            "num_key_value_heads": cfg.attention.num_kv_heads,
        }

    def attention(self, cfg: ModelConfig) -> list[TensorSpec]:
        # multi-query: c_attn's rows q, k, v; otherwise each head's q, k, v rows together
        groups = 1 if cfg.attention.num_kv_heads == 1 else cfg.attention.num_heads
        qkv = (("attn", "wk_dkh"), ("attn", "wv_dkh"))
        biases = (("attn", "bk_kh"), ("attn", "bv_kh"))
        return [
            TensorSpec(("attn", "wq_dnh"), LAYER + "attn.c_attn.weight", 1, fused_with=qkv, fused_groups=groups),
            TensorSpec(
                ("attn", "bq_nh"),
                LAYER + "attn.c_attn.bias",
                None,
                flatten=True,
                fused_with=biases,
                fused_groups=groups,
            ),
            TensorSpec(("attn", "wo_nhd"), LAYER + "attn.c_proj.weight", 2),
            TensorSpec(("attn", "bo_d"), LAYER + "attn.c_proj.bias", None),
        ]

    def mlp(self) -> list[TensorSpec]:
        return [
            TensorSpec(("mlp", "w_up_df"), LAYER + "mlp.c_fc.weight", 1),
            TensorSpec(("mlp", "b_up_f"), LAYER + "mlp.c_fc.bias", None),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.c_proj.weight", 1),
            TensorSpec(("mlp", "b_down_d"), LAYER + "mlp.c_proj.bias", None),
        ]

    def checkpoint_name(self, stored: str) -> str:
        return stored

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return False

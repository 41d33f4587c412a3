"""GPT-J and CodeGen (GPTJForCausalLM, CodeGenForCausalLM).

One LayerNorm (ln_1, with a bias) feeds both sublayers, x + attn(ln(x)) + mlp(ln(x))
(residual parallel_shared_norm); attention without biases; a non-gated MLP with biases
(fc_in, fc_out; gelu_new); a bias on the LM head. RoPE rotates adjacent pairs of the first
`rotary_dim` dimensions of each head (rotate_every_two: ModelConfig.rope.interleave), base
10000. GPT-J's q, k and v are separate projections; CodeGen's are one, `qkv_proj`, in the 4
groups of the model-parallel shards it was trained on, each its share of q, v, k
(TensorSpec.fused_groups). config.json speaks GPT-2's keys (n_embd, n_layer, n_head, n_inner).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families import classic
from engine.models.families.base import Family, TensorSpec, register_family

LAYER = "transformer.h.{i}."
ALIASES = {
    "n_embd": "hidden_size",
    "n_layer": "num_hidden_layers",
    "n_head": "num_attention_heads",
    "n_positions": "max_position_embeddings",
}


@register_family
class GPTJ(Family):
    name = "gptj"
    architecture = "GPTJForCausalLM"
    model_type = "gptj"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        aliases = {key: hf[alias] for key, alias in ALIASES.items() if hf.get(key) is None and alias in hf}
        hf = {**hf, **aliases}  # the names transformers' attribute_map also takes
        classic.require(hf, ("vocab_size", "n_embd", "n_layer", "n_head"), where)
        d, n = hf["n_embd"], hf["n_head"]
        if hf.get("rotary_dim") is None:  # transformers would rotate with a table as wide as n_embd
            raise ConfigError(f"{where}: rotary_dim must be set (the rotated dims of each head)")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["n_layer"],
            "num_heads": n,
            "num_kv_heads": n,
            "head_dim": d // n,
            "mlp_dim": hf.get("n_inner") or 4 * d,
            "max_seq_len": hf.get("n_positions") or 2048,
            "norm_eps": hf.get("layer_norm_epsilon") or 1e-5,
            "rope_theta": 10000.0,
            "rotary_dim": hf["rotary_dim"],
            "rope_interleave": True,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "activation": classic.activation(hf, "activation_function", "gelu_new", where),
            "init_std": hf.get("initializer_range") or 0.02,
            "norm_kind": "layer",
            "norm_bias": True,
            "residual": "parallel_shared_norm",
            "mlp_gated": False,
            "mlp_bias": True,
            "lm_head_bias": True,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.num_layers,
            "n_head": cfg.attention.num_heads,
            "rotary_dim": cfg.rope.rotary_dim,
            "n_inner": None if cfg.mlp.dim == 4 * cfg.d_model else cfg.mlp.dim,
            "activation_function": {"gelu_tanh": "gelu_new"}.get(cfg.mlp.activation, cfg.mlp.activation),
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "layer_norm_epsilon": cfg.norm.eps,
            "initializer_range": cfg.init_std,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return classic.attention(LAYER + "attn.", ("q_proj", "k_proj", "v_proj", "out_proj"), False, False)

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "transformer.wte.weight", None),
            *classic.norm("final_norm", "transformer.ln_f", bias=True),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        top.append(TensorSpec(("lm_head_bias_v",), "lm_head.bias", None))
        per_layer = [
            *classic.norm("attn_norm", LAYER + "ln_1", bias=True),
            *self.attention_tensors(cfg),
            *classic.plain_mlp(LAYER + "mlp.", "fc_in", "fc_out", bias=True),
        ]
        return top, per_layer


@register_family
class CodeGen(GPTJ):
    name = "codegen"
    architecture = "CodeGenForCausalLM"
    model_type = "codegen"

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**super().config_to_hf(cfg), "n_ctx": cfg.max_seq_len}

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [
            *classic.fused_qkv(LAYER + "attn.qkv_proj", False, groups=4, order="qvk"),
            TensorSpec(("attn", "wo_nhd"), LAYER + "attn.out_proj.weight", 2),
        ]

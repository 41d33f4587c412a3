"""RecurrentGemma (google/recurrentgemma-*; transformers' recurrent_gemma): Griffin's residual
blocks, each a temporal block then an MLP, both pre-normed by Gemma's zero-centred RMSNorm.
The temporal blocks follow block_types (recurrent, recurrent, attention, repeating): Griffin's
recurrent block (the `rglru` mixer kind, engine/models/rglru.py) or local multi-query
attention over attention_window_size positions, RoPE on the first partial_rotary_factor of
each head, o_proj with a bias. The MLP is GeGLU with biases, of width intermediate_size / 2.
Embeddings are multiplied by sqrt(hidden_size) rounded to bfloat16 (transformers' normalizer
buffer: ModelConfig.embedding_multiplier), the logits soft-capped (logits_soft_cap).

transformers reads no context length for it: the engine's max_seq_len is 8192 (its training
context) for every RecurrentGemma.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    register_family,
    rope_parameters_to_hf,
    shortest_period,
)

KINDS = {"recurrent": "rglru", "attention": "attention"}
"""config.json block_types -> the mixer kind."""
MAX_SEQ_LEN = 8192


def embedding_multiplier(d_model: int) -> float:
    """sqrt(d_model) rounded to bfloat16, as transformers' normalizer buffer holds it."""
    value = np.float32(d_model**0.5)
    bits = value.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16  # round to nearest even
    return float(np.uint32(rounded).view(np.float32))


@register_family
class RecurrentGemma(Family):
    name = "recurrent_gemma"
    architecture = "RecurrentGemmaForCausalLM"
    model_type = "recurrent_gemma"
    hf_defaults = {
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_window_size": 2048,
        "logits_soft_cap": 30.0,
        "conv1d_width": 4,
        "block_types": ["recurrent", "recurrent", "attention"],
        "hidden_activation": "gelu_pytorch_tanh",
        "w_init_variance_scale": 0.01,
    }
    fixed = {"norm_zero_centered": True, "mlp_bias": True, "attention_out_bias": True, "max_seq_len": MAX_SEQ_LEN}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        activation = self.hf_value(hf, "hidden_activation")
        if activation not in ("gelu_pytorch_tanh", "gelu_new"):
            raise ConfigError(f"{where}: hidden_activation '{activation}' is not supported (gelu_pytorch_tanh)")
        d, heads, layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
        types = list(hf.get("block_types") or hf.get("_block_types") or self.hf_defaults["block_types"])
        unknown = sorted(set(types) - set(KINDS))
        if unknown:
            raise ConfigError(f"{where}: block_types '{unknown[0]}' is not supported (recurrent, attention)")
        kinds = [KINDS[types[i % len(types)]] for i in range(layers)]
        rope = dict(hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta", 10000.0)})
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"{where}: rope_type '{rope['rope_type']}' is not supported (default)")
        head_dim = d // heads
        rotary = int(head_dim * rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.5)))
        width = hf.get("lru_width") or d
        if width % heads:
            raise ConfigError(f"{where}: lru_width ({width}) must be a multiple of num_attention_heads ({heads})")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": head_dim,
            "mlp_dim": hf["intermediate_size"] // 2,
            "norm_eps": self.hf_value(hf, "rms_norm_eps"),
            "rope_theta": float(rope.get("rope_theta", 10000.0)),
            "rotary_dim": None if rotary == head_dim else rotary,
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "activation": "gelu_tanh",
            "qkv_bias": bool(hf.get("attention_bias")),
            "attention_pattern": ["local"],
            "sliding_window": self.hf_value(hf, "attention_window_size"),
            "final_logit_softcap": self.hf_value(hf, "logits_soft_cap"),
            "embedding_multiplier": embedding_multiplier(d),
            "init_std": 0.02,
            "mixer_pattern": shortest_period(kinds) if "rglru" in kinds else None,
            "rglru": (
                {"width": width, "num_heads": heads, "conv_kernel": self.hf_value(hf, "conv1d_width")}
                if "rglru" in kinds
                else None
            ),
            **self.fixed,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        kinds = [layer.mixer for layer in cfg.layer_pattern()]
        period = len(cfg.mixer_pattern or ["attention"])
        lru = cfg.rglru
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": 2 * cfg.mlp.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "lru_width": lru.width if lru is not None else cfg.d_model,
            "attention_window_size": cfg.attention.sliding_window,
            "conv1d_width": lru.conv_kernel if lru is not None else self.hf_defaults["conv1d_width"],
            "logits_soft_cap": cfg.head.softcap,
            "rms_norm_eps": cfg.norm.eps,
            "use_cache": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {
                **rope_parameters_to_hf(cfg.rope.theta, None),
                "partial_rotary_factor": (cfg.rope.rotary_dim or cfg.attention.head_dim) / cfg.attention.head_dim,
            },
            "block_types": ["recurrent" if kind == "rglru" else "attention" for kind in kinds[:period]],
            "attention_dropout": 0.0,
            "attention_bias": cfg.attention.qkv_bias,
            "w_init_variance_scale": self.hf_defaults["w_init_variance_scale"],
            "final_w_init_variance_scale": 2.0 / cfg.num_layers,  # (transformers writes its derived values)
            "head_dim": cfg.attention.head_dim,
            "tie_word_embeddings": cfg.tie_embeddings,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.final_norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        block, mlp = LAYER + "temporal_block.", LAYER + "mlp_block."
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            if layers[indices[0]].mixer == "rglru":
                lru = block + "rg_lru."
                mixer = [
                    TensorSpec(("attn", "w_y_dw"), block + "linear_y.weight", 1),
                    TensorSpec(("attn", "b_y_w"), block + "linear_y.bias", None),
                    TensorSpec(("attn", "w_x_dw"), block + "linear_x.weight", 1),
                    TensorSpec(("attn", "b_x_w"), block + "linear_x.bias", None),
                    TensorSpec(("attn", "w_out_wd"), block + "linear_out.weight", 1),
                    TensorSpec(("attn", "b_out_d"), block + "linear_out.bias", None),
                    TensorSpec(("attn", "conv_w1k"), block + "conv_1d.weight", None),
                    TensorSpec(("attn", "conv_bias_w"), block + "conv_1d.bias", None),
                    TensorSpec(("attn", "recurrent_param_w"), lru + "recurrent_param", None),
                    TensorSpec(("attn", "w_input_gate_nkk"), lru + "input_gate_weight", None),
                    TensorSpec(("attn", "b_input_gate_nk"), lru + "input_gate_bias", None),
                    TensorSpec(("attn", "w_recurrent_gate_nkk"), lru + "recurrent_gate_weight", None),
                    TensorSpec(("attn", "b_recurrent_gate_nk"), lru + "recurrent_gate_bias", None),
                ]
            else:
                mixer = [
                    TensorSpec(("attn", "wq_dnh"), block + "q_proj.weight", 1),
                    TensorSpec(("attn", "wk_dkh"), block + "k_proj.weight", 1),
                    TensorSpec(("attn", "wv_dkh"), block + "v_proj.weight", 1),
                    TensorSpec(("attn", "wo_nhd"), block + "o_proj.weight", 2),
                    TensorSpec(("attn", "bo_d"), block + "o_proj.bias", None),
                ]
                if cfg.attention.qkv_bias:
                    mixer += [
                        TensorSpec(("attn", f"b{x}_{dims}"), block + f"{x}_proj.bias", None, flatten=True)
                        for x, dims in (("q", "nh"), ("k", "kh"), ("v", "kh"))
                    ]
            specs = [
                TensorSpec(("attn_norm", "scale"), LAYER + "temporal_pre_norm.weight", None),
                *mixer,
                TensorSpec(("mlp_norm", "scale"), LAYER + "channel_pre_norm.weight", None),
                TensorSpec(("mlp", "w_gate_df"), mlp + "gate_proj.weight", 1),
                TensorSpec(("mlp", "b_gate_f"), mlp + "gate_proj.bias", None),
                TensorSpec(("mlp", "w_up_df"), mlp + "up_proj.weight", 1),
                TensorSpec(("mlp", "b_up_f"), mlp + "up_proj.bias", None),
                TensorSpec(("mlp", "w_down_fd"), mlp + "down_proj.weight", 1),
                TensorSpec(("mlp", "b_down_d"), mlp + "down_proj.bias", None),
            ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

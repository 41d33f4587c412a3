"""Zamba2 (Zyphra/Zamba2-1.2B, -2.7B, -7B; transformers' zamba2): Mamba2 layers, some of which
(layers_block_type `hybrid`) first call one of num_mem_blocks shared attention + MLP blocks, in
turn, on the stream joined with the token embeddings, with adapters of their own
(engine/models/zamba2.py). In the engine the Mamba2-only layers form the stack
`mamba2_only_blocks`; each hybrid layer is a stack of its own (`zamba2_hybrid_{n}_blocks`, n its
place among them), and the shared blocks are model-level (`zamba2_shared_{b}`).

transformers ties each shared block's parameters across the hybrid layers that call it and saves
them once, under the first such layer (`model.layers.{first}.shared_transformer.*`); each call's
adapters sit in that block's lists at the call's index (`gate_up_proj_adapter_list.{n}.*`, and
`linear_{q,k,v}_adapter_list.{n}.*` with use_shared_attention_adapter). Conversion reads and
export writes exactly those names.

The shared attention's heads are 2 hidden_size / num_attention_heads wide, its scores scaled by
(head_dim / 2)^-1/2 (query_pre_attn_scalar head_dim / 2). The Mamba2 mixers' convolution always
has a bias (use_conv_bias is not read by transformers), their dt is clamped below at
time_step_min in the chunked scan, and their gated norm's epsilon is 1e-5 (the model's
rms_norm_eps must be it). time_step_max and time_step_floor only initialise dt: written as
transformers' defaults.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

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
from engine.models.families.nemotron_h import mamba2_of, mamba2_tensors

KINDS = {"mamba": "mamba2", "linear_attention": "mamba2", "hybrid": "zamba2_hybrid"}
"""layers_block_type entry -> ModelConfig.mixer_pattern kind (`mamba`: the older name)."""
ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "silu": "silu"}
GATED_NORM_EPS = 1e-5
"""transformers' Zamba2 Mamba2 gated norm's epsilon (fixed, whatever rms_norm_eps says)."""


def default_layers() -> list[str]:
    """transformers' layers_block_type when config.json has none (Zamba2-2.7B's 54 layers)."""
    return (
        ["mamba"]
        + (["mamba"] * 5 + ["hybrid"]) * 7
        + ["mamba"] * 4
        + ["hybrid"]
        + ["mamba"] * 3
        + ["hybrid"]
        + ["mamba"] * 2
    )


def hybrid_layers(cfg: ModelConfig) -> list[int]:
    """The model's hybrid layers, in order (transformers' hybrid_layer_ids)."""
    return [i for i, layer in enumerate(cfg.layer_pattern()) if layer.mixer == "zamba2_hybrid"]


@register_family
class Zamba2(Family):
    name = "zamba2"
    architecture = "Zamba2ForCausalLM"
    model_type = "zamba2"
    peft_refuses = {"out_proj": "PEFT refuses LoRA on a Mamba model's out_proj"}
    hf_defaults = {
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "hidden_act": "gelu",
        "mamba_d_state": 64,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "n_mamba_heads": 8,
        "chunk_size": 256,
        "time_step_min": 0.001,
        "num_mem_blocks": 1,
        "adapter_rank": 128,
        "use_shared_attention_adapter": False,
        "use_mem_rope": False,
    }
    hf_constants = {
        "add_bias_linear": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "num_logits_to_keep": 1,
        "use_conv_bias": True,
        "use_long_context": False,
        "use_mamba_kernels": True,
        "use_mem_eff_path": False,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        if hf.get("add_bias_linear"):
            raise ConfigError(f"{where}: add_bias_linear=true is not supported (Zamba2's projections without biases)")
        if hf.get("use_long_context"):
            raise ConfigError(f"{where}: use_long_context=true is not supported (convert the model without it)")
        act = self.hf_value(hf, "hidden_act")
        if act not in ACTIVATIONS:
            raise ConfigError(f"{where}: hidden_act '{act}' is not supported ({', '.join(ACTIVATIONS)})")
        eps = self.hf_value(hf, "rms_norm_eps")
        if eps != GATED_NORM_EPS:
            raise ConfigError(
                f"{where}: rms_norm_eps {eps} is not supported (1e-5, the Mamba2 gated norm's fixed value)"
            )
        d, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_attention_heads"]
        types = hf.get("layers_block_type") or (default_layers() if layers == 54 else None)
        if types is None or len(types) != layers or set(types) - set(KINDS):
            raise ConfigError(
                f"{where}: layers_block_type must name {layers} layers of mamba / linear_attention / hybrid"
            )
        kinds = [KINDS[t] for t in types]
        if "zamba2_hybrid" not in kinds:
            raise ConfigError(f"{where}: layers_block_type has no hybrid layer (a Zamba2 model calls its shared block)")
        blocks = self.hf_value(hf, "num_mem_blocks")
        if blocks > kinds.count("zamba2_hybrid"):
            raise ConfigError(
                f"{where}: num_mem_blocks {blocks} exceeds the {kinds.count('zamba2_hybrid')} hybrid layers "
                "(transformers builds a shared block per hybrid layer at most)"
            )
        if (2 * d) % heads:
            raise ConfigError(f"{where}: num_attention_heads {heads} must divide 2 x hidden_size ({2 * d})")
        head_dim, kv_heads = 2 * d // heads, hf.get("num_key_value_heads") or heads
        adapters = self.hf_value(hf, "use_shared_attention_adapter")
        if adapters and kv_heads != heads:
            raise ConfigError(
                f"{where}: use_shared_attention_adapter needs num_key_value_heads = num_attention_heads ({heads})"
            )
        mamba_heads = self.hf_value(hf, "n_mamba_heads")
        inner = int(self.hf_value(hf, "mamba_expand") * d)
        if inner % mamba_heads:
            raise ConfigError(f"{where}: n_mamba_heads {mamba_heads} must divide mamba_expand x hidden_size ({inner})")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": kv_heads,
            "head_dim": head_dim,
            "query_pre_attn_scalar": head_dim / 2,
            "mlp_dim": hf.get("intermediate_size") or 4 * d,
            "activation": ACTIVATIONS[act],
            "max_seq_len": self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": eps,
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            **self.rope_from_hf(hf, where),
            "mixer_pattern": shortest_period(kinds),
            "ffn_pattern": ["none"],
            "mamba2": {
                "num_heads": mamba_heads,
                "head_dim": inner // mamba_heads,
                "state_size": self.hf_value(hf, "mamba_d_state"),
                "n_groups": self.hf_value(hf, "mamba_ngroups"),
                "conv_kernel": self.hf_value(hf, "mamba_d_conv"),
                "chunk_size": self.hf_value(hf, "chunk_size"),
                "conv_bias": True,
                "proj_bias": False,
                "dt_limit": [float(self.hf_value(hf, "time_step_min")), math.inf],
            },
            "zamba2": {
                "shared_blocks": blocks,
                "adapter_rank": self.hf_value(hf, "adapter_rank"),
                "attention_adapters": adapters,
                "rope": self.hf_value(hf, "use_mem_rope"),
            },
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        m, z = mamba2_of(cfg), cfg.zamba2
        assert z is not None  # a zamba2 model has its shared blocks (ModelConfig checks)
        d, heads = cfg.d_model, cfg.attention.num_heads
        types = ["hybrid" if layer.mixer == "zamba2_hybrid" else "linear_attention" for layer in cfg.layer_pattern()]
        low = 0.0 if m.dt_limit is None else m.dt_limit[0]
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": d,
            "intermediate_size": cfg.mlp.dim,
            "hidden_act": {v: k for k, v in reversed(ACTIVATIONS.items())}[cfg.mlp.activation],
            "num_hidden_layers": cfg.num_layers,
            "layers_block_type": types,
            "hybrid_layer_ids": hybrid_layers(cfg),
            "num_attention_heads": heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "num_query_groups": heads,
            "attention_hidden_size": 2 * d,
            "attention_head_dim": 2 * d // heads,
            "kv_channels": d // heads,
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm.eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "mamba_d_state": m.state_size,
            "mamba_d_conv": m.conv_kernel,
            "mamba_expand": m.num_heads * m.head_dim // d,
            "mamba_ngroups": m.n_groups,
            "mamba_headdim": m.head_dim,
            "n_mamba_heads": m.num_heads,
            "chunk_size": m.chunk_size,
            "time_step_min": low,
            "num_mem_blocks": z.shared_blocks,
            "adapter_rank": z.adapter_rank,
            "use_shared_attention_adapter": z.attention_adapters,
            "use_mem_rope": z.rope,
            **self.hf_constants,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        z = cfg.zamba2
        assert z is not None
        hybrids = hybrid_layers(cfg)
        top = [TensorSpec(("embed_vd",), "model.embed_tokens.weight", None)]
        for b in range(z.shared_blocks):  # each shared block under the first layer calling it
            key, prefix = f"zamba2_shared_{b}", f"model.layers.{hybrids[b]}.shared_transformer."
            top += [
                TensorSpec((key, "input_norm", "scale"), prefix + "input_layernorm.weight", None),
                TensorSpec((key, "wq_xf"), prefix + "self_attn.q_proj.weight", 1),
                TensorSpec((key, "wk_xf"), prefix + "self_attn.k_proj.weight", 1),
                TensorSpec((key, "wv_xf"), prefix + "self_attn.v_proj.weight", 1),
                TensorSpec((key, "wo_fd"), prefix + "self_attn.o_proj.weight", 1),
                TensorSpec((key, "mlp_norm", "scale"), prefix + "pre_ff_layernorm.weight", None),
                TensorSpec((key, "w_gate_up_dm"), prefix + "feed_forward.gate_up_proj.weight", 1),
                TensorSpec((key, "w_down_md"), prefix + "feed_forward.down_proj.weight", 1),
            ]
        top.append(TensorSpec(("final_norm", "scale"), "model.final_layernorm.weight", None))
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            layer = layers[indices[0]]
            if layer.mixer == "mamba2":
                specs = [
                    TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
                    *mamba2_tensors(LAYER + "mamba.", cfg),
                ]
            else:
                call = layer.shared_call
                assert call is not None  # a hybrid layer's place among them (ModelConfig.layer_pattern)
                mamba = mamba2_tensors(LAYER + "mamba_decoder.mamba.", cfg)
                shared = f"model.layers.{hybrids[call % z.shared_blocks]}.shared_transformer."
                specs = [
                    TensorSpec(("attn", "w_linear_dd"), LAYER + "linear.weight", 1),
                    TensorSpec(("attn", "mamba_norm", "scale"), LAYER + "mamba_decoder.input_layernorm.weight", None),
                    *(dataclasses.replace(s, path=("attn", "mamba", *s.path[1:])) for s in mamba),
                    TensorSpec(
                        ("attn", "gate_up_adapter_down_dr"),
                        f"{shared}feed_forward.gate_up_proj_adapter_list.{call}.0.weight",
                        1,
                    ),
                    TensorSpec(
                        ("attn", "gate_up_adapter_up_rm"),
                        f"{shared}feed_forward.gate_up_proj_adapter_list.{call}.1.weight",
                        1,
                    ),
                ]
                if z.attention_adapters:
                    for x in "qkv":
                        adapter = f"{shared}self_attn.linear_{x}_adapter_list.{call}."
                        specs += [
                            TensorSpec(("attn", f"{x}_adapter_down_xr"), adapter + "0.weight", 1),
                            TensorSpec(("attn", f"{x}_adapter_up_rf"), adapter + "1.weight", 1),
                        ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

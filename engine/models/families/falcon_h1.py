"""Falcon-H1 (tiiuae/Falcon-H1-*; transformers' falcon_h1): every layer runs attention (RoPE,
grouped-query) and a Mamba2 mixer side by side on the same normed input and adds both to the
residual (engine/models/parallel_hybrid.py, the `attention_mamba2` mixer kind), then a gated
MLP. Its muP multipliers scale activations, not weights (ModelConfig.mup): the embeddings,
the keys, each branch's input and output, in_proj's five sections (z, x, B, C, dt), the MLP's
gate and output, and the logits.

The Mamba2 width is mamba_d_ssm (not tied to hidden_size); its gated RMSNorm is optional
(mamba_rms_norm) and may normalise before the gate (mamba_norm_before_gate).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig, MuPMultipliers
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    register_family,
    rope_parameters_to_hf,
)
from engine.models.families.nemotron_h import (
    mamba2_of,
    mamba2_tensors,
    time_step_limit_from_hf,
    time_step_limit_to_hf,
)

SCALARS = {
    "lm_head_multiplier": "lm_head",
    "key_multiplier": "key",
    "attention_in_multiplier": "attention_in",
    "attention_out_multiplier": "attention_out",
    "ssm_in_multiplier": "ssm_in",
    "ssm_out_multiplier": "ssm_out",
}
"""config.json's scalar multipliers -> MuPMultipliers' fields (mlp_multipliers and
ssm_multipliers are lists, embedding_multiplier is ModelConfig's own field)."""


@register_family
class FalconH1(Family):
    name = "falcon_h1"
    architecture = "FalconH1ForCausalLM"
    model_type = "falcon_h1"
    peft_refuses = {"out_proj": "PEFT refuses LoRA on a Mamba model's out_proj"}
    hf_defaults = {
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "mamba_n_heads": 128,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_rms_norm": False,
        "mamba_norm_before_gate": True,
    }
    unsupported_flags = ("attention_bias", "mlp_bias", "projectors_bias", "mamba_proj_bias")
    hf_constants = {
        "attention_bias": False,
        "mlp_bias": False,
        "projectors_bias": False,
        "mamba_proj_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_cache": True,
        "num_logits_to_keep": 1,
        "mamba_expand": 2,  # unread where mamba_d_ssm is set, as export writes it
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        for key in self.unsupported_flags:
            if hf.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act '{hf['hidden_act']}' is not supported (silu)")
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        inner = hf.get("mamba_d_ssm") or self.hf_value(hf, "mamba_expand") * d
        mamba_heads = self.hf_value(hf, "mamba_n_heads")
        head_dim = hf.get("mamba_d_head")
        head_dim = inner // mamba_heads if head_dim in (None, "auto") else head_dim
        if head_dim * mamba_heads != inner:
            raise ConfigError(f"{where}: mamba_n_heads x mamba_d_head must be mamba_d_ssm ({inner})")
        mlp = hf.get("mlp_multipliers") or [1.0, 1.0]
        ssm = hf.get("ssm_multipliers") or [1.0] * 5
        if len(mlp) != 2 or len(ssm) != 5:
            raise ConfigError(f"{where}: mlp_multipliers needs 2 numbers and ssm_multipliers 5")
        mup = MuPMultipliers(
            **{field: float(self.hf_value(hf, key, 1.0)) for key, field in SCALARS.items()},
            ssm_projections=tuple(float(x) for x in ssm),
            mlp_gate=float(mlp[0]),
            mlp_down=float(mlp[1]),
        )
        embedding = float(self.hf_value(hf, "embedding_multiplier", 1.0))
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or d // heads,
            "mlp_dim": hf["intermediate_size"],
            "max_seq_len": self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": self.hf_value(hf, "rms_norm_eps"),
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            **self.rope_from_hf(hf, where),
            "mixer_pattern": ["attention_mamba2"],
            "mamba2": {
                "num_heads": mamba_heads,
                "head_dim": head_dim,
                "state_size": self.hf_value(hf, "mamba_d_state"),
                "n_groups": self.hf_value(hf, "mamba_n_groups"),
                "conv_kernel": self.hf_value(hf, "mamba_d_conv"),
                "chunk_size": self.hf_value(hf, "mamba_chunk_size"),
                "conv_bias": self.hf_value(hf, "mamba_conv_bias"),
                "proj_bias": False,
                "dt_limit": time_step_limit_from_hf(hf.get("time_step_limit"), where),
                "gated_norm": self.hf_value(hf, "mamba_rms_norm"),
                "norm_before_gate": self.hf_value(hf, "mamba_norm_before_gate"),
            },
            "embedding_multiplier": None if embedding == 1.0 else embedding,
            "mup": None if mup == MuPMultipliers() else mup.model_dump(),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        m, mup = mamba2_of(cfg), cfg.mup or MuPMultipliers()
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp.dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "head_dim": cfg.attention.head_dim,
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.norm.eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "mamba_d_ssm": m.num_heads * m.head_dim,
            "mamba_n_heads": m.num_heads,
            "mamba_d_head": m.head_dim,
            "mamba_n_groups": m.n_groups,
            "mamba_d_state": m.state_size,
            "mamba_d_conv": m.conv_kernel,
            "mamba_chunk_size": m.chunk_size,
            "mamba_conv_bias": m.conv_bias,
            "mamba_rms_norm": m.gated_norm,
            "mamba_norm_before_gate": m.norm_before_gate,
            "time_step_limit": time_step_limit_to_hf(m.dt_limit),
            "embedding_multiplier": cfg.embedding.multiplier or 1.0,
            **{key: getattr(mup, field) for key, field in SCALARS.items()},
            "mlp_multipliers": [mup.mlp_gate, mup.mlp_down],
            "ssm_multipliers": list(mup.ssm_projections),
            **self.hf_constants,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.final_layernorm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        mamba = [
            dataclasses.replace(spec, path=("attn", "mamba", *spec.path[1:]))
            for spec in mamba2_tensors(LAYER + "mamba.", cfg)
            if mamba2_of(cfg).gated_norm or spec.path[-1] != "norm_f"
        ]
        specs = [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            *mamba,
            *(
                TensorSpec(("attn", "attention", w), LAYER + f"self_attn.{x}_proj.weight", 2 if x == "o" else 1)
                for w, x in (("wq_dnh", "q"), ("wk_dkh", "k"), ("wv_dkh", "v"), ("wo_nhd", "o"))
            ),
            TensorSpec(("mlp_norm", "scale"), LAYER + "pre_ff_layernorm.weight", None),
            *(
                TensorSpec(("mlp", w), LAYER + f"feed_forward.{x}_proj.weight", 1)
                for w, x in (("w_gate_df", "gate"), ("w_up_df", "up"), ("w_down_fd", "down"))
            ),
        ]
        (stack, _), *rest = cfg.layer_stacks()
        assert not rest, "Falcon-H1's layers are all one kind"
        return top, [dataclasses.replace(spec, stack=stack) for spec in specs]

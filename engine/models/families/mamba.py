"""The pure state-space models: Mamba (state-spaces/mamba-130m ... 2.8b; transformers' mamba),
Falcon-Mamba (tiiuae/falcon-mamba-7b; falcon_mamba) and Mamba2 (state-spaces/mamba2-130m ...
2.7b; mamba2). Every layer is x + mixer(RMSNorm(x)): no attention, no MLP. In the engine a
layer is (mamba1 or mamba2, none), one stack `mamba1_only_blocks` / `mamba2_only_blocks`.

Mamba's mixer is engine/models/mamba1.py (its intermediate_size = expand x hidden_size, dt's
low-rank projection of time_step_rank); Falcon-Mamba's the same with RMSNorms without a scale
on dt's input, B and C (mixer_rms_eps). Mamba2's is engine/models/mamba2.py's, with its gated
RMSNorm over n_groups groups. transformers saves the model as `backbone` (embeddings, layers,
norm_f), the LM head tied by default (Mamba, Falcon-Mamba) or not (Mamba2).

The attention fields ModelConfig requires are placeholders (one head of 2): no layer has
attention. The keys transformers writes that only its initialisation or kernels read
(time_step_min/max/floor/scale/init_scheme, rescale_prenorm_residual, use_mambapy, ...) are
written at their defaults.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from engine.config import ConfigError
from engine.models.config import Mamba1Config, ModelConfig
from engine.models.families.base import Family, TensorSpec, register_family
from engine.models.families.nemotron_h import mamba2_tensors, time_step_limit_from_hf, time_step_limit_to_hf

LAYER = "backbone.layers.{i}."
NO_ATTENTION = {"num_heads": 1, "num_kv_heads": 1, "head_dim": 2, "rope_pattern": [False], "ffn_pattern": ["none"]}
"""ModelConfig's attention fields, unused: every layer is its mixer only."""


def mamba1_of(cfg: ModelConfig) -> Mamba1Config:
    """cfg.mamba1, which a model with Mamba1 layers has (ModelConfig checks)."""
    assert cfg.mamba1 is not None
    return cfg.mamba1


def mamba1_tensors(prefix: str, cfg: ModelConfig) -> list[TensorSpec]:
    """A Mamba1 mixer's tensors (engine/models/mamba1.py) under `prefix` (with `{i}` for the
    layer: `backbone.layers.{i}.mixer.`, Jamba's `model.layers.{i}.mamba.`)."""
    m = mamba1_of(cfg)
    specs = [
        TensorSpec(("attn", "a_log_cn"), prefix + "A_log", None),
        TensorSpec(("attn", "d_c"), prefix + "D", None),
        TensorSpec(("attn", "conv_c1k"), prefix + "conv1d.weight", None),
        *([TensorSpec(("attn", "conv_bias_c"), prefix + "conv1d.bias", None)] if m.conv_bias else []),
        TensorSpec(("attn", "w_dt_rc"), prefix + "dt_proj.weight", 1),
        TensorSpec(("attn", "b_dt_c"), prefix + "dt_proj.bias", None),
        TensorSpec(("attn", "w_in_dp"), prefix + "in_proj.weight", 1),
        *([TensorSpec(("attn", "b_in_p"), prefix + "in_proj.bias", None)] if m.proj_bias else []),
        TensorSpec(("attn", "w_out_cd"), prefix + "out_proj.weight", 1),
        *([TensorSpec(("attn", "b_out_d"), prefix + "out_proj.bias", None)] if m.proj_bias else []),
        TensorSpec(("attn", "w_x_cq"), prefix + "x_proj.weight", 1),
    ]
    if m.bcdt_norm == "weighted":  # Jamba's
        specs += [
            TensorSpec(("attn", "dt_norm_r"), prefix + "dt_layernorm.weight", None),
            TensorSpec(("attn", "b_norm_n"), prefix + "b_layernorm.weight", None),
            TensorSpec(("attn", "c_norm_n"), prefix + "c_layernorm.weight", None),
        ]
    return specs


def expand_of(inner: int, hidden: int, where: str) -> int:
    """config.json's `expand` of a mixer `inner` wide (transformers' intermediate_size = expand x hidden)."""
    if inner % hidden:
        raise ConfigError(f"{where}: the mixer width {inner} is not a whole multiple (expand) of hidden_size {hidden}")
    return inner // hidden


class _StateSpace(Family):
    """What Mamba, Falcon-Mamba and Mamba2 share: config.json's common keys, the `backbone`."""

    moe = False
    peft_refuses = {  # LoRA on in_proj and x_proj (Mamba-2: in_proj)
        "out_proj": "PEFT refuses LoRA on a Mamba model's out_proj",
        "dt_proj": "transformers' Mamba reads dt_proj.weight directly, so PEFT's adapter on it does nothing",
    }
    hf_defaults = {
        "layer_norm_epsilon": 1e-5,
        "expand": 2,
        "conv_kernel": 4,
        "use_bias": False,
        "use_conv_bias": True,
        "initializer_range": 0.1,
    }
    unsupported_flags = ()
    hf_constants = {
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "rescale_prenorm_residual": False,
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "use_cache": True,
    }

    def common_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act '{hf['hidden_act']}' is not supported (silu)")
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"],
            "mlp_dim": 1,
            "norm_eps": self.hf_value(hf, "layer_norm_epsilon"),
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            **NO_ATTENTION,
        }

    def common_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_layers,
            "layer_norm_epsilon": cfg.norm.eps,
            "tie_word_embeddings": cfg.tie_embeddings,
            "initializer_range": cfg.init_std,
            **self.hf_constants,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "backbone.embeddings.weight", None),
            TensorSpec(("final_norm", "scale"), "backbone.norm_f.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        (stack, _), *rest = cfg.layer_stacks()
        assert not rest  # one kind of layer
        specs = [TensorSpec(("attn_norm", "scale"), LAYER + "norm.weight", None), *self.mixer(cfg)]
        return top, [dataclasses.replace(spec, stack=stack) for spec in specs]

    def mixer(self, cfg: ModelConfig) -> list[TensorSpec]:
        raise NotImplementedError


@register_family
class Mamba(_StateSpace):
    name = "mamba"
    architecture = "MambaForCausalLM"
    model_type = "mamba"
    hf_defaults = {**_StateSpace.hf_defaults, "state_size": 16, "tie_word_embeddings": True}
    hf_constants = {
        **_StateSpace.hf_constants,
        "time_step_scale": 1.0,
        "time_step_init_scheme": "random",
        "use_mambapy": False,
        "use_associative_scan": True,
    }
    bcdt_norm = "none"

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        fields = self.common_from_hf(hf, where)
        hidden = hf["hidden_size"]
        rank = self.hf_value(hf, "time_step_rank", "auto")
        fields["mixer_pattern"] = ["mamba1"]
        fields["mamba1"] = {
            "inner": int(self.hf_value(hf, "expand") * hidden),
            "state_size": self.hf_value(hf, "state_size"),
            "dt_rank": math.ceil(hidden / 16) if rank == "auto" else rank,
            "conv_kernel": self.hf_value(hf, "conv_kernel"),
            "conv_bias": self.hf_value(hf, "use_conv_bias"),
            "proj_bias": self.hf_value(hf, "use_bias"),
            "bcdt_norm": self.bcdt_norm,
            **self.bcdt_from_hf(hf),
        }
        return fields

    def bcdt_from_hf(self, hf: dict) -> dict[str, Any]:
        return {}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        m = mamba1_of(cfg)
        expand = expand_of(m.inner, cfg.d_model, f"family '{self.name}'")
        return {
            **self.common_to_hf(cfg),
            "state_size": m.state_size,
            "expand": expand,
            "intermediate_size": m.inner,
            "conv_kernel": m.conv_kernel,
            "use_bias": m.proj_bias,
            "use_conv_bias": m.conv_bias,
            "time_step_rank": m.dt_rank,
        }

    def mixer(self, cfg: ModelConfig) -> list[TensorSpec]:
        return mamba1_tensors(LAYER + "mixer.", cfg)


@register_family
class FalconMamba(Mamba):
    """Mamba with RMSNorms without a scale on dt's low-rank input, B and C (mixer_rms_eps)."""

    name = "falcon_mamba"
    architecture = "FalconMambaForCausalLM"
    model_type = "falcon_mamba"
    bcdt_norm = "weightless"

    def bcdt_from_hf(self, hf: dict) -> dict[str, Any]:
        return {"bcdt_norm_eps": self.hf_value(hf, "mixer_rms_eps", 1e-6)}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**super().config_to_hf(cfg), "mixer_rms_eps": mamba1_of(cfg).bcdt_norm_eps}


@register_family
class Mamba2(_StateSpace):
    name = "mamba2"
    architecture = "Mamba2ForCausalLM"
    model_type = "mamba2"
    hf_defaults = {
        **_StateSpace.hf_defaults,
        "num_heads": 128,
        "head_dim": 64,
        "state_size": 128,
        "n_groups": 8,
        "chunk_size": 256,
        "tie_word_embeddings": False,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        fields = self.common_from_hf(hf, where)
        heads, head_dim = self.hf_value(hf, "num_heads"), self.hf_value(hf, "head_dim")
        expand = self.hf_value(hf, "expand")
        if expand * hf["hidden_size"] != heads * head_dim:
            raise ConfigError(
                f"{where}: hidden_size x expand ({hf['hidden_size']} x {expand}) must equal num_heads x head_dim "
                f"({heads} x {head_dim}), as transformers requires"
            )
        fields["mixer_pattern"] = ["mamba2"]
        fields["mamba2"] = {
            "num_heads": heads,
            "head_dim": head_dim,
            "state_size": self.hf_value(hf, "state_size"),
            "n_groups": self.hf_value(hf, "n_groups"),
            "conv_kernel": self.hf_value(hf, "conv_kernel"),
            "chunk_size": self.hf_value(hf, "chunk_size"),
            "conv_bias": self.hf_value(hf, "use_conv_bias"),
            "proj_bias": self.hf_value(hf, "use_bias"),
            "dt_limit": time_step_limit_from_hf(hf.get("time_step_limit"), where),
        }
        return fields

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        m = cfg.mamba2
        assert m is not None
        return {
            **self.common_to_hf(cfg),
            "num_heads": m.num_heads,
            "head_dim": m.head_dim,
            "state_size": m.state_size,
            "expand": expand_of(m.num_heads * m.head_dim, cfg.d_model, f"family '{self.name}'"),
            "n_groups": m.n_groups,
            "conv_kernel": m.conv_kernel,
            "chunk_size": m.chunk_size,
            "use_bias": m.proj_bias,
            "use_conv_bias": m.conv_bias,
            "time_step_limit": time_step_limit_to_hf(m.dt_limit),
            "time_step_rank": math.ceil(cfg.d_model / 16),  # declared, read by nothing
        }

    def mixer(self, cfg: ModelConfig) -> list[TensorSpec]:
        return mamba2_tensors(LAYER + "mixer.", cfg)

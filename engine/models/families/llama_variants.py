"""Dense decoders that are Llama but for a few config.json keys, tensor names or one setting:

- Helium (HeliumForCausalLM): RoPE on adjacent pairs (`rope_interleave`), an o_proj as wide as
  the model (so heads * head_dim = hidden_size), RMSNorm eps 1e-8.
- InternLM3 (published InternLM3ForCausalLM; transformers 5 runs it as Llama and saves it as
  LlamaForCausalLM): Llama's layout, its bias flags named `qkv_bias` and `bias`, dynamic NTK
  RoPE (RopeScaling kind dynamic).
- Seed-OSS (SeedOssForCausalLM): biases on q, k and v (`attention_bias`, on by default) and
  optionally on o_proj (`attention_out_bias`).
- Arcee AFM (ArceeForCausalLM): an MLP without a gate, down(relu(up(x))^2) (`mlp_gated` false).
- ERNIE 4.5 (Ernie4_5ForCausalLM): RoPE on adjacent pairs, `use_bias` for every projection.
- EXAONE 3 / 3.5 (published ExaoneForCausalLM, saved by transformers 5 as LlamaForCausalLM):
  Llama under GPT-2-style names (transformer.h.{i}.attn.attention.q_proj, mlp.c_fc_0, ...)
  and keys (num_layers, layer_norm_epsilon, activation_function).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, register_family


@register_family
class Helium(Family):
    name = "helium"
    architecture = "HeliumForCausalLM"
    model_type = "helium"
    fixed = {"rope_interleave": True}
    hf_defaults = {
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-8,
        "rope_theta": 100000.0,
    }
    unsupported_flags = ("attention_bias", "mlp_bias")
    hf_constants = {"attention_bias": False, "mlp_bias": False}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        # transformers' o_proj is (hidden_size, hidden_size), whatever the heads' width.
        heads, width = hf["num_attention_heads"], hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        if heads * width != hf["hidden_size"]:
            raise ConfigError(
                f"config.json ({self.architecture}): num_attention_heads * head_dim ({heads} * {width}) must equal "
                f"hidden_size ({hf['hidden_size']}), the width of Helium's o_proj"
            )
        return {}


@register_family
class InternLM3(Family):
    name = "internlm3"
    architecture = "InternLM3ForCausalLM"
    also_architectures = ("LlamaForCausalLM",)
    model_type = "internlm3"
    hf_defaults = {"max_position_embeddings": 32768, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    unsupported_flags = ("attention_bias", "mlp_bias", "qkv_bias", "bias")
    hf_constants = {"attention_bias": False, "mlp_bias": False}  # InternLM3Config has no pretraining_tp


@register_family
class SeedOss(Family):
    name = "seed_oss"
    architecture = "SeedOssForCausalLM"
    model_type = "seed_oss"
    hf_defaults = {
        "max_position_embeddings": 524288,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "attention_out_bias": False,
    }
    unsupported_flags = ("mlp_bias",)
    # Dropout is training-time only and the engine has none: the class's defaults, as published.
    hf_constants = {"mlp_bias": False, "pretraining_tp": 1, "attention_dropout": 0.1, "residual_dropout": 0.1}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        return {
            "qkv_bias": bool(self.hf_value(hf, "attention_bias")),
            "attention_out_bias": bool(self.hf_value(hf, "attention_out_bias")),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"attention_bias": cfg.attention.qkv_bias, "attention_out_bias": cfg.attention.out_bias}

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        specs = super().attention_tensors(cfg)
        if cfg.attention.qkv_bias:
            specs += [
                TensorSpec(("attn", f"b{x}_{shape}"), LAYER + f"self_attn.{x}_proj.bias", None, flatten=True)
                for x, shape in (("q", "nh"), ("k", "kh"), ("v", "kh"))
            ]
        if cfg.attention.out_bias:
            specs.append(TensorSpec(("attn", "bo_d"), LAYER + "self_attn.o_proj.bias", None))
        return specs


@register_family
class Arcee(Family):
    name = "arcee"
    architecture = "ArceeForCausalLM"
    model_type = "arcee"
    fixed = {"mlp_gated": False, "activation": "relu2"}
    hf_defaults = {"max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    hf_constants = {"attention_bias": False, "mlp_bias": False}  # ArceeConfig has no pretraining_tp

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        activation = self.activation_from_hf(hf) if hf.get("hidden_act") else "relu2"
        if activation != "relu2":
            raise ConfigError(f"{where}: hidden_act '{activation}' is not supported (Arcee's MLP: relu2)")
        return super().config_from_hf({**hf, "hidden_act": "silu"}, where)  # `fixed` sets relu2

    def activation_to_hf(self, cfg: ModelConfig) -> str:
        return "relu2"

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [
            TensorSpec(("mlp", "w_up_df"), LAYER + "mlp.up_proj.weight", 1),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.down_proj.weight", 1),
        ]


@register_family
class Ernie4_5(Family):
    name = "ernie4_5"
    architecture = "Ernie4_5ForCausalLM"
    also_architectures = ("Ernie4_5_ForCausalLM",)  # the first release's remote code, same tensors
    model_type = "ernie4_5"
    fixed = {"rope_interleave": True}
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
    }
    unsupported_flags = ("use_bias",)
    hf_constants = {"use_bias": False}

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["attention_dropout"]  # Ernie4_5Config has none (its attention never drops out)
        return hf


EXAONE_KEYS = {
    "num_layers": "num_hidden_layers",
    "layer_norm_epsilon": "rms_norm_eps",
    "activation_function": "hidden_act",
}
"""EXAONE's published config.json keys -> transformers 5's (ExaoneConfig.attribute_map)."""
EXAONE_LAYER = "transformer.h.{i}."


@register_family
class Exaone(Family):
    name = "exaone"
    architecture = "ExaoneForCausalLM"
    also_architectures = ("LlamaForCausalLM",)
    model_type = "exaone"
    hf_defaults = {
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
    }
    hf_constants = {"attention_bias": False, "mlp_bias": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # The published keys where transformers 5's are absent (as its attribute_map reads them).
        legacy = {new: hf[old] for old, new in EXAONE_KEYS.items() if hf.get(old) is not None and new not in hf}
        return super().config_from_hf({**hf, **legacy}, where)

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "transformer.wte.weight", None),
            TensorSpec(("final_norm", "scale"), "transformer.ln_f.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        attention = EXAONE_LAYER + "attn.attention."
        per_layer = [
            TensorSpec(("attn_norm", "scale"), EXAONE_LAYER + "ln_1.weight", None),
            TensorSpec(("attn", "wq_dnh"), attention + "q_proj.weight", 1),
            TensorSpec(("attn", "wk_dkh"), attention + "k_proj.weight", 1),
            TensorSpec(("attn", "wv_dkh"), attention + "v_proj.weight", 1),
            TensorSpec(("attn", "wo_nhd"), attention + "out_proj.weight", 2),
            TensorSpec(("mlp_norm", "scale"), EXAONE_LAYER + "ln_2.weight", None),
            TensorSpec(("mlp", "w_gate_df"), EXAONE_LAYER + "mlp.c_fc_0.weight", 1),
            TensorSpec(("mlp", "w_up_df"), EXAONE_LAYER + "mlp.c_fc_1.weight", 1),
            TensorSpec(("mlp", "w_down_fd"), EXAONE_LAYER + "mlp.c_proj.weight", 1),
        ]
        return top, per_layer

    def module_name(self, hf_name: str) -> str:
        """transformers 5 runs EXAONE as Llama: its modules (which PEFT names adapters by) have
        Llama's names (transformers' conversion_mapping renames the checkpoint's on loading)."""
        for old, new in EXAONE_MODULES:
            hf_name = hf_name.replace(old, new)
        return hf_name


EXAONE_MODULES = (
    ("transformer.wte.", "model.embed_tokens."),
    ("transformer.h.", "model.layers."),
    ("transformer.ln_f.", "model.norm."),
    (".attn.attention.", ".self_attn."),
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".ln_1.", ".input_layernorm."),
    (".ln_2.", ".post_attention_layernorm."),
    (".mlp.c_fc_0.", ".mlp.gate_proj."),
    (".mlp.c_fc_1.", ".mlp.up_proj."),
    (".mlp.c_proj.", ".mlp.down_proj."),
)

"""Xiaomi's MiMo-V2-Flash (MiMoV2FlashForCausalLM): grouped-query attention over DeepSeek-V3's
sigmoid router with a choosing bias and no shared experts.

Its attention differs by layer type (`layer_types`: the first layer and every sixth full, the
rest a sliding window): the sliding layers have twice the key/value heads of the full ones
and a learned sink logit per head (`self_attn.attention_sink_bias`), so the full layers form a
stack of their own (`global_blocks`, ModelConfig.global_num_kv_heads, local_sinks_only). Every
layer's values are narrower than its queries and keys (v_head_dim 128 under head_dim 192:
ModelConfig.attention_value_dim) and multiplied by attention_value_scale; RoPE rotates the
first int(head_dim * partial_rotary_factor) dimensions with a base per layer type
(rope_theta, rope_local_theta). The first layer's MLP is dense (`mlp_layer_types`).

The multi-token-prediction modules its checkpoints carry (`model.mtp.layers.{k}.*`, three
in MiMo-V2-Flash's; its config.json does not count them, so conversion counts them in the
weights) are converted, trained under ComputeConfig.mtp_loss and exported, as SGLang's
reference (mimo_v2_flash_nextn.py) and vLLM's loader read them; transformers skips them.
Each is DeepSeek-V3's module (engine/models/mtp.py: enorm, hnorm, eh_proj, final_layernorm)
around a sliding-window layer (the sliding layers' heads and sinks) with a dense MLP
(intermediate_size wide; its norms input_layernorm and pre_mlp_layernorm).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    TensorSpec,
    mtp_head_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)
from engine.models.families.routed_gqa import RoutedGqa, ffn_fields, mlp_layer_types

MTP = "model.mtp.layers.{k}."
"""The published multi-token-prediction module k's names (SGLang's and vLLM's loaders)."""

ROTARY_FRACTION = 0.334
"""transformers' default partial_rotary_factor (64 of 192 dimensions), written back where it
gives the model's rotary_dim."""


def _default_layer_types(num_layers: int) -> list[str]:
    return ["full_attention" if i == 0 or not (i + 1) % 6 else "sliding_attention" for i in range(num_layers)]


@register_family
class MiMoV2Flash(RoutedGqa):
    name = "mimo_v2_flash"
    architecture = "MiMoV2FlashForCausalLM"
    model_type = "mimo_v2_flash"
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "head_dim": 192,
        "v_head_dim": 128,
        "sliding_window": 129,
        "attention_value_scale": 0.707,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
    }
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False, "output_router_logits": False}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        return hf.get("layer_types") or _default_layer_types(num_layers)

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("sliding_window_size") is not None:  # the published key: the window past the query
            hf = {**hf, "sliding_window": hf["sliding_window_size"] + 1}
        fields = super().config_from_hf(hf, where)
        if fields["attention_value_dim"] and fields["attention_value_dim"] > fields["head_dim"]:
            raise ConfigError(f"{where}: v_head_dim wider than head_dim ({fields['head_dim']}) is not supported")
        return fields

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or {}
        head_dim = self.hf_value(hf, "head_dim")
        found = {}
        for kind in ("full_attention", "sliding_attention"):
            params = rope.get(kind) or {"rope_type": "default", "rope_theta": 10_000.0}
            theta, scaling = rope_from_hf({k: v for k, v in params.items() if k != "partial_rotary_factor"}, where)
            if scaling is not None:
                raise ConfigError(f"{where}: rope_parameters.{kind}: only the default RoPE is supported")
            found[kind] = theta, int(head_dim * params.get("partial_rotary_factor", ROTARY_FRACTION))
        if found["full_attention"][1] != found["sliding_attention"][1]:
            raise ConfigError(f"{where}: partial_rotary_factor must give both layer types the same rotary width")
        rotary = found["full_attention"][1]
        return {
            "rope_theta": found["full_attention"][0],
            "rope_scaling": None,
            "rope_local_theta": found["sliding_attention"][0],
            "rotary_dim": None if rotary == head_dim else rotary,
        }

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        local = [t == "sliding_attention" for t in self.layer_types(hf, layers)]
        mixed = any(local) and not all(local)
        kv = hf.get("num_key_value_heads") or hf["num_attention_heads"]
        types = hf.get("mlp_layer_types") or ["dense"] + ["sparse"] * (layers - 1)
        head_dim, value_dim = self.hf_value(hf, "head_dim"), self.hf_value(hf, "v_head_dim")
        scale = self.hf_value(hf, "attention_value_scale")
        return {
            **self.router_fields(hf),
            "num_shared_experts": 0,
            **ffn_fields([t == "sparse" for t in types]),
            "head_dim": head_dim,
            "num_kv_heads": 2 * kv if any(local) else kv,
            "global_num_kv_heads": kv if mixed else None,
            "attention_sinks": any(local),
            "local_sinks_only": mixed,
            "attention_value_dim": None if value_dim == head_dim else value_dim,
            "attention_value_scale": 1.0 if scale is None else float(scale),
            **self.mtp_fields(None, hf.get("num_nextn_predict_layers") or 0),
        }

    mtp_in_weights = True

    def mtp_fields(self, cfg: ModelConfig | None, modules: int) -> dict[str, Any]:
        return {"mtp_layers": modules, "mtp_layer_kind": {"local": True, "ffn": "mlp"} if modules else None}

    def mtp_prefix(self, cfg: ModelConfig, depth: int) -> str:
        return MTP.format(k=depth)

    def mtp_tensor_table(self, cfg: ModelConfig, per_layer: list[TensorSpec]) -> tuple[list, list]:
        if not cfg.mtp_layers:
            return [], []
        layer = cfg.mtp_layer()
        own = [*self.mixer_tensors(cfg, layer), *self.mlp_norm_tensors(), *self.dense_mlp_tensors(cfg)]
        names = {LAYER: MTP, "post_attention_layernorm": "pre_mlp_layernorm"}
        layers = []
        for spec in own:
            hf_name = spec.hf_name
            for old, new in names.items():
                hf_name = hf_name.replace(old, new)
            layers.append(dataclasses.replace(spec, stack=layer.stack, hf_name=hf_name))
        top = []
        for k, name in enumerate(cfg.mtp_head_names()):
            top += mtp_head_tensors(name, MTP.format(k=k))
        return top, layers

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = self.router_keys(cfg)
        del keys[self.shared_key]  # no shared experts: the class has no such key
        local = cfg.layer_is_local()
        kv = (
            (cfg.attention.global_num_kv_heads or cfg.attention.num_kv_heads // 2)
            if any(local)
            else cfg.attention.num_kv_heads
        )
        rotary = cfg.rope.rotary_dim or cfg.attention.head_dim
        fraction = (
            ROTARY_FRACTION
            if int(cfg.attention.head_dim * ROTARY_FRACTION) == rotary
            else rotary / cfg.attention.head_dim
        )
        thetas = {"full_attention": cfg.rope.theta, "sliding_attention": cfg.rope.local_theta or cfg.rope.theta}
        rope = {k: {**rope_parameters_to_hf(t, None), "partial_rotary_factor": fraction} for k, t in thetas.items()}
        return {
            **keys,
            "num_key_value_heads": kv,
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "mlp_layer_types": mlp_layer_types(cfg),
            "sliding_window": cfg.attention.sliding_window or self.hf_defaults["sliding_window"],
            "v_head_dim": cfg.attention.value_dim or cfg.attention.head_dim,
            "attention_value_scale": cfg.attention.value_scale,
            "rope_parameters": rope,
            **({"num_nextn_predict_layers": cfg.mtp_layers} if cfg.mtp_layers else {}),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        # transformers 4's keys: MiMoV2FlashConfig would read a rope_scaling key over rope_parameters
        del hf["rope_theta"], hf["rope_scaling"]
        return hf

    def mixer_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        sinks = [TensorSpec(("attn", "sinks_n"), LAYER + "self_attn.attention_sink_bias", None)]
        return [*super().mixer_tensors(cfg, layer), *(sinks if cfg.attention.sinks and layer.local else [])]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [spec for spec in super().mlp_tensors(cfg) if "shared" not in spec.path[-1]]

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return name.startswith("model.mtp.") and not cfg.mtp_layers  # multi-token prediction left out

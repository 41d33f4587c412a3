"""Grouped-query attention over DeepSeek-V3's mixture of experts: dots.llm1
(Dots1ForCausalLM), K-EXAONE (ExaoneMoeForCausalLM) and Solar Open (SolarOpenForCausalLM).

Each layer's experts are chosen by sigmoid scores plus a routing bias that only chooses
(e_score_correction_bias), optionally group-limited (n_group, topk_group), the chosen weights
renormalised (norm_topk_prob) and scaled (routed_scaling_factor), beside shared experts as
one gated MLP (engine/models/moe.py). What differs is the attention:

- dots.llm1: Qwen3's (RMSNorm over head_dim on queries and keys, before RoPE); a sliding
  window from layer max_window_layers on, per `layer_types`; the first first_k_dense_replace
  layers dense.
- K-EXAONE: the same QK norm; its sliding-window layers rotate and its global layers do not
  (NoPE, ModelConfig.rope.pattern) when it has a window; dense layers per mlp_layer_types.
- Solar Open: Llama's attention with biases on q, k and v (attention_bias), experts in every
  layer (its config's partial_rotary_factor is refused unless 1: transformers' class rotates
  whole heads and fails on any other).

Checkpoints store one tensor per expert (`experts.{j}.`), as transformers saves them. The
multi-token-prediction weights K-EXAONE's checkpoints carry (`mtp.*`, which transformers
skips) are skipped by conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    TensorSpec,
    layer_types_to_hf,
    qk_norm_tensors,
    register_family,
    shortest_period,
)
from engine.models.families.deepseek import routed_and_shared_experts


def ffn_fields(moe: list[bool]) -> dict[str, Any]:
    """first_dense_layers and ffn_pattern of per-layer "has experts" flags (transformers'
    mlp_layer_types): leading dense layers as first_dense_layers, any other mix as a pattern."""
    first = moe.index(True) if any(moe) else len(moe)
    if all(moe[first:]):
        return {"first_dense_layers": first, "ffn_pattern": None}
    return {"first_dense_layers": 0, "ffn_pattern": ["moe" if x else "mlp" for x in shortest_period(moe)]}


def mlp_layer_types(cfg: ModelConfig) -> list[str]:
    """transformers' mlp_layer_types of `cfg`: dense or sparse (experts) per layer."""
    return ["sparse" if layer.ffn == "moe" else "dense" for layer in cfg.layer_pattern()]


class RoutedGqa(Family):
    """The shared mapping: DeepSeek-V3's router keys (names set per family) and tensors."""

    moe = True
    fixed = {"router_score": "sigmoid", "router_bias": True}
    experts_key = "n_routed_experts"
    shared_key = "n_shared_experts"
    bias_name = "mlp.gate.e_score_correction_bias"
    """Where the family's checkpoints keep the choosing bias."""

    def router_fields(self, hf: dict) -> dict[str, Any]:
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        return {
            "num_experts": self.hf_value(hf, self.experts_key),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "num_shared_experts": self.hf_value(hf, self.shared_key),
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
            "router_groups": self.hf_value(hf, "n_group"),
            "router_group_top": self.hf_value(hf, "topk_group"),
            "router_scale": float(self.hf_value(hf, "routed_scaling_factor")),
        }

    def router_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            self.experts_key: cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            self.shared_key: cfg.moe.num_shared_experts,
            "norm_topk_prob": cfg.moe.router_renormalize,
            "n_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_group_top,
            "routed_scaling_factor": cfg.moe.router_scale,
        }

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [
            dataclasses.replace(spec, hf_name=LAYER + self.bias_name) if spec.path == ("mlp", "b_router_e") else spec
            for spec in routed_and_shared_experts()
        ]


@register_family
class Dots1(RoutedGqa):
    name = "dots1"
    architecture = "Dots1ForCausalLM"
    model_type = "dots1"
    fixed = {**RoutedGqa.fixed, "qk_norm": True}
    hf_defaults = {
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "max_window_layers": 62,
        # transformers' None cannot build: dots.llm1's
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "n_shared_experts": 2,
        "moe_intermediate_size": 1408,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 0,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
    }
    unsupported_flags = ("attention_bias",)  # biases on q, k, v and o: not in dots.llm1
    hf_constants = {"attention_bias": False, "output_router_logits": False}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        first, window = self.hf_value(hf, "max_window_layers"), self.hf_value(hf, "sliding_window")
        return [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        first = self.hf_value(hf, "first_k_dense_replace")
        return {**self.router_fields(hf), "first_dense_layers": min(first, hf["num_hidden_layers"])}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = cfg.layer_is_local()
        return {
            **self.router_keys(cfg),
            **layer_types_to_hf(cfg),
            # without a window transformers' defaults, which slide nothing past the last layer
            "sliding_window": cfg.attention.sliding_window or self.hf_defaults["sliding_window"],
            "max_window_layers": local.index(True) if any(local) else max(cfg.num_layers, 62),
            "first_k_dense_replace": cfg.moe.first_dense_layers,
        }

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        types = self.layer_types(hf, hf.get("num_hidden_layers") or 0)
        first_local = types.index("sliding_attention") if "sliding_attention" in types else len(types)
        if any(t != "sliding_attention" for t in types[first_local:]):
            raise ConfigError(
                f"{where}: layer_types must be full_attention layers then sliding_attention ones "
                f"(transformers' max_window_layers), got {types}"
            )
        return super().config_from_hf(hf, where)


@register_family
class ExaoneMoe(RoutedGqa):
    name = "exaone_moe"
    architecture = "ExaoneMoeForCausalLM"
    model_type = "exaone_moe"
    fixed = {**RoutedGqa.fixed, "qk_norm": True}
    experts_key = "num_experts"
    shared_key = "num_shared_experts"
    bias_name = "mlp.e_score_correction_bias"
    hf_defaults = {
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "sliding_window_pattern": 4,
        "first_k_dense_replace": 1,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1024,
        "num_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
    }
    unsupported_flags = ()
    hf_constants = {"output_router_logits": False}

    @staticmethod
    def _window(hf: dict) -> int | None:
        """The sliding window: transformers' 4096 when the file has no key, none when null."""
        return hf.get("sliding_window", 4096)

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        pattern = self.hf_value(hf, "sliding_window_pattern")
        if self._window(hf) is None or not pattern:
            return ["full_attention"] * num_layers
        if isinstance(pattern, str):  # "LLLG": from layer 0, repeated
            return [
                "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention" for i in range(num_layers)
            ]
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types")
        if types is None:
            first = self.hf_value(hf, "first_k_dense_replace")
            types = ["dense" if i < first else "sparse" for i in range(layers)]
        # with a window, only the sliding layers rotate (the global ones are NoPE)
        rope = [t == "sliding_attention" for t in self.layer_types(hf, layers)]
        windowed = self._window(hf) is not None
        return {
            **self.router_fields(hf),
            **ffn_fields([t == "sparse" for t in types]),
            "rope_pattern": shortest_period(rope) if windowed and not all(rope) else None,
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = cfg.layer_is_local()
        nope = any(not layer.rope for layer in cfg.layer_pattern())
        period = next(
            (p for p in range(1, cfg.num_layers + 2) if local == [(i + 1) % p != 0 for i in range(len(local))]), 0
        )
        moe = mlp_layer_types(cfg)
        return {
            **self.router_keys(cfg),
            **layer_types_to_hf(cfg),
            "sliding_window": cfg.attention.sliding_window or (4096 if nope else None),  # NoPE layers need a window
            "sliding_window_pattern": period or self.hf_defaults["sliding_window_pattern"],
            "mlp_layer_types": moe,
            "first_k_dense_replace": moe.index("sparse") if "sparse" in moe else cfg.num_layers,
        }

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        # The multi-token-prediction module published checkpoints carry (transformers skips it).
        return name.startswith("mtp.")


@register_family
class SolarOpen(RoutedGqa):
    name = "solar_open"
    architecture = "SolarOpenForCausalLM"
    model_type = "solar_open"
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1_000_000.0,
        "head_dim": 128,
        "n_routed_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1280,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
    }
    unsupported_flags = ()  # attention_bias is the q/k/v biases (qkv_bias)
    hf_constants = {"output_router_logits": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # No dense layers, so no intermediate_size: the experts' width stands in for mlp_dim.
        return super().config_from_hf({**hf, "intermediate_size": self.hf_value(hf, "moe_intermediate_size")}, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        return {
            **self.router_fields(hf),
            "head_dim": self.hf_value(hf, "head_dim"),
            "qkv_bias": bool(hf.get("attention_bias")),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["intermediate_size"]  # SolarOpenConfig has none
        return hf

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**self.router_keys(cfg), "attention_bias": cfg.attention.qkv_bias}

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        biases = [
            TensorSpec(
                ("attn", f"b{x}_{'nh' if x == 'q' else 'kh'}"), LAYER + f"self_attn.{x}_proj.bias", None, flatten=True
            )
            for x in "qkv"
        ]
        return [*super().attention_tensors(cfg), *(biases if cfg.attention.qkv_bias else [])]

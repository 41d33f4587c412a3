"""Cohere 2 with a mixture of experts (Cohere2MoeForCausalLM, Command A+).

Cohere 2's layer (engine/models/families/cohere.py: one norm feeding attention and the
feed-forward in parallel, adjacent-pair RoPE on the sliding layers only, logits times
logit_scale) with its MLP replaced by top-k of num_experts SwiGLU experts of
intermediate_size. The router takes the softmax of the k best logits (the engine's softmax
renormalised over the k), or their sigmoid, renormalised as norm_topk_prob says. Optional
shared experts form one MLP of num_shared_experts * intermediate_size, added to the routed
output (`sum`) or averaged with it (`average`: router_scale and shared_expert_scale 0.5).
The first layers may keep a dense MLP of prefix_dense_intermediate_size (mlp_layer_types
`dense`, the `dense_blocks` stack); with prefix_dense_sliding_window_pattern 1 they rotate
even when global. The norms are RMSNorms when rms_norm_eps is set, else LayerNorms without
a bias. Checkpoints store one tensor per expert (`experts.{j}.`), as transformers saves them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    TensorSpec,
    gated_mlp_tensors,
    parse_layer_types,
    register_family,
    shortest_period,
)
from engine.models.families.cohere import Cohere2
from engine.models.families.moe import _experts


@register_family
class Cohere2Moe(Cohere2):
    name = "cohere2_moe"
    architecture = "Cohere2MoeForCausalLM"
    model_type = "cohere2_moe"
    moe = True

    def layer_fields(self, hf: dict, where: str) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        dense = self._dense_layers(hf, layers, where)
        first = sum(dense)
        types = hf.get("layer_types")
        if types is None:  # transformers' rule: the prefix's pattern, then sliding_window_pattern's
            prefix, rest = hf.get("prefix_dense_sliding_window_pattern") or 1, hf.get("sliding_window_pattern") or 4
            types = [("sliding_attention" if (i + 1) % prefix else "full_attention") for i in range(first)]
            types += [("sliding_attention" if (i + 1) % rest else "full_attention") for i in range(layers - first)]
        local = parse_layer_types(types, layers, where)
        force = (hf.get("prefix_dense_sliding_window_pattern") or 1) == 1  # dense layers rotate even when global
        rope = [x or (force and i < first) for i, x in enumerate(local)]
        window = hf.get("sliding_window") or 4096
        score = hf.get("expert_selection_fn") or "softmax"
        if score not in ("softmax", "sigmoid"):
            raise ConfigError(f"{where}: expert_selection_fn must be softmax or sigmoid, got {score!r}")
        combine = hf.get("shared_expert_combination_strategy") or "average"
        if combine not in ("sum", "average"):
            raise ConfigError(f"{where}: shared_expert_combination_strategy must be sum or average, got {combine!r}")
        shared = hf.get("num_shared_experts") or 0
        average = shared > 0 and combine == "average"
        width = hf["intermediate_size"]
        if first and not hf.get("prefix_dense_intermediate_size"):
            raise ConfigError(
                f"{where}: mlp_layer_types has dense layers, so prefix_dense_intermediate_size must be set"
            )
        mlp_dim = hf["prefix_dense_intermediate_size"] if first else width
        fields: dict[str, Any] = {
            "attention_pattern": ["local" if x else "global" for x in shortest_period(local)],
            "sliding_window": window if any(local) else None,
            "rope_pattern": None if all(rope) else shortest_period(rope),
            "mlp_dim": mlp_dim,
            "num_experts": hf.get("num_experts") or 8,
            "experts_per_token": hf.get("num_experts_per_tok") or 2,
            "expert_mlp_dim": None if width == mlp_dim else width,
            "router_score": score,
            # softmax over the k best logits is the softmax renormalised over them
            "router_renormalize": score == "softmax" or bool(hf.get("norm_topk_prob", True)),
            "num_shared_experts": shared,
            "first_dense_layers": first,
            "router_scale": 0.5 if average else 1.0,
            "shared_expert_scale": 0.5 if average else 1.0,
        }
        if hf.get("rms_norm_eps") is not None:
            fields |= {"norm_kind": "rms", "norm_eps": hf["rms_norm_eps"]}
        return fields

    @staticmethod
    def _dense_layers(hf: dict, layers: int, where: str) -> list[bool]:
        kinds = hf.get("mlp_layer_types")
        if kinds is None:
            first = hf.get("first_k_dense_replace") or 0
            return [i < first for i in range(layers)]
        if len(kinds) != layers or any(k not in ("dense", "sparse") for k in kinds):
            raise ConfigError(f"{where}: mlp_layer_types must list 'dense' or 'sparse' for each of the {layers} layers")
        dense = [k == "dense" for k in kinds]
        if dense != sorted(dense, reverse=True) or all(dense):
            raise ConfigError(
                f"{where}: mlp_layer_types must be some 'dense' layers, then 'sparse' ones (the engine's "
                f"first_dense_layers), got {kinds}"
            )
        return dense

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        hf["intermediate_size"] = cfg.moe_mlp_dim
        return hf

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = super().extra_hf_keys(cfg)
        first, layers = cfg.moe.first_dense_layers, cfg.layer_pattern()
        local = cfg.layer_is_local()
        # 1 makes global dense layers rotate; another value leaves them unrotated as transformers' rule does
        unrotated = any(not x and not layer.rope for x, layer in zip(local[:first], layers[:first]))
        rms = cfg.norm.kind == "rms"
        rest = local[first:]  # the sliding_window_pattern whose rule gives the layers after the prefix, if one does
        rule = [p for p in range(1, len(rest) + 2) if rest == [bool((i + 1) % p) for i in range(len(rest))]]
        return {
            **keys,
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "num_shared_experts": cfg.moe.num_shared_experts,
            "shared_expert_combination_strategy": "average" if cfg.moe.shared_scale == 0.5 else "sum",
            "expert_selection_fn": cfg.moe.router_score,
            "norm_topk_prob": cfg.moe.router_renormalize,
            "mlp_layer_types": ["dense" if i < first else "sparse" for i in range(cfg.num_layers)],
            "prefix_dense_intermediate_size": cfg.mlp.dim if first else None,
            "prefix_dense_sliding_window_pattern": first + 1 if unrotated else 1,
            "rms_norm_eps": cfg.norm.eps if rms else None,
            "layer_norm_eps": 1e-5 if rms else cfg.norm.eps,
            "output_router_logits": False,
            "sliding_window_pattern": rule[0] if rule else 4,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        attention = [spec for spec in per_layer if not spec.path[0].startswith("mlp")]
        moe = _experts("mlp.", "gate_proj", "up_proj", "down_proj")
        if cfg.moe.num_shared_experts:
            shared = LAYER + "mlp.shared_experts."
            moe += [
                TensorSpec(("mlp", f"w_shared_{x}"), shared + f"{name}.weight", 1)
                for x, name in (("gate_dg", "gate_proj"), ("up_dg", "up_proj"), ("down_gd", "down_proj"))
            ]
        dense = [dataclasses.replace(spec, stack="dense_blocks") for spec in attention + gated_mlp_tensors()]
        stacked = [dataclasses.replace(spec, stack="blocks") for spec in attention + moe]
        return top, (dense if cfg.moe.first_dense_layers else []) + stacked

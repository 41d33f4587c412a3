"""MiniMax-M3's text decoder (MiniMaxM3VLForCausalLM, model_type minimax_m3_vl_text; the
language model of MiniMaxM3SparseForConditionalGeneration, whose vision tower is skipped).

MiniMax-M2's layers, changed: Gemma's norms (x * (1 + scale)), the QK norm per head over
head_dim (qk_norm `head`), GPT-OSS's clamped SwiGLU (swiglu_limit, swiglu_alpha) in the
experts, the shared expert and the dense MLPs, whose gate and up are one tensor
(`gate_up_proj`, gate then up; the experts' stacked (E, 2f, d) as Gemma 4's), a shared
expert of its own width (shared_intermediate_size), dense layers per `mlp_layer_types`
(dense_intermediate_size wide), and sparse attention layers (`layer_types`
minimax_m3_sparse: mixer_pattern `block_sparse`, engine/models/block_sparse.py) whose key
blocks an indexer of their own selects. RoPE rotates int(head_dim * partial_rotary_factor)
dimensions of rope_parameters, as transformers' class does (its config's `rotary_dim` key is
not read by it, and is written back as that width).

Its multi-token-prediction modules (`model.mtp.layers.{k}.*`, config.json's `num_mtp_modules`;
transformers 5.25 skips them at load, `_keys_to_ignore_on_load_unexpected`) are converted,
trained under ComputeConfig.mtp_loss and exported, as vLLM's drafter defines them
(vllm/models/minimax_m3/nvidia/mtp.py, MiniMaxM3MultiTokenPredictorLayer): DeepSeek-V3's
module (engine/models/mtp.py), Gemma norms `enorm` of the token's embedding and `hnorm` of the
hidden state, `eh_proj` of [enorm(embedding), hnorm(hidden)], then `transformer_layer`, a
block-sparse attention layer with the experts whatever the last layer is (force_sparse_attn,
force_moe) at the hidden state's positions (the drafter's; at_hidden_position), and the
module's own `final_layernorm` before the shared LM head. The layer's
tensors keep MiniMax's released names, which vLLM's loader reads and transformers' conversion
mapping renames for the decoder (`block_sparse_moe.experts.{j}.w1/w3/w2`, the shared expert's
gate_proj/up_proj/down_proj, `self_attn.index_q_proj`). The weights, not config.json, say how
many modules a checkpoint holds (a checkpoint transformers saved holds none).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    EXPERT,
    LAYER,
    Family,
    Multimodal,
    TensorSpec,
    mtp_head_tensors,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
    shortest_period,
)
from engine.models.families.routed_gqa import ffn_fields, mlp_layer_types

SPARSE = "minimax_m3_sparse"
"""transformers' layer type of the block-sparse attention layers."""

MTP = "model.mtp.layers.{k}."
"""A multi-token-prediction module's tensors (vLLM's MiniMaxM3MTP: `.mtp.layers.{idx}.`)."""

# transformers' names of a layer's tensors -> MiniMax's released ones (the inverse of
# transformers' conversion mapping for minimax_m3_vl), for the module's transformer_layer
_RELEASED = {
    "self_attn.indexer.q_proj.": "self_attn.index_q_proj.",
    "self_attn.indexer.k_proj.": "self_attn.index_k_proj.",
    "self_attn.indexer.q_norm.": "self_attn.index_q_norm.",
    "self_attn.indexer.k_norm.": "self_attn.index_k_norm.",
}


def _fused_mlp(prefix: str, gate: tuple[str, ...], up: tuple[str, ...], down: tuple[str, ...]) -> list[TensorSpec]:
    """A gated MLP whose gate and up projections are one (2f, d) tensor, gate first."""
    return [
        TensorSpec(gate, LAYER + prefix + "gate_up_proj.weight", 1, fused_with=(up,)),
        TensorSpec(down, LAYER + prefix + "down_proj.weight", 1),
    ]


@register_family
class MiniMaxM3Text(Family):
    name = "minimax_m3_vl_text"
    architecture = "MiniMaxM3VLForCausalLM"
    model_type = "minimax_m3_vl_text"
    moe = True
    fixed = {
        "qk_norm": True,
        "norm_zero_centered": True,
        "router_score": "sigmoid",
        "router_bias": True,
        "router_renormalize": True,
        "num_shared_experts": 1,
    }
    hf_defaults = {
        "max_position_embeddings": 524288,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "num_local_experts": 128,
        "num_experts_per_tok": 4,
        "routed_scaling_factor": 2.0,
        "dense_intermediate_size": 12288,
        "shared_intermediate_size": 3072,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "index_n_heads": 4,
        "index_head_dim": 128,
        "index_block_size": 128,
        "index_topk_blocks": 16,
        "index_local_blocks": 1,
    }
    multimodal = Multimodal(
        architecture="MiniMaxM3SparseForConditionalGeneration",
        model_type="minimax_m3_vl",
        prefixes=(("model.", "model.language_model."), ("lm_head.", "lm_head.")),
    )
    unsupported_flags = ()
    hf_constants = {"router_jitter_noise": 0.0, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported (only 0)")
        # the experts' width is intermediate_size, the dense layers' dense_intermediate_size
        dense = {"intermediate_size": self.hf_value(hf, "dense_intermediate_size")}
        return super().config_from_hf({**hf, **dense, "experts_width": hf["intermediate_size"]}, where)

    def activation_from_hf(self, hf: dict) -> str:
        return "silu"  # transformers normalises the published "swigluoai": the clamp is swiglu_limit's

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(hf.get("rope_parameters") or {"rope_theta": 5_000_000.0, "rope_type": "default"})
        rope.pop("partial_rotary_factor", None)  # rotary_dim, below
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        factor = float((hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
        rotary = int(head_dim * factor)
        types = hf.get("layer_types") or ["full_attention"] * layers
        unknown = sorted(set(types) - {"full_attention", SPARSE})
        if unknown:
            raise ConfigError(f"config.json ({self.architecture}): layer_types {unknown} are not supported")
        sparse = [t == SPARSE for t in types]
        mlp = hf.get("mlp_layer_types") or ["sparse"] * layers
        dense, experts = hf["intermediate_size"], hf["experts_width"]
        shared = self.hf_value(hf, "shared_intermediate_size")
        indexer = None
        if any(sparse):
            indexer = {
                "heads": self.hf_value(hf, "index_n_heads"),
                "head_dim": self.hf_value(hf, "index_head_dim"),
                "block": self.hf_value(hf, "index_block_size"),
                "topk_blocks": self.hf_value(hf, "index_topk_blocks"),
                "local_blocks": self.hf_value(hf, "index_local_blocks"),
            }
        return {
            "rotary_dim": None if rotary == head_dim else rotary,
            "num_experts": self.hf_value(hf, "num_local_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if experts == dense else experts,
            "shared_expert_mlp_dim": None if shared == experts else shared,
            "router_scale": float(self.hf_value(hf, "routed_scaling_factor")),
            "swiglu_limit": float(self.hf_value(hf, "swiglu_limit")),
            "swiglu_alpha": float(self.hf_value(hf, "swiglu_alpha")),
            **ffn_fields([t == "sparse" for t in mlp]),
            "mixer_pattern": ["block_sparse" if x else "attention" for x in shortest_period(sparse)]
            if any(sparse)
            else None,
            "block_indexer": indexer,
            **self.mtp_fields(None, hf.get("num_mtp_modules") or 0, any(sparse)),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["rope_theta"], hf["rope_scaling"]  # the class reads rope_parameters only
        return hf

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        rope = rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling)
        if cfg.rope.rotary_dim is not None:
            rope["partial_rotary_factor"] = cfg.rope.rotary_dim / cfg.attention.head_dim
        indexer = cfg.block_indexer
        index = {}
        if indexer is not None:
            index = {
                "index_n_heads": indexer.heads,
                "index_head_dim": indexer.head_dim,
                "index_block_size": indexer.block,
                "index_topk_blocks": indexer.topk_blocks,
                "index_local_blocks": indexer.local_blocks,
            }
        return {
            "intermediate_size": cfg.moe_mlp_dim,
            "dense_intermediate_size": cfg.mlp.dim,
            "shared_intermediate_size": cfg.shared_mlp_dim,
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "routed_scaling_factor": cfg.moe.router_scale,
            "swiglu_limit": cfg.moe.swiglu_limit,
            "swiglu_alpha": cfg.moe.swiglu_alpha,
            "rotary_dim": cfg.rope.rotary_dim or cfg.attention.head_dim,
            "rope_parameters": rope,
            "layer_types": [SPARSE if x.mixer == "block_sparse" else "full_attention" for x in cfg.layer_pattern()],
            "mlp_layer_types": mlp_layer_types(cfg),
            **index,
            **({"num_mtp_modules": cfg.mtp_layers} if cfg.mtp_layers else {}),
        }

    def mixer_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        tensors = [*self.attention_tensors(cfg), *qk_norm_tensors()]
        if layer.mixer == "block_sparse":
            indexer = LAYER + "self_attn.indexer."
            tensors += [
                TensorSpec(("attn", "indexer", "wq_dgi"), indexer + "q_proj.weight", 1),
                TensorSpec(("attn", "indexer", "wk_di"), indexer + "k_proj.weight", 1),
                TensorSpec(("attn", "indexer", "q_norm", "scale"), indexer + "q_norm.weight", None),
                TensorSpec(("attn", "indexer", "k_norm", "scale"), indexer + "k_norm.weight", None),
            ]
        return tensors

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        experts = LAYER + "mlp.experts."
        return [
            TensorSpec(("mlp", "w_router_de"), LAYER + "mlp.gate.weight", 1),
            TensorSpec(("mlp", "b_router_e"), LAYER + "mlp.gate.e_score_correction_bias", None),
            TensorSpec(
                ("mlp", "w_gate_edf"),
                experts + "gate_up_proj",
                None,
                concatenated_with=(("mlp", "w_up_edf"),),
                swap_last=True,
            ),
            TensorSpec(("mlp", "w_down_efd"), experts + "down_proj", None, swap_last=True),
            *_fused_mlp("mlp.shared_experts.", *(("mlp", f"w_shared_{x}") for x in ("gate_dg", "up_dg", "down_gd"))),
        ]

    def dense_mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return _fused_mlp("mlp.", ("mlp", "w_gate_df"), ("mlp", "w_up_df"), ("mlp", "w_down_fd"))

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        # multi-token-prediction tensors where conversion keeps no module (a VL checkpoint's; mtp_prefix)
        return (".mtp." in name or name.startswith("mtp.")) and not cfg.mtp_layers

    mtp_in_weights = True

    def mtp_prefix(self, cfg: ModelConfig, depth: int) -> str:
        return MTP.format(k=depth)

    def mtp_fields(self, cfg: ModelConfig | None, modules: int, sparse: bool | None = None) -> dict[str, Any]:
        if sparse is None:
            sparse = cfg is not None and "block_sparse" in (cfg.mixer_pattern or [])
        if modules and not sparse:
            raise ConfigError(
                f"config.json ({self.architecture}): {modules} multi-token-prediction module(s), whose layer "
                "is block-sparse attention, need a minimax_m3_sparse layer in layer_types (its indexer's sizes)"
            )
        kind = {"local": False, "ffn": "moe", "mixer": "block_sparse", "at_hidden_position": True}
        return {"mtp_layers": modules, "mtp_layer_kind": kind if modules else None}

    def mtp_tensor_table(self, cfg: ModelConfig, per_layer: list[TensorSpec]) -> tuple[list, list]:
        if not cfg.mtp_layers:
            return [], []
        layer = cfg.mtp_layer()
        block = MTP + "transformer_layer."
        released = [*self.mixer_tensors(cfg, layer), *self.mlp_norm_tensors()]
        layers = []
        for spec in released:
            hf_name = spec.hf_name.replace(LAYER, block)
            for old, new in _RELEASED.items():
                hf_name = hf_name.replace(old, new)
            layers.append(dataclasses.replace(spec, stack=layer.stack, hf_name=hf_name))
        moe, shared = block + "block_sparse_moe.", block + "block_sparse_moe.shared_experts."
        layers += [
            TensorSpec(("mlp", "w_router_de"), moe + "gate.weight", 1),
            TensorSpec(("mlp", "b_router_e"), moe + "e_score_correction_bias", None),
            TensorSpec(("mlp", "w_gate_edf"), moe + EXPERT + "w1.weight", 1, experts=True),
            TensorSpec(("mlp", "w_up_edf"), moe + EXPERT + "w3.weight", 1, experts=True),
            TensorSpec(("mlp", "w_down_efd"), moe + EXPERT + "w2.weight", 1, experts=True),
            TensorSpec(("mlp", "w_shared_gate_dg"), shared + "gate_proj.weight", 1),
            TensorSpec(("mlp", "w_shared_up_dg"), shared + "up_proj.weight", 1),
            TensorSpec(("mlp", "w_shared_down_gd"), shared + "down_proj.weight", 1),
        ]
        layers = [dataclasses.replace(spec, stack=layer.stack) for spec in layers]
        top = []
        for k, name in enumerate(cfg.mtp_head_names()):
            top += mtp_head_tensors(name, MTP.format(k=k))
        return top, layers

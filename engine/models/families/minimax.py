"""MiniMax-M2 (MiniMaxM2ForCausalLM, model_type minimax_m2).

Grouped-query attention whose QK norm is one RMSNorm over all heads' dimensions of the
projected queries (keys), as OLMo 2's (qk_norm_across_heads: HF's (heads * head_dim,)
scales), with RoPE on the first `rotary_dim` dimensions of each head (ModelConfig.rope.rotary_dim;
transformers 5 reads the published `rotary_dim` as partial_rotary_factor). Every layer is a
mixture of experts as wide as intermediate_size, Mixtral's names (`block_sparse_moe.`,
`experts.{j}.w1/w3/w2`), routed as DeepSeek-V3 is without groups or shared experts: sigmoid
scores, a bias that only chooses (e_score_correction_bias), the k weights renormalised.

The published config.json also carries MiniMax's own keys (use_qk_norm, scoring_func,
use_routing_bias, shared_intermediate_size, ...) that transformers' class ignores: the
values it hard-codes are read, anything else is refused.

Its multi-token-prediction modules (config.json's `use_mtp`, `num_mtp_modules`; the published
checkpoints, M2 to M2.7, hold no weights of them) have no modeling in transformers 5.25 nor in
MiniMax's repositories; SGLang's drafter (python/sglang/srt/models/minimax_m2_nextn.py,
MiniMaxM2ForCausalLMNextN) defines them, and so they are read here: `model.mtp_layers.{k}.`
holds `h_norm`, `e_norm`, `linear_projection` of [h_norm(hidden), e_norm(embedding)]
(mtp_layer_kind.hidden_first) and a decoder layer under the decoder's names; the output norm
is the model's own `model.norm` (shared_final_norm) before the shared LM head. They are
converted (counted in the weights), trained under ComputeConfig.mtp_loss and exported. The
tensors vLLM's and SGLang's decoders skip as speculative layers, model.layers.{num_hidden_layers
+ i}., are not that layout (no upstream code defines what they hold; a third-party vLLM plugin
reads them as DeepSeek-V3's): conversion skips them with a message.
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
    TensorSpec,
    mtp_head_tensors,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)

MTP = "model.mtp_layers.{k}."
"""A multi-token-prediction module's tensors (SGLang's MiniMaxM2ForCausalLMNextN loader)."""

# MiniMax's keys transformers' MiniMaxM2ForCausalLM ignores, and the value its math has.
_HARD_CODED = {
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "shared_intermediate_size": 0,
}


@register_family
class MiniMaxM2(Family):
    name = "minimax_m2"
    architecture = "MiniMaxM2ForCausalLM"
    model_type = "minimax_m2"
    moe = True
    fixed = {
        "qk_norm": True,
        "qk_norm_across_heads": True,
        "router_score": "sigmoid",
        "router_bias": True,
        "router_renormalize": True,
    }
    hf_defaults = {
        "max_position_embeddings": 196608,
        "tie_word_embeddings": False,
        "rope_theta": 5_000_000.0,
        "rms_norm_eps": 1e-6,
        "num_local_experts": 256,
        "num_experts_per_tok": 8,
    }
    unsupported_flags = ()
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {"router_jitter_noise": 0.0, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported (only 0)")
        for key, value in _HARD_CODED.items():
            if hf.get(key) is not None and hf[key] != value:
                raise ConfigError(
                    f"{where}: {key}={hf[key]!r} is not supported ({self.architecture} runs {key}={value!r})"
                )
        return super().config_from_hf(hf, where)

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """Speculative layers after the decoder's (vLLM's name for them), and modules in
        SGLang's layout where conversion keeps none."""
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        return (layer.isdigit() and int(layer) >= cfg.num_layers) or (
            name.startswith("model.mtp_layers.") and not cfg.mtp_layers
        )

    mtp_in_weights = True

    def mtp_prefix(self, cfg: ModelConfig, depth: int) -> str:
        return MTP.format(k=depth)

    def mtp_fields(self, cfg: ModelConfig | None, modules: int) -> dict[str, Any]:
        kind = {"local": False, "ffn": "moe", "hidden_first": True, "shared_final_norm": True}
        return {"mtp_layers": modules, "mtp_layer_kind": kind if modules else None}

    def mtp_tensor_table(self, cfg: ModelConfig, per_layer: list[TensorSpec]) -> tuple[list, list]:
        if not cfg.mtp_layers:
            return [], []
        stack = cfg.layer_pattern()[-1].stack  # every layer is the same: the decoder's names
        layers = [
            dataclasses.replace(spec, stack="mtp_blocks", hf_name=spec.hf_name.replace(LAYER, MTP))
            for spec in per_layer
            if spec.stack == stack
        ]
        top = []
        for k, name in enumerate(cfg.mtp_head_names()):  # MiniMax-M2's names; the head's norm is the model's
            top += mtp_head_tensors(name, MTP.format(k=k), ("e_norm", "h_norm"), "linear_projection", post_norm=None)
        return top, layers

    def _rotary_dim(self, hf: dict) -> int:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor")
        if factor is None and hf.get("rotary_dim") is not None:
            return int(hf["rotary_dim"])
        return int(head_dim * float(factor or hf.get("partial_rotary_factor") or 1.0))

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta"), **(hf.get("rope_scaling") or {})}
        )
        rope.pop("partial_rotary_factor", None)  # rotary_dim, below
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = self._rotary_dim(hf)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ConfigError(
                f"config.json ({self.architecture}): rotary_dim {rotary} of head_dim {head_dim} "
                "must be even and at most head_dim"
            )
        modules = (hf.get("num_mtp_modules") or 0) if hf.get("use_mtp", True) else 0
        if modules and (hf.get("mtp_transformer_layers") or 1) != 1:
            raise ConfigError(
                f"config.json ({self.architecture}): mtp_transformer_layers={hf['mtp_transformer_layers']} is not "
                "supported (a multi-token-prediction module of one layer, as SGLang's drafter builds)"
            )
        return {
            "rotary_dim": None if rotary == head_dim else rotary,
            "num_experts": self.hf_value(hf, "num_local_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            **self.mtp_fields(None, modules),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        rope = rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling)
        keys: dict[str, Any] = {
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "rope_parameters": rope,
            # the published checkpoints' router keys (their config.json, MiniMax's code): vLLM's
            # MiniMax-M2 reads them (without them it cannot build the router, nor load its
            # e_score_correction_bias); transformers ignores them
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
        }
        if cfg.mtp_layers:  # the published keys of the modules
            keys.update(use_mtp=True, num_mtp_modules=cfg.mtp_layers, mtp_transformer_layers=1)
        if cfg.rope.rotary_dim is not None:  # as transformers writes it, and the published key
            rope["partial_rotary_factor"] = cfg.rope.rotary_dim / cfg.attention.head_dim
            keys["rotary_dim"] = cfg.rope.rotary_dim
        return keys

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors(flatten=True)

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        moe, expert = LAYER + "block_sparse_moe.", LAYER + "block_sparse_moe." + EXPERT
        return [
            TensorSpec(("mlp", "w_router_de"), moe + "gate.weight", 1),
            TensorSpec(("mlp", "b_router_e"), moe + "e_score_correction_bias", None),
            TensorSpec(("mlp", "w_gate_edf"), expert + "w1.weight", 1, experts=True),
            TensorSpec(("mlp", "w_up_edf"), expert + "w3.weight", 1, experts=True),
            TensorSpec(("mlp", "w_down_efd"), expert + "w2.weight", 1, experts=True),
        ]

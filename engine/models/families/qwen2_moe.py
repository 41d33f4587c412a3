"""Qwen1.5-MoE and Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (q, k, v biases as
qkv_bias says) with a softmax top-k mixture of experts of moe_intermediate_size plus one
shared expert of shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate(x)),
Qwen3-Next's shared expert (ModelConfig.moe.shared_gate). A layer may keep a dense MLP of
intermediate_size instead (mlp_only_layers, decoder_sparse_step: the `dense_blocks` stack).
Checkpoints store one tensor per expert (`experts.{j}.`), as transformers saves them.

Sliding windows follow transformers' Qwen2-MoE rule when config.json has no layer_types:
with use_sliding_window, layer i slides when i is even and below max_window_layers.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, register_family, shortest_period
from engine.models.families.moe import Qwen3Moe
from engine.models.families.qwen3_next import _experts_with_shared


def _window_rule(num_layers: int, max_window_layers: int) -> list[bool]:
    """transformers' Qwen2MoeConfig: layer i slides iff (i + 1) % 2 and i < max_window_layers."""
    return [bool((i + 1) % 2) and i < max_window_layers for i in range(num_layers)]


@register_family
class Qwen2Moe(Family):
    name = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    model_type = "qwen2_moe"
    moe = True
    fixed = {"router_score": "softmax", "num_shared_experts": 1, "shared_expert_gate": True}
    hf_defaults = {
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "sliding_window": 4096,
        "max_window_layers": 28,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "qkv_bias": True,
    }
    unsupported_flags = ()  # Qwen2MoeConfig has no bias flags but qkv_bias, which the engine runs
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {"output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("num_hidden_layers") is None:
            return super().config_from_hf(hf, where)  # which names the missing key
        step = self.hf_value(hf, "decoder_sparse_step")
        if not isinstance(step, int) or step < 1:
            raise ConfigError(f"{where}: decoder_sparse_step must be a whole number >= 1, got {step!r}")
        dense, layers = hf.get("mlp_only_layers") or [], hf["num_hidden_layers"]
        if any(not isinstance(i, int) or not 0 <= i < layers for i in dense):
            raise ConfigError(f"{where}: mlp_only_layers must list layers in [0, {layers}), got {dense}")
        if not self.hf_value(hf, "num_experts") or not any(Qwen3Moe.moe_layers(hf, layers, step)):
            raise ConfigError(
                f"{where}: no layer has experts (num_experts, decoder_sparse_step, mlp_only_layers); "
                "a dense Qwen2 model is family qwen2"
            )
        if not self.hf_value(hf, "shared_expert_intermediate_size"):
            raise ConfigError(f"{where}: shared_expert_intermediate_size must be > 0 (the shared expert's width)")
        fields = super().config_from_hf(hf, where)
        if "local" in fields["attention_pattern"] and not fields["sliding_window"]:
            raise ConfigError(f"{where}: layer_types has sliding_attention layers, so sliding_window must be > 0")
        return fields

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        if hf.get("layer_types") is not None:
            return hf["layer_types"]
        local = _window_rule(num_layers, self.hf_value(hf, "max_window_layers")) if hf.get("use_sliding_window") else []
        return ["sliding_attention" if i < len(local) and local[i] else "full_attention" for i in range(num_layers)]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        moe = Qwen3Moe.moe_layers(hf, layers, self.hf_value(hf, "decoder_sparse_step"))
        expert_mlp_dim = self.hf_value(hf, "moe_intermediate_size")
        shared = self.hf_value(hf, "shared_expert_intermediate_size")
        return {
            "qkv_bias": bool(self.hf_value(hf, "qkv_bias")),
            "ffn_pattern": None if all(moe) else ["moe" if x else "mlp" for x in shortest_period(moe)],
            "num_experts": self.hf_value(hf, "num_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": None if expert_mlp_dim == hf["intermediate_size"] else expert_mlp_dim,
            "shared_expert_mlp_dim": None if shared == expert_mlp_dim else shared,
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        local = cfg.layer_is_local()
        moe = [layer.ffn == "moe" for layer in cfg.layer_pattern()]
        step = next((s for s in range(1, cfg.num_layers + 1) if moe == Qwen3Moe.moe_layers({}, cfg.num_layers, s)), 1)
        # the max_window_layers whose rule gives this window pattern, if one does (else transformers' default)
        default = self.hf_defaults["max_window_layers"]
        first = next((m for m in range(cfg.num_layers + 1) if _window_rule(cfg.num_layers, m) == local), default)
        return {
            "layer_types": ["sliding_attention" if x else "full_attention" for x in local],
            "use_sliding_window": any(local),
            "sliding_window": cfg.attention.sliding_window
            if any(local)
            else 0,  # transformers writes 0 without a window
            "max_window_layers": first if any(local) else default,
            "qkv_bias": cfg.attention.qkv_bias,
            "decoder_sparse_step": step,
            "mlp_only_layers": [i for i, x in enumerate(moe) if not x and (i + 1) % step == 0],
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "shared_expert_intermediate_size": cfg.shared_mlp_dim,
            "norm_topk_prob": cfg.moe.router_renormalize,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        biases = [
            TensorSpec(
                ("attn", f"b{x}_{'nh' if x == 'q' else 'kh'}"), LAYER + f"self_attn.{x}_proj.bias", None, flatten=True
            )
            for x in "qkv"
        ]
        return [*super().attention_tensors(cfg), *(biases if cfg.attention.qkv_bias else [])]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return _experts_with_shared()

"""Llama 4 text (Llama4ForCausalLM, model_type llama4_text; Scout 17B-16E, Maverick 17B-128E).

Per layer (transformers' modeling_llama4.py):

- attention: RoPE on adjacent pairs (`rope_interleave`; the checkpoints are not permuted), on
  the layers `no_rope_layers` marks 1 (every fourth layer is NoPE by default), those layers
  attending within chunks of `attention_chunk_size` positions (`layer_types`
  chunked_attention: attention_pattern `chunked`) and normalising queries and keys by their
  RMS after RoPE, without a scale (`use_qk_norm`: qk_l2_norm); the NoPE layers attend
  globally and scale their queries by 1 + attn_scale * log(1 + floor((p + 1) / floor_scale))
  (`attn_temperature_tuning`);
- feed-forward: a mixture of experts on the layers `moe_layers` lists (every
  `interleave_moe_layer_step`-th; ffn_pattern), a dense MLP of `intermediate_size_mlp` on
  the others (`dense_blocks`). The router scores the top-k logits by a sigmoid, unnormalised,
  and each score multiplies its expert's input, not its output (router_scales_input); a
  shared expert as wide as an expert (`intermediate_size`) takes every token.

The experts are stored as stacked tensors: `gate_up_proj` (E, d, 2f), gate then up along its
last axis (TensorSpec.concatenated_with), and `down_proj` (E, f, d), both (in, out) already.
The published checkpoints are the multimodal Llama4ForConditionalGeneration (model_type
llama4): conversion reads their text decoder (`language_model.`) and skips the vision tower.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    Multimodal,
    TensorSpec,
    gated_mlp_tensors,
    register_family,
    shortest_period,
)


@register_family
class Llama4(Family):
    name = "llama4"
    architecture = "Llama4ForCausalLM"
    model_type = "llama4_text"
    moe = True
    fixed = {
        "rope_interleave": True,
        "router_score": "sigmoid",
        "router_renormalize": False,
        "router_scales_input": True,
        "num_shared_experts": 1,
    }
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "intermediate_size_mlp": 16384,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 1,
        "use_qk_norm": True,
        "no_rope_layer_interval": 4,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
    }
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {
        "attention_bias": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
    }
    multimodal = Multimodal(
        architecture="Llama4ForConditionalGeneration",
        model_type="llama4",
        prefixes=(("model.", "language_model.model."), ("lm_head.", "language_model.lm_head.")),
    )

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("router_jitter_noise"):
            raise ConfigError(f"{where}: router_jitter_noise={hf['router_jitter_noise']} is not supported (only 0)")
        layers = hf.get("num_hidden_layers")
        for key in ("no_rope_layers", "layer_types"):
            if hf.get(key) and isinstance(layers, int) and len(hf[key]) != layers:
                raise ConfigError(f"{where}: {key} has {len(hf[key])} entries for {layers} layers")
        moe = hf.get("moe_layers")
        if moe is not None and any(not isinstance(i, int) or not 0 <= i < (layers or 0) for i in moe):
            raise ConfigError(f"{where}: moe_layers must list layers in [0, {layers}), got {moe}")
        unknown = sorted(set(hf.get("layer_types") or []) - {"chunked_attention", "full_attention"})
        if unknown:
            raise ConfigError(
                f"{where}: layer type '{unknown[0]}' is not supported (chunked_attention, full_attention)"
            )
        return super().config_from_hf(hf, where)

    @staticmethod
    def rope_layers(hf: dict, num_layers: int, interval: int) -> list[bool]:
        """Per layer: RoPE? transformers' no_rope_layers (1: RoPE), or its interval rule."""
        flags = hf.get("no_rope_layers")
        if flags:
            return [bool(x) for x in flags]
        return [(i + 1) % interval != 0 for i in range(num_layers)]

    @staticmethod
    def moe_layers(hf: dict, num_layers: int, step: int) -> list[bool]:
        """Per layer: experts? transformers' moe_layers, or every step-th layer from step - 1."""
        listed = hf.get("moe_layers")
        chosen = set(listed) if listed is not None else set(range(step - 1, num_layers, step))
        return [i in chosen for i in range(num_layers)]

    def chunked_layers(self, hf: dict, rope: list[bool]) -> list[bool]:
        """Per layer: chunked attention? layer_types, or transformers' rule (the RoPE layers,
        when attention_chunk_size is set: 8192 unless config.json says null)."""
        if hf.get("layer_types"):
            return [t == "chunked_attention" for t in hf["layer_types"]]
        chunk = hf.get("attention_chunk_size", 8192)
        return [x and chunk is not None for x in rope]

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        return ["full_attention"] * num_layers  # no sliding window; the chunked layers are extra_fields_from_hf's

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        n = hf["num_hidden_layers"]
        rope = self.rope_layers(hf, n, self.hf_value(hf, "no_rope_layer_interval"))
        moe = self.moe_layers(hf, n, self.hf_value(hf, "interleave_moe_layer_step"))
        chunked = self.chunked_layers(hf, rope)
        mlp_dim, expert_mlp_dim = self.hf_value(hf, "intermediate_size_mlp"), hf["intermediate_size"]
        tuning = bool(self.hf_value(hf, "attn_temperature_tuning"))
        return {
            "mlp_dim": mlp_dim,
            "expert_mlp_dim": None if expert_mlp_dim == mlp_dim else expert_mlp_dim,
            "num_experts": self.hf_value(hf, "num_local_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "ffn_pattern": None if all(moe) else ["moe" if x else "mlp" for x in shortest_period(moe)],
            "rope_pattern": None if all(rope) else shortest_period(rope),
            "attention_pattern": ["chunked" if x else "global" for x in shortest_period(chunked)],
            "attention_chunk_size": hf.get("attention_chunk_size", 8192) if any(chunked) else None,
            "qk_l2_norm": bool(self.hf_value(hf, "use_qk_norm")),
            "attn_temperature_floor": self.hf_value(hf, "floor_scale") if tuning else None,
            "attn_temperature_scale": float(self.hf_value(hf, "attn_scale")),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        n = cfg.num_layers
        layers = cfg.layer_pattern()
        rope = [layer.rope for layer in layers]
        moe = [layer.ffn == "moe" for layer in layers]
        # the interval / step that give these layers, where one does (as transformers writes both)
        interval = next((k for k in range(2, n + 2) if rope == self.rope_layers({}, n, k)), None)
        step = next((k for k in range(1, n + 1) if moe == self.moe_layers({}, n, k)), None)
        return {
            "intermediate_size": cfg.moe_mlp_dim,
            "intermediate_size_mlp": cfg.mlp.dim,
            "num_local_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_layers": [i for i, x in enumerate(moe) if x],
            "interleave_moe_layer_step": step or self.hf_defaults["interleave_moe_layer_step"],
            "no_rope_layers": [int(x) for x in rope],
            "no_rope_layer_interval": interval or self.hf_defaults["no_rope_layer_interval"],
            "layer_types": ["chunked_attention" if layer.chunked else "full_attention" for layer in layers],
            "attention_chunk_size": cfg.attention.chunk_size,
            "use_qk_norm": cfg.attention.qk_l2_norm,
            "attn_temperature_tuning": cfg.attention.temperature_floor is not None,
            "floor_scale": cfg.attention.temperature_floor or self.hf_defaults["floor_scale"],
            "attn_scale": cfg.attention.temperature_scale,
        }

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        ff = LAYER + "feed_forward."
        return [
            TensorSpec(("mlp", "w_router_de"), ff + "router.weight", 1),
            TensorSpec(
                ("mlp", "w_gate_edf"), ff + "experts.gate_up_proj", None, concatenated_with=(("mlp", "w_up_edf"),)
            ),
            TensorSpec(("mlp", "w_down_efd"), ff + "experts.down_proj", None),
            TensorSpec(("mlp", "w_shared_gate_dg"), ff + "shared_expert.gate_proj.weight", 1),
            TensorSpec(("mlp", "w_shared_up_dg"), ff + "shared_expert.up_proj.weight", 1),
            TensorSpec(("mlp", "w_shared_down_gd"), ff + "shared_expert.down_proj.weight", 1),
        ]

    def dense_mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return gated_mlp_tensors("feed_forward.")

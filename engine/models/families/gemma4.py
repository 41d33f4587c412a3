"""Gemma 4 text (Gemma4ForCausalLM, model_type gemma4_text): the dense models (31B) and the
mixture of experts (26B-A4B).

Gemma 3's block (GeGLU, a norm before and after each sublayer, QK-norm, five sliding layers
per global one, logits soft-capped, embeddings scaled by sqrt(d_model)) with:

- norms that multiply by their scale (not 1 + scale), and attention unscaled (scaling 1.0:
  the QK norms set the logits' size);
- an RMSNorm without a scale on the values (`value_norm`), and a learned scalar per layer
  multiplying the residual stream after it (`layer_scale`, HF's `layer_scalar` buffer);
- global layers with heads of their own shape (`global_head_dim`, and with
  `attention_k_eq_v` `global_num_kv_heads` and no v_proj: the values are the key
  projection), so they form a stack of their own, `global_blocks`;
- per-layer-type RoPE: the sliding layers' plain RoPE (rope_local_theta), the global ones'
  `proportional` RoPE, whose frequencies are a whole head's with only the fastest quarter
  kept (RopeScaling kind proportional).

The mixture of experts (`enable_moe_block`) keeps the dense MLP and runs 128 experts beside
it (`moe_beside_mlp`), the router reading the residual through a scale-free norm, a learned
scale and d**-0.5 (`router_input_norm`), its renormalised top-k weights times a learned
factor per expert (`router_expert_scale`); its experts are stored stacked, gate and up in
one (E, 2f, d) tensor (TensorSpec.swap_last).

The small models (E2B, E4B) add per-layer embeddings (`hidden_size_per_layer_input`:
ModelConfig.embedding.per_layer_input_dim; a second embedding table of num_layers * p columns, a
projection of the first embedding beside it, and in each layer a gate, a projection and a
norm, all in the model's blocks) and KV sharing (`num_kv_shared_layers`: the last layers have
no k/v projections or k norm and attend with the keys and values of the last earlier layer of
their type, Layer.kv_sharing; E2B's such layers have a double-wide MLP, `use_double_wide_mlp`).
Their multimodal checkpoints also hold an audio tower, skipped with the vision tower.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    Multimodal,
    TensorSpec,
    layer_types_to_hf,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)

DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
"""transformers' RoPE of each layer type when config.json gives none."""
PER_LAYER_VOCAB = 262_144
"""transformers' vocab_size_per_layer_input, written as it is where a model has no per-layer embeddings."""


@register_family
class Gemma4(Family):
    name = "gemma4"
    architecture = "Gemma4ForCausalLM"
    model_type = "gemma4_text"
    fixed = {
        "scale_embeddings": True,
        "post_norms": True,
        "qk_norm": True,
        "value_norm": True,
        "layer_scale": True,
        "query_pre_attn_scalar": 1.0,  # transformers' scaling = 1.0
    }
    hf_defaults = {
        "max_position_embeddings": 131_072,
        "tie_word_embeddings": True,
        "sliding_window": 512,
        "global_head_dim": 512,
        "hidden_size_per_layer_input": 256,
    }
    activation_key = "hidden_activation"
    moe = None  # dense models (31B) and a mixture of experts (26B-A4B)
    multimodal = Multimodal(  # the checkpoints Google publishes: the decoder read, the vision tower skipped
        architecture="Gemma4ForConditionalGeneration",
        model_type="gemma4",
        prefixes=(("model.", "model.language_model."), ("lm_head.", "lm_head.")),
    )
    unsupported_flags = ("attention_bias",)
    hf_constants = {
        "attention_bias": False,
        "use_bidirectional_attention": None,
        "enable_moe_block": False,
        "num_experts": None,
        "top_k_experts": None,
        "moe_intermediate_size": None,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        per_layer_vocab = self.hf_value(hf, "vocab_size_per_layer_input", PER_LAYER_VOCAB)
        if self.hf_value(hf, "hidden_size_per_layer_input") and per_layer_vocab != hf.get("vocab_size"):
            raise ConfigError(
                f"{where}: vocab_size_per_layer_input={per_layer_vocab} differs from vocab_size="
                f"{hf.get('vocab_size')} (per-layer embeddings of another vocabulary are not supported)"
            )
        if hf.get("use_bidirectional_attention") == "all":
            raise ConfigError(f"{where}: use_bidirectional_attention='all' is not supported (a causal decoder)")
        return super().config_from_hf(hf, where)

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)
        ]
        return [*types[:-1], "full_attention"]  # transformers forces the last layer global

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or DEFAULT_ROPE
        global_rope: dict[str, Any] = rope.get("full_attention") or {}
        local_rope: dict[str, Any] = rope.get("sliding_attention") or {}
        local_theta, local_scaling = rope_from_hf({"rope_theta": 10_000.0, **local_rope}, where)
        if local_scaling is not None:
            raise ConfigError(f"{where}: RoPE scaling of sliding-window layers is not supported")
        scaling: dict[str, Any] | None
        if global_rope.get("rope_type") == "proportional":
            scaling = {
                "kind": "proportional",
                "factor": global_rope.get("factor", 1.0),
                "rotated_fraction": global_rope.get("partial_rotary_factor", 1.0),
            }
            theta = float(global_rope.get("rope_theta", 10_000.0))
        else:  # transformers' default RoPE of Gemma 4 rotates the whole head whatever the factor
            plain = {k: v for k, v in global_rope.items() if k != "partial_rotary_factor"}
            theta, scaling = rope_from_hf({"rope_theta": 10_000.0, **plain}, where)
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        where = "config.json"
        types = self.layer_types(hf, hf["num_hidden_layers"])
        k_eq_v = bool(hf.get("attention_k_eq_v"))
        overrides = hf.get("per_layer_config")
        if overrides is None:  # the published checkpoints' keys (transformers 5.25 writes per_layer_config)
            head_dim = self.hf_value(hf, "global_head_dim")
            kv_heads = hf.get("num_global_key_value_heads") if k_eq_v else None
        else:
            global_layers = {i for i, t in enumerate(types) if t == "full_attention"}
            found = {int(i): dict(o) for i, o in overrides.items()}
            shapes = {tuple(sorted(o.items())) for o in found.values()}
            unknown = sorted({k for o in found.values() for k in o} - {"head_dim", "num_key_value_heads"})
            if set(found) != global_layers or len(shapes) != 1 or unknown:
                raise ConfigError(
                    f"{where}: per_layer_config must give every full_attention layer, and only those, "
                    "the same head_dim (and num_key_value_heads)"
                )
            one = next(iter(found.values()))
            head_dim, kv_heads = one.get("head_dim"), one.get("num_key_value_heads")
        base_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
        experts = {}
        if hf.get("enable_moe_block"):
            experts = {
                "num_experts": hf["num_experts"],
                "experts_per_token": hf["top_k_experts"],
                "expert_mlp_dim": hf["moe_intermediate_size"],
                "moe_beside_mlp": True,
                "router_input_norm": True,
                "router_expert_scale": True,
            }
        shared = hf.get("num_kv_shared_layers") or 0
        return {
            **experts,
            "per_layer_input_dim": self.hf_value(hf, "hidden_size_per_layer_input") or None,
            "kv_shared_layers": shared,
            "kv_shared_wide_mlp": bool(shared and hf.get("use_double_wide_mlp")),
            "final_logit_softcap": hf.get("final_logit_softcapping"),
            "global_head_dim": None if head_dim in (None, hf.get("head_dim")) else head_dim,
            "global_num_kv_heads": None if kv_heads in (None, base_heads) else kv_heads,
            "global_values_from_keys": k_eq_v,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["rope_theta"], hf["rope_scaling"]  # transformers 4 has no Gemma 4: no older RoPE keys
        return hf

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        global_rope = rope_parameters_to_hf(cfg.rope.theta, None)
        if cfg.rope.scaling is not None and cfg.rope.scaling.kind == "proportional":
            global_rope = {"rope_type": "proportional", "partial_rotary_factor": cfg.rope.scaling.rotated_fraction}
            if cfg.rope.scaling.factor != 1.0:
                global_rope["factor"] = cfg.rope.scaling.factor
            global_rope["rope_theta"] = cfg.rope.theta
        elif cfg.rope.scaling is not None:
            global_rope = rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling)
        head_dim = cfg.attention.global_head_dim or cfg.attention.head_dim
        override: dict[str, Any] = {"head_dim": head_dim}
        if cfg.attention.global_values_from_keys:
            override["num_key_value_heads"] = cfg.attention.global_num_kv_heads or cfg.attention.num_kv_heads
        types = layer_types_to_hf(cfg)
        return {
            **types,
            "final_logit_softcapping": cfg.head.softcap,
            "attention_k_eq_v": cfg.attention.global_values_from_keys,
            "rope_parameters": {
                "sliding_attention": rope_parameters_to_hf(cfg.rope.local_theta or cfg.rope.theta, None),
                "full_attention": global_rope,
            },
            "per_layer_config": {str(i): override for i, t in enumerate(types["layer_types"]) if t == "full_attention"},
            # The published checkpoints' keys for the same (read by transformers before 5.25 and vLLM).
            "global_head_dim": head_dim,
            "num_global_key_value_heads": override.get("num_key_value_heads"),
            **self._experts_to_hf(cfg),
            "hidden_size_per_layer_input": cfg.embedding.per_layer_input_dim or 0,
            "vocab_size_per_layer_input": cfg.vocab_size if cfg.embedding.per_layer_input_dim else PER_LAYER_VOCAB,
            "num_kv_shared_layers": cfg.attention.kv_shared_layers,
            "use_double_wide_mlp": cfg.mlp.kv_shared_wide,
        }

    @staticmethod
    def _experts_to_hf(cfg: ModelConfig) -> dict[str, Any]:
        if not cfg.is_moe:
            return {}
        return {
            "enable_moe_block": True,
            "num_experts": cfg.moe.num_experts,
            "top_k_experts": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        layers, stacks = cfg.layer_pattern(), dict(cfg.layer_stacks())
        no_values = {stack for stack, indices in stacks.items() if layers[indices[0]].values_from_keys}
        per_layer = [s for s in per_layer if not (s.stack in no_values and s.path == ("attn", "wv_dkh"))]
        reuse = {stack for stack, indices in stacks.items() if layers[indices[0]].kv_sharing == "reuse"}
        kv = {("attn", "wk_dkh"), ("attn", "wv_dkh"), ("attn", "k_norm", "scale")}
        per_layer = [s for s in per_layer if not (s.stack in reuse and s.path in kv)]  # KV sharing: none of their own
        extra = [TensorSpec(("layer_scale",), LAYER + "layer_scalar", None)]
        if (
            cfg.embedding.per_layer_input_dim
        ):  # per-layer embeddings: the model's table, projection and norm; each layer's
            top[1:1] = [
                TensorSpec(("per_layer_embed_vx",), "model.embed_tokens_per_layer.weight", None),
                TensorSpec(("per_layer_proj_dx",), "model.per_layer_model_projection.weight", 1),
                TensorSpec(("per_layer_proj_norm", "scale"), "model.per_layer_projection_norm.weight", None),
            ]
            extra += [
                TensorSpec(("per_layer_gate_dp",), LAYER + "per_layer_input_gate.weight", 1),
                TensorSpec(("per_layer_proj_pd",), LAYER + "per_layer_projection.weight", 1),
                TensorSpec(("post_per_layer_norm", "scale"), LAYER + "post_per_layer_input_norm.weight", None),
            ]
        return top, per_layer + [dataclasses.replace(spec, stack=stack) for stack in stacks for spec in extra]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        if not cfg.is_moe:
            return super().mlp_tensors(cfg)
        return [  # the dense MLP beside the experts, the router, the stacked experts, the branches' norms
            TensorSpec(("dense_mlp", "w_gate_df"), LAYER + "mlp.gate_proj.weight", 1),
            TensorSpec(("dense_mlp", "w_up_df"), LAYER + "mlp.up_proj.weight", 1),
            TensorSpec(("dense_mlp", "w_down_fd"), LAYER + "mlp.down_proj.weight", 1),
            TensorSpec(("mlp", "w_router_de"), LAYER + "router.proj.weight", 1),
            TensorSpec(("mlp", "router_scale_d"), LAYER + "router.scale", None),
            TensorSpec(("mlp", "expert_scale_e"), LAYER + "router.per_expert_scale", None),
            TensorSpec(
                ("mlp", "w_gate_edf"),
                LAYER + "experts.gate_up_proj",
                None,
                concatenated_with=(("mlp", "w_up_edf"),),
                swap_last=True,
            ),
            TensorSpec(("mlp", "w_down_efd"), LAYER + "experts.down_proj", None, swap_last=True),
            TensorSpec(("post_dense_norm", "scale"), LAYER + "post_feedforward_layernorm_1.weight", None),
            TensorSpec(("moe_norm", "scale"), LAYER + "pre_feedforward_layernorm_2.weight", None),
            TensorSpec(("post_moe_norm", "scale"), LAYER + "post_feedforward_layernorm_2.weight", None),
        ]

    def extra_attention_tensors(self) -> list[TensorSpec]:
        return qk_norm_tensors()

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return [  # Gemma 2's: post_attention_layernorm is the attention output's norm
            TensorSpec(("post_attn_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
            TensorSpec(("mlp_norm", "scale"), LAYER + "pre_feedforward_layernorm.weight", None),
            TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_feedforward_layernorm.weight", None),
        ]


UNIFIED_ABSENT = (
    "global_head_dim",
    "num_global_key_value_heads",
    "hidden_size_per_layer_input",
    "vocab_size_per_layer_input",
    "enable_moe_block",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
)
"""Gemma 4's config.json keys the unified text config has not (no per-layer inputs, no experts)."""


@register_family
class Gemma4UnifiedText(Gemma4):
    """Gemma 4 unified's text decoder (Gemma4UnifiedForCausalLM, model_type gemma4_unified_text):
    Gemma 4's dense layers (global heads of their own shape, values from keys, KV sharing, a
    double-wide MLP), without per-layer embeddings or experts; its text tokens attend causally
    (use_bidirectional_attention `vision` concerns image tokens only)."""

    name = "gemma4_unified_text"
    architecture = "Gemma4UnifiedForCausalLM"
    model_type = "gemma4_unified_text"
    hf_defaults = {
        **Gemma4.hf_defaults,
        "sliding_window": 1024,
        "max_position_embeddings": 262_144,
        "hidden_size_per_layer_input": 0,
    }
    multimodal = Multimodal(
        architecture="Gemma4UnifiedForConditionalGeneration",
        model_type="gemma4_unified",
        prefixes=(("model.", "model.language_model."), ("lm_head.", "lm_head.")),
    )
    hf_constants = {"attention_bias": False, "use_bidirectional_attention": "vision"}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # keys of Gemma 4 the unified config ignores, as transformers does
        return super().config_from_hf({k: v for k, v in hf.items() if k not in UNIFIED_ABSENT}, where)

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {k: v for k, v in super().extra_hf_keys(cfg).items() if k not in UNIFIED_ABSENT}

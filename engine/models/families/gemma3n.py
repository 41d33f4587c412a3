"""Gemma 3n text (Gemma3nForCausalLM, model_type gemma3n_text; the text decoder of the
published Gemma3nForConditionalGeneration checkpoints, E2B and E4B, whose vision and audio
towers conversion skips).

Gemma 4's small models' layers (norms that multiply by their scale, QK norms and a scale-free
value norm, attention unscaled, four sliding layers per global one here, per-layer embeddings,
the last layers sharing the keys and values of the last earlier layer of their kind, logits
soft-capped) with three mechanisms of its own:

- AltUp (engine/models/altup.py; ModelConfig.altup, the altup_* keys): the residual stream is
  altup_num_inputs streams; each layer predicts from all, computes on the active one and
  corrects all by its output, the per-layer input added to streams 1..n-1; the model enters the
  streams by projections of the embedding (altup_projections) and leaves them by projections
  back (altup_unembed_projections) and a mean;
- LAuReL (engine/models/laurel.py; block.laurel_rank): a low-rank residual beside the attention,
  averaged with it (1/sqrt 2);
- activation sparsity (mlp.gate_sparsity, activation_sparsity_pattern): the first layers' MLP
  gates keep what lies above their mean + 1.645 std (a Gaussian top-5%).

Its per-layer embedding table has fewer rows than the vocabulary (vocab_size_per_layer_input,
embedding.per_layer_vocab_size: the audio and image tokens past it read row 0). The published
checkpoints keep k/v projections and k norms in the KV-sharing layers, which transformers
never runs: conversion skips them, export leaves them out as transformers' save_pretrained does.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    LAYER,
    Family,
    Multimodal,
    TensorSpec,
    layer_types_to_hf,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
)
from engine.models.families.gemma4 import Gemma4

_SHARED_KV = re.compile(r"model\.layers\.(\d+)\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight$")


@register_family
class Gemma3n(Gemma4):
    name = "gemma3n"
    architecture = "Gemma3nForCausalLM"
    model_type = "gemma3n_text"
    fixed = {
        "scale_embeddings": True,
        "post_norms": True,
        "qk_norm": True,
        "value_norm": True,
        "query_pre_attn_scalar": 1.0,  # transformers' scaling = 1.0
    }
    hf_defaults = {  # Gemma3nTextConfig's (the E4B's)
        "vocab_size": 262_400,
        "max_position_embeddings": 32_768,
        "tie_word_embeddings": True,
        "sliding_window": 512,
        "hidden_size_per_layer_input": 256,
        "vocab_size_per_layer_input": 262_144,
        "altup_active_idx": 0,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "altup_num_inputs": 4,
        "num_kv_shared_layers": 15,
        "laurel_rank": 64,
        "final_logit_softcapping": 30.0,
    }
    multimodal = Multimodal(  # the published checkpoints: the decoder read, vision and audio towers skipped
        architecture="Gemma3nForConditionalGeneration",
        model_type="gemma3n",
        prefixes=(("model.", "model.language_model."), ("lm_head.", "lm_head.")),
    )
    unsupported_flags = ("attention_bias",)
    hf_constants = {"attention_bias": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        widths = hf.get("intermediate_size")
        if isinstance(widths, list):  # transformers writes one width per layer
            if len(set(widths)) != 1:
                raise ConfigError(f"{where}: intermediate_size must be one width for every layer, got {widths}")
            hf = {**hf, "intermediate_size": widths[0]}
        return Family.config_from_hf(self, hf, where)

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        return hf.get("layer_types") or [
            "full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(num_layers)
        ]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or {}
        full = {"rope_theta": hf.get("rope_theta", 1_000_000.0), **(rope.get("full_attention") or {})}
        local = {"rope_theta": hf.get("rope_local_base_freq", 10_000.0), **(rope.get("sliding_attention") or {})}
        theta, scaling = rope_from_hf(full, where)
        local_theta, local_scaling = rope_from_hf(local, where)
        if local_scaling is not None:
            raise ConfigError(f"{where}: RoPE scaling of sliding-window layers is not supported")
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        layers = hf["num_hidden_layers"]
        sparsity = hf.get("activation_sparsity_pattern")
        if sparsity is None:  # transformers' default: the first 10 layers of a deeper model
            sparsity = [0.95] * (10 if layers > 10 else 0) + [0.0] * (layers - (10 if layers > 10 else 0))
        elif not isinstance(sparsity, list):
            sparsity = [float(sparsity)] * layers
        per_layer_vocab = self.hf_value(hf, "vocab_size_per_layer_input")
        per_layer = self.hf_value(hf, "hidden_size_per_layer_input") or None  # 0: none
        return {
            "per_layer_input_dim": per_layer,
            "per_layer_vocab_size": None
            if per_layer is None or per_layer_vocab == hf["vocab_size"]
            else per_layer_vocab,
            "kv_shared_layers": self.hf_value(hf, "num_kv_shared_layers"),
            "final_logit_softcap": self.hf_value(hf, "final_logit_softcapping"),
            "laurel_rank": self.hf_value(hf, "laurel_rank"),
            "activation_sparsity": [float(s) for s in sparsity] if any(sparsity) else None,
            "altup": {
                "streams": self.hf_value(hf, "altup_num_inputs"),
                "active": self.hf_value(hf, "altup_active_idx"),
                "correct_scale": self.hf_value(hf, "altup_correct_scale"),
                "coef_clip": hf.get("altup_coef_clip", 120.0),
            },
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        if cfg.altup is None or cfg.block.laurel_rank is None:
            raise ConfigError(
                "a gemma3n model needs altup and laurel_rank (Gemma3nForCausalLM has both in every layer)"
            )
        return {
            **layer_types_to_hf(cfg),
            "intermediate_size": [cfg.mlp.dim] * cfg.num_layers,
            "final_logit_softcapping": cfg.head.softcap,
            "rope_parameters": {
                "sliding_attention": rope_parameters_to_hf(cfg.rope.local_theta or cfg.rope.theta, None),
                "full_attention": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            },
            "hidden_size_per_layer_input": cfg.embedding.per_layer_input_dim or 0,
            "vocab_size_per_layer_input": cfg.embedding.per_layer_vocab_size or cfg.vocab_size,
            "num_kv_shared_layers": cfg.attention.kv_shared_layers,
            "laurel_rank": cfg.block.laurel_rank,
            "activation_sparsity_pattern": cfg.mlp.gate_sparsity or [0.0] * cfg.num_layers,
            "altup_num_inputs": cfg.altup.streams,
            "altup_active_idx": cfg.altup.active,
            "altup_correct_scale": cfg.altup.correct_scale,
            "altup_coef_clip": cfg.altup.coef_clip,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = Family.tensor_table(self, cfg)
        layers, stacks = cfg.layer_pattern(), dict(cfg.layer_stacks())
        reuse = {stack for stack, indices in stacks.items() if layers[indices[0]].kv_sharing == "reuse"}
        kv = {("attn", "wk_dkh"), ("attn", "wv_dkh"), ("attn", "k_norm", "scale")}
        per_layer = [s for s in per_layer if not (s.stack in reuse and s.path in kv)]  # KV sharing: none of their own
        streams = cfg.altup.streams if cfg.altup is not None else 1
        per_layer_top = [
            TensorSpec(("per_layer_embed_vx",), "model.embed_tokens_per_layer.weight", None),
            TensorSpec(("per_layer_proj_dx",), "model.per_layer_model_projection.weight", 1),
            TensorSpec(("per_layer_proj_norm", "scale"), "model.per_layer_projection_norm.weight", None),
        ]
        top[1:1] = [
            *(per_layer_top if cfg.embedding.per_layer_input_dim else []),
            *(
                TensorSpec(("altup_streams", f"w_in{j}_dd"), f"model.altup_projections.{j - 1}.weight", 1)
                for j in range(1, streams)
            ),
            *(
                TensorSpec(("altup_streams", f"w_out{j}_dd"), f"model.altup_unembed_projections.{j - 1}.weight", 1)
                for j in range(1, streams)
            ),
        ]
        extra = [
            TensorSpec(("altup", "correct_scale_d"), LAYER + "altup.correct_output_scale", None),
            TensorSpec(("altup", "w_correct_nn"), LAYER + "altup.correction_coefs.weight", 1),
            TensorSpec(("altup", "w_predict_nm"), LAYER + "altup.prediction_coefs.weight", 1),
            TensorSpec(("altup", "w_router_dn"), LAYER + "altup.modality_router.weight", 1),
            TensorSpec(("altup", "router_norm", "scale"), LAYER + "altup.router_norm.weight", None),
            TensorSpec(("laurel", "w_left_dr"), LAYER + "laurel.linear_left.weight", 1),
            TensorSpec(("laurel", "w_right_rd"), LAYER + "laurel.linear_right.weight", 1),
            TensorSpec(("laurel", "norm", "scale"), LAYER + "laurel.post_laurel_norm.weight", None),
        ]
        if cfg.embedding.per_layer_input_dim:
            extra += [
                TensorSpec(("per_layer_gate_dp",), LAYER + "per_layer_input_gate.weight", 1),
                TensorSpec(("per_layer_proj_pd",), LAYER + "per_layer_projection.weight", 1),
                TensorSpec(("post_per_layer_norm", "scale"), LAYER + "post_per_layer_input_norm.weight", None),
            ]
        return top, per_layer + [dataclasses.replace(spec, stack=stack) for stack in stacks for spec in extra]

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        """The KV-sharing layers' k/v projections and k norm the published checkpoints keep
        (transformers ignores them on loading: those layers attend with a store layer's)."""
        found = _SHARED_KV.match(name)
        return found is not None and int(found.group(1)) >= cfg.num_layers - cfg.attention.kv_shared_layers

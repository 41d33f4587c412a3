"""Sarvam and Param-2 (model types sarvam_mla, sarvam_moe, param2moe): configurations
transformers runs with classes it has, under the layouts their checkpoints were published in.

- Sarvam MLA (sarvamai/sarvam-105b): DeepSeek-V3 (DeepseekV3ForCausalLM, families/deepseek.py)
  with uncompressed queries (q_lora_rank null) and routing over all experts at once. Published
  configs may carry DeepSeek's own keys: `q_head_dim` (the derived qk_head_dim), a `head_dim`
  and `rope_scaling.type: deepseek_yarn`, which transformers reads as YaRN.
- Sarvam MoE (sarvamai/sarvam-30b) and Param-2 MoE (bharatgenai/Param2-17B-A2.4B-Thinking):
  GLM-4.5 (Glm4MoeForCausalLM, families/glm.py) with a QK norm and RoPE over whole heads, under
  Ling's names: `model.word_embeddings`, one fused `attention.query_key_value` (q, k and v
  rows one after another), `attention.dense`, `attention.query_layernorm` /
  `key_layernorm`, the choosing bias `mlp.gate.expert_bias`. transformers renames them on
  loading and back on saving (its conversion mapping); so does the tensor table here, and
  LoRA adapters name transformers' modules (`self_attn.o_proj`); q, k and v, one tensor in
  the checkpoints, are refused as LoRA targets.

transformers saves all three with its class's architecture; the published `...ForCausalLM`
names (trust_remote_code classes) are read as the same family.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, TensorSpec, register_family
from engine.models.families.deepseek import DeepseekV3
from engine.models.families.glm import Glm4Moe


@register_family
class SarvamMLA(DeepseekV3):
    name = "sarvam_mla"
    architecture = "DeepseekV3ForCausalLM"
    also_architectures = ("SarvamMLAForCausalLM",)
    model_type = "sarvam_mla"
    hf_defaults = {
        **DeepseekV3.hf_defaults,
        "q_lora_rank": None,
        "n_routed_experts": 128,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "initializer_range": 0.006,
    }

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        scaling = hf.get("rope_scaling") or {}
        if hf.get("rope_parameters") is None and "deepseek_yarn" in (scaling.get("type"), scaling.get("rope_type")):
            rope = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": "yarn"}
            hf = {**hf, "rope_parameters": {"rope_theta": self.hf_value(hf, "rope_theta", 10000.0), **rope}}
        return super().rope_from_hf(hf, where)

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {**super().extra_hf_keys(cfg), "num_nextn_predict_layers": cfg.mtp_layers}


LING_NAMES = {
    "model.embed_tokens.": "model.word_embeddings.",
    "self_attn.o_proj.": "attention.dense.",
    "self_attn.q_norm.": "attention.query_layernorm.",
    "self_attn.k_norm.": "attention.key_layernorm.",
    "mlp.gate.e_score_correction_bias": "mlp.gate.expert_bias",
}
"""transformers' (GLM-4.5's) names -> the checkpoints'; q/k/v_proj are fused, below."""


@register_family
class SarvamMoE(Glm4Moe):
    name = "sarvam_moe"
    architecture = "Glm4MoeForCausalLM"
    also_architectures: ClassVar[tuple[str, ...]] = ("SarvamMoEForCausalLM",)
    model_type = "sarvam_moe"
    peft_refuses = {"query_key_value": "the checkpoints fuse it, transformers runs q_proj, k_proj, v_proj apart"}
    hf_defaults = {
        **Glm4Moe.hf_defaults,
        "rope_theta": 8_000_000.0,
        "rms_norm_eps": 1e-6,
        "moe_intermediate_size": 1024,
        "num_experts_per_tok": 6,
        "routed_scaling_factor": 2.5,
        "partial_rotary_factor": 1.0,
        "use_qk_norm": True,
        "initializer_range": 0.006,
    }
    hf_constants = {**Glm4Moe.hf_constants}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        fields = super().extra_fields_from_hf(hf)
        return {**fields, "qk_norm": bool(self.hf_value(hf, "use_qk_norm"))}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = super().extra_hf_keys(cfg)
        del keys["partial_rotary_factor"]  # only in rope_parameters: the config class has no such key
        return keys

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        return [self._renamed(spec) for spec in top], [
            self._renamed(spec) for spec in per_layer if spec.path[-1][:2] not in ("wk", "wv", "bk", "bv")
        ]

    def module_name(self, hf_name: str) -> str:
        """transformers' module of a checkpoint tensor (PEFT names adapters by it): GLM-4.5's."""
        for ours, theirs in LING_NAMES.items():
            hf_name = hf_name.replace(theirs, ours)
        return hf_name

    @staticmethod
    def _renamed(spec: TensorSpec) -> TensorSpec:
        """`spec` under the checkpoints' name; q_proj's the fused query_key_value (k and v after it)."""
        name = spec.hf_name
        for ours, theirs in LING_NAMES.items():
            name = name.replace(ours, theirs)
        if spec.path in (("attn", "wq_dnh"), ("attn", "bq_nh")):
            kind = "w" if spec.path[1][0] == "w" else "b"
            shape = "dkh" if kind == "w" else "kh"
            fused = ((spec.path[0], f"{kind}k_{shape}"), (spec.path[0], f"{kind}v_{shape}"))
            suffix = "weight" if kind == "w" else "bias"
            return dataclasses.replace(spec, hf_name=LAYER + f"attention.query_key_value.{suffix}", fused_with=fused)
        return dataclasses.replace(spec, hf_name=name)


@register_family
class Param2Moe(SarvamMoE):
    name = "param2moe"
    also_architectures = ("Param2MoeForCausalLM", "Param2MoEForCausalLM")
    model_type = "param2moe"
    hf_defaults = {
        **SarvamMoE.hf_defaults,
        "rope_theta": 500_000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "initializer_range": 0.02,
    }

"""Phi-3 and Phi-4 (Phi3ForCausalLM): Llama whose checkpoints fuse projections.

`self_attn.qkv_proj` holds q, k and v one after another along its output axis, and
`mlp.gate_up_proj` gate then up (TensorSpec.fused_with); conversion splits them into the
engine's separate arrays and export fuses them again. A `sliding_window` applies to every
layer; `partial_rotary_factor` (Phi-4-mini) rotates the first part of each head
(ModelConfig.rope.rotary_dim). LongRoPE (`rope_type: longrope`, or the older `su` and `yarn`
that transformers reads as it for Phi-3; Phi-3-mini-128k, Phi-3.5, Phi-4-mini) is the RoPE
kind longrope (rope.py): per-pair short and long factors, switched when the sequence passes
the top-level `original_max_position_embeddings` (which transformers prefers to the one in
the RoPE dict), and an attention factor from max_position_embeddings / that length. LoRA
adapts qkv_proj and gate_up_proj each as one module, as PEFT does.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Family, TensorSpec, register_family, rope_from_hf
from engine.models.families.base import rope_parameters_to_hf as _rope_parameters


@register_family
class Phi3(Family):
    name = "phi3"
    architecture = "Phi3ForCausalLM"
    model_type = "phi3"
    hf_defaults = {"max_position_embeddings": 4096, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
    unsupported_flags = ()
    hf_constants = {"resid_pdrop": 0.0, "embd_pdrop": 0.0}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        kind = "full_attention" if hf.get("sliding_window") is None else "sliding_attention"
        return [kind] * num_layers

    def _partial_rotary_factor(self, hf: dict) -> float:
        return float(
            (hf.get("rope_parameters") or {}).get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
        )

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        )
        rope.pop("partial_rotary_factor", None)  # rotary_dim, below
        if rope.get("rope_type", rope.get("type")) in ("longrope", "su", "yarn"):  # transformers' Phi3Config
            theta = float(rope.get("rope_theta", 10000.0))
            return {"rope_theta": theta, "rope_scaling": self._longrope(hf, rope, where)}
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def _longrope(self, hf: dict, rope: dict, where: str) -> dict[str, Any]:
        original = self.hf_value(hf, "original_max_position_embeddings", 4096)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        pairs = int(head_dim * self._partial_rotary_factor(hf)) // 2
        for key in ("short_factor", "long_factor"):
            if not isinstance(rope.get(key), list) or len(rope[key]) != pairs:
                raise ConfigError(f"{where}: rope_parameters.{key} must list {pairs} numbers (one per rotated pair)")
        return {
            "kind": "longrope",
            "short_factor": rope["short_factor"],
            "long_factor": rope["long_factor"],
            "original_max_position": original,
            "factor": rope.get("factor") or self.hf_value(hf, "max_position_embeddings") / original,
            "attention_factor": rope.get("attention_factor"),
        }

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        rotary = int(head_dim * self._partial_rotary_factor(hf))
        return {"rotary_dim": None if rotary == head_dim else rotary}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        scaling = cfg.rope.scaling
        original = scaling.original_max_position if scaling is not None and scaling.kind == "longrope" else None
        longrope = original is not None
        keys: dict[str, Any] = {
            "sliding_window": cfg.attention.sliding_window if all(cfg.layer_is_local()) else None,
            "original_max_position_embeddings": original or cfg.max_seq_len,
        }
        rope = _rope_parameters(cfg.rope.theta, scaling)
        if original is not None and rope.get("factor") == cfg.max_seq_len / original:
            del rope["factor"]  # transformers' default, which published configs leave out
            keys["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if cfg.rope.rotary_dim is not None or longrope:  # transformers writes the factor in both places
            factor = (cfg.rope.rotary_dim or cfg.attention.head_dim) / cfg.attention.head_dim
            keys["rope_parameters"] = {**rope, "partial_rotary_factor": factor}
            keys["partial_rotary_factor"] = factor
        return keys

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            TensorSpec(
                ("attn", "wq_dnh"),
                LAYER + "self_attn.qkv_proj.weight",
                1,
                fused_with=(("attn", "wk_dkh"), ("attn", "wv_dkh")),
            ),
            TensorSpec(("attn", "wo_nhd"), LAYER + "self_attn.o_proj.weight", 2),
        ]

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return [
            TensorSpec(("mlp", "w_gate_df"), LAYER + "mlp.gate_up_proj.weight", 1, fused_with=(("mlp", "w_up_df"),)),
            TensorSpec(("mlp", "w_down_fd"), LAYER + "mlp.down_proj.weight", 1),
        ]

"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 text (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM),
as transformers 5.25 defines them.

Hybrid decoders: most layers are Gated DeltaNet linear attention (the `gated_delta` mixer kind,
engine/models/gated_delta_block.py), every full_attention_interval-th (4th) layer is gated
softmax attention: Qwen3's QK-norm attention whose query projection also yields a sigmoid
output gate per head (ModelConfig.attention.output_gate), RoPE on the first quarter of each
head (partial_rotary_factor, rotary_dim). Every RMSNorm but the linear layers' gated one is
zero-centred (1 + weight). Qwen3-Next's and Qwen3.5-MoE's feed-forward is a softmax top-k
mixture of experts plus one shared expert scaled by sigmoid(shared_expert_gate(x)); Qwen3.5
dense has the gated MLP. Qwen3-Next fuses the linear layers' input projections per key head
(in_proj_qkvz, in_proj_ba), Qwen3.5 keeps them apart (in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a). Qwen3.5's text RoPE is multimodal RoPE (mrope_section), which for text, whose
three position axes are equal, is plain RoPE whatever the section (transformers' text rotary
embedding takes each of its interleaved height and width frequencies from an axis whose
positions are the time axis's); the section is kept for the export. Checkpoints store one
tensor per expert, as transformers saves them; the multi-token-prediction weights published
Qwen3-Next checkpoints carry (mtp.*) are skipped, as transformers skips them.
"""

from __future__ import annotations

from typing import Any, ClassVar

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    EXPERT,
    LAYER,
    Family,
    Multimodal,
    TensorSpec,
    gated_mlp_tensors,
    qk_norm_tensors,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
    shortest_period,
)

_LINEAR_KEYS = {
    "num_key_heads": "linear_num_key_heads",
    "num_value_heads": "linear_num_value_heads",
    "key_head_dim": "linear_key_head_dim",
    "value_head_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim",
}
_DEFAULTS = {
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "head_dim": 256,
    "partial_rotary_factor": 0.25,
    "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
_VLM_PREFIXES = (("model.", "model.language_model."), ("lm_head.", "lm_head."))
"""Qwen3.5's published Qwen3_5(Moe)ForConditionalGeneration: the text decoder under
model.language_model., beside model.visual. (and the mtp. layer), all skipped on conversion."""
_MROPE_SECTION = [11, 11, 10]
"""Qwen3.5's mrope_section: every published checkpoint's, and transformers' default (stored as
None, so it is not written back, as transformers' text class writes none)."""


class _Hybrid(Family):
    """Gated DeltaNet layers among gated attention ones."""

    fused_linear: ClassVar[bool] = False
    """Qwen3-Next's per-key-head fused linear-layer projections (GatedDeltaConfig.fused_projections)."""
    mrope: ClassVar[bool] = False
    """Qwen3.5: rope_parameters may carry multimodal RoPE's mrope_section and mrope_interleaved,
    which change nothing for text (ModelConfig.rope.mrope_section)."""
    hf_defaults = _DEFAULTS
    fixed = {"qk_norm": True, "norm_zero_centered": True, "attention_output_gate": True}
    hf_constants = {"attention_bias": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if self.activation_from_hf(hf) != "silu":  # also the linear layers' convolution activation
            raise ConfigError(
                f"{where}: hidden_act '{self.activation_from_hf(hf)}' is not supported ({self.name}: silu)"
            )
        extra = set(self._rope(hf)) - {"rope_type", "rope_theta", "partial_rotary_factor", *self._mrope_keys}
        extra -= {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor"}
        extra -= {"mscale", "mscale_all_dim", "truncate", "low_freq_factor", "high_freq_factor", "type"}
        if extra:
            raise ConfigError(f"{where}: rope_parameters key '{sorted(extra)[0]}' is not supported")
        section = self._rope(hf).get("mrope_section")
        if section is not None and not (
            isinstance(section, list) and len(section) == 3 and all(isinstance(x, int) and x >= 0 for x in section)
        ):
            raise ConfigError(
                f"{where}: rope_parameters mrope_section {section!r} must be three non-negative integers "
                "(the time, height and width shares of the rotary frequencies)"
            )
        return super().config_from_hf(hf, where)

    @property
    def _mrope_keys(self) -> tuple[str, ...]:
        return ("mrope_section", "mrope_interleaved") if self.mrope else ()

    def _rope(self, hf: dict) -> dict:
        return dict(
            hf.get("rope_parameters")
            or {"rope_theta": self.hf_value(hf, "rope_theta", 10000.0), **(hf.get("rope_scaling") or {})}
        )

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = self._rope(hf)
        for key in ("partial_rotary_factor", *self._mrope_keys):
            rope.pop(key, None)  # rotary_dim, below; mrope: plain RoPE for text
        theta, scaling = rope_from_hf(rope, where)
        return {"rope_theta": theta, "rope_scaling": scaling}

    def layer_types(self, hf: dict, num_layers: int) -> list[str]:
        return ["full_attention"] * num_layers  # the attention layers: every one global

    def mixers(self, hf: dict) -> list[str]:
        """transformers' layer_types (linear_attention / full_attention), or its default rule:
        layer i is full attention when (i + 1) % full_attention_interval == 0."""
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types")
        if types is None:
            interval = self.hf_value(hf, "full_attention_interval")
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        where = f"config.json ({self.architecture})"
        if len(types) != layers:
            raise ConfigError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
        unknown = sorted(set(types) - {"linear_attention", "full_attention"})
        if unknown:
            raise ConfigError(f"{where}: layer type '{unknown[0]}' is not supported (linear_attention, full_attention)")
        return ["gated_delta" if t == "linear_attention" else "attention" for t in types]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        head_dim = self.hf_value(hf, "head_dim")
        factor = self._rope(hf).get("partial_rotary_factor") or self.hf_value(hf, "partial_rotary_factor")
        rotary = int(head_dim * factor)
        if rotary % 2 or not 0 < rotary <= head_dim:
            raise ConfigError(
                f"config.json ({self.architecture}): partial_rotary_factor {factor} gives {rotary} rotary "
                f"dimensions of head_dim {head_dim}; they must be even and at most head_dim"
            )
        mixers = self.mixers(hf)
        linear = "gated_delta" in mixers
        section = self._rope(hf).get("mrope_section") if self.mrope else None
        return {
            "head_dim": head_dim,
            "mrope_section": None if section in (None, _MROPE_SECTION) else list(section),
            "rotary_dim": None if rotary == head_dim else rotary,
            "mixer_pattern": shortest_period(mixers) if linear else None,
            "gated_delta": (
                {
                    **{field: self.hf_value(hf, key) for field, key in _LINEAR_KEYS.items()},
                    "fused_projections": self.fused_linear,
                }
                if linear
                else None
            ),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        factor = (cfg.rope.rotary_dim or cfg.attention.head_dim) / cfg.attention.head_dim
        kinds = [layer.mixer for layer in cfg.layer_pattern()]
        sizes = cfg.gated_delta or _LinearDefaults
        # mrope_interleaved as published (transformers' Qwen3.5 reads no such flag: it always interleaves)
        mrope = {"mrope_section": cfg.rope.mrope_section, "mrope_interleaved": True} if cfg.rope.mrope_section else {}
        return {
            "rope_parameters": {
                **rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
                "partial_rotary_factor": factor,
                **mrope,
            },
            "partial_rotary_factor": factor,
            "layer_types": ["linear_attention" if kind == "gated_delta" else "full_attention" for kind in kinds],
            **{key: getattr(sizes, field) for field, key in _LINEAR_KEYS.items()},
        }

    def mixer_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        if layer.mixer != "gated_delta":
            return [*self.attention_tensors(cfg), *qk_norm_tensors()]
        attn = LAYER + "linear_attn."
        if self.fused_linear:
            projections = [
                TensorSpec(("attn", "w_qkvz_dkx"), attn + "in_proj_qkvz.weight", 1),
                TensorSpec(("attn", "w_ba_dkx"), attn + "in_proj_ba.weight", 1),
            ]
        else:
            projections = [
                TensorSpec(("attn", "w_qkv_dc"), attn + "in_proj_qkv.weight", 1),
                TensorSpec(("attn", "w_z_dvh"), attn + "in_proj_z.weight", 1),
                TensorSpec(("attn", "w_b_dv"), attn + "in_proj_b.weight", 1),
                TensorSpec(("attn", "w_a_dv"), attn + "in_proj_a.weight", 1),
            ]
        return [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            TensorSpec(("attn", "dt_bias_v"), attn + "dt_bias", None),
            TensorSpec(("attn", "a_log_v"), attn + "A_log", None),
            TensorSpec(("attn", "conv_c1k"), attn + "conv1d.weight", None),
            *projections,
            TensorSpec(("attn", "norm_h"), attn + "norm.weight", None),
            TensorSpec(("attn", "w_out_vhd"), attn + "out_proj.weight", 2),
        ]

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return name.startswith("mtp.")  # the multi-token-prediction module transformers does not run


class _LinearDefaults:
    """A model without linear layers still writes the linear_* keys: transformers' defaults."""

    num_key_heads, num_value_heads = _DEFAULTS["linear_num_key_heads"], _DEFAULTS["linear_num_value_heads"]
    key_head_dim, value_head_dim = _DEFAULTS["linear_key_head_dim"], _DEFAULTS["linear_value_head_dim"]
    conv_kernel = _DEFAULTS["linear_conv_kernel_dim"]


def _experts_with_shared() -> list[TensorSpec]:
    """The softmax router, the experts (one tensor each) and the gated shared expert."""
    expert = LAYER + "mlp." + EXPERT
    shared = LAYER + "mlp.shared_expert."
    return [
        TensorSpec(("mlp", "w_router_de"), LAYER + "mlp.gate.weight", 1),
        TensorSpec(("mlp", "w_gate_edf"), expert + "gate_proj.weight", 1, experts=True),
        TensorSpec(("mlp", "w_up_edf"), expert + "up_proj.weight", 1, experts=True),
        TensorSpec(("mlp", "w_down_efd"), expert + "down_proj.weight", 1, experts=True),
        TensorSpec(("mlp", "w_shared_gate_dg"), shared + "gate_proj.weight", 1),
        TensorSpec(("mlp", "w_shared_up_dg"), shared + "up_proj.weight", 1),
        TensorSpec(("mlp", "w_shared_down_gd"), shared + "down_proj.weight", 1),
        TensorSpec(("mlp", "w_shared_scale_d1"), LAYER + "mlp.shared_expert_gate.weight", 1),
    ]


def _expert_fields(hf: dict, family: Family, where: str) -> dict[str, Any]:
    """The experts' ModelConfig fields: one shared expert of shared_expert_intermediate_size
    (shared_expert_mlp_dim where it differs from the experts' width)."""
    expert_mlp_dim = family.hf_value(hf, "moe_intermediate_size")
    shared = family.hf_value(hf, "shared_expert_intermediate_size")
    if not shared:
        raise ConfigError(f"{where}: shared_expert_intermediate_size {shared} (no shared expert) is not supported")
    return {
        "num_experts": family.hf_value(hf, "num_experts"),
        "experts_per_token": family.hf_value(hf, "num_experts_per_tok"),
        "expert_mlp_dim": expert_mlp_dim,
        "num_shared_experts": 1,
        "shared_expert_mlp_dim": None if shared == expert_mlp_dim else shared,
    }


@register_family
class Qwen3Next(_Hybrid):
    name = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"
    model_type = "qwen3_next"
    moe = True
    fused_linear = True
    fixed = {**_Hybrid.fixed, "router_score": "softmax", "shared_expert_gate": True}
    hf_defaults = {
        **_DEFAULTS,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    }
    # Training-only settings of transformers' class; the engine's loss weights are ComputeConfig's.
    hf_constants = {"attention_bias": False, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def moe_layers(self, hf: dict) -> list[bool]:
        """transformers' rule: experts unless in mlp_only_layers, and when (i + 1) % decoder_sparse_step == 0."""
        dense, step = set(hf.get("mlp_only_layers") or []), self.hf_value(hf, "decoder_sparse_step")
        return [i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        where = f"config.json ({self.architecture})"
        if not self.hf_value(hf, "num_experts"):
            raise ConfigError(f"{where}: num_experts 0 (no experts) is not supported for {self.name}")
        moe = self.moe_layers(hf)
        if not any(moe):
            raise ConfigError(f"{where}: no layer has experts (decoder_sparse_step, mlp_only_layers)")
        return {
            **super().extra_fields_from_hf(hf),
            **_expert_fields(hf, self, where),
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
            "ffn_pattern": None if all(moe) else ["moe" if x else "mlp" for x in shortest_period(moe)],
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        moe = [layer.ffn == "moe" for layer in cfg.layer_pattern()]
        return {
            **super().extra_hf_keys(cfg),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, x in enumerate(moe) if not x],
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "shared_expert_intermediate_size": cfg.shared_mlp_dim,
            "norm_topk_prob": cfg.moe.router_renormalize,
        }

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return _experts_with_shared()


@register_family
class Qwen3_5(_Hybrid):
    name = "qwen3_5"
    architecture = "Qwen3_5ForCausalLM"
    model_type = "qwen3_5_text"
    multimodal = Multimodal("Qwen3_5ForConditionalGeneration", "qwen3_5", _VLM_PREFIXES)
    mrope = True
    hf_defaults = {**_DEFAULTS, "max_position_embeddings": 32768}

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return gated_mlp_tensors()


@register_family
class Qwen3_5Moe(_Hybrid):
    name = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForCausalLM"
    model_type = "qwen3_5_moe_text"
    multimodal = Multimodal("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", _VLM_PREFIXES)
    moe = True
    mrope = True
    fixed = {**_Hybrid.fixed, "router_score": "softmax", "router_renormalize": True, "shared_expert_gate": True}
    hf_defaults = {
        **_DEFAULTS,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    }
    hf_constants = {"attention_bias": False, "output_router_logits": False, "router_aux_loss_coef": 0.001}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        # Every layer has experts: the class has no intermediate_size (mlp_dim: the experts' width).
        return super().config_from_hf({"intermediate_size": self.hf_value(hf, "moe_intermediate_size"), **hf}, where)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["intermediate_size"]
        return hf

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        where = f"config.json ({self.architecture})"
        return {**super().extra_fields_from_hf(hf), **_expert_fields(hf, self, where), "expert_mlp_dim": None}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            **super().extra_hf_keys(cfg),
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "shared_expert_intermediate_size": cfg.shared_mlp_dim,
        }

    def mlp_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        return _experts_with_shared()

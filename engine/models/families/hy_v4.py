"""Hy4 (HYV4ForCausalLM, model_type hy_v4; tencent/Hy4-preview): GLM-5's layers (families/
deepseek_v32.py: multi-head latent attention with DeepSeek Sparse Attention, some layers
reusing the last earlier indexer's selection, `indexer_types`) over independent
hyper-connections, with:

- a learned sink logit per head in each softmax (ModelConfig.attention.sinks) and each head's
  output times sigmoid(x . W_gate) per value dimension before o_proj (mla.output_gate);
- the indexer rotating the last qk_rope_head_dim dimensions of its queries and key, not the
  first (mla.index_rope_last), its key LayerNorm at rms_norm_eps (mla.index_norm_eps);
- n residual streams (hc_mult) as DeepSeek-V4's (engine/models/hyper_connection.py) without
  the streams' mix: each sublayer reads sigmoid-weighted sums of the streams and adds
  hc_magnitude * sigmoid(.) + hc_eps of its output to each (hyper_connections.independent),
  the streams' final mix before the model's norm;
- the routed experts' SwiGLU clamped at swiglu_limit (gate above, up both ways; the shared
  experts' and the dense layers' plain: moe.clamp_dense false).

Checkpoints keep the published names transformers saves: `hc_pre.hc_{attn,mlp}_layer.hc_{fn,
base,scale}`, `hc_pre.hc_head.hc_head_*`, `self_attn.learnable_sink_param`, every gate_proj as
`linear_gate`, and each layer's experts stacked (`mlp.experts.gate_up_proj`, gate then up,
and `down_proj`). The multi-token-prediction layers (`model.mtp_layers.*`, which transformers
skips) are skipped by conversion.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, TensorSpec, register_family
from engine.models.families.deepseek_v32 import GlmMoeDsa

_HC = LAYER + "hc_pre.hc_{}_layer.hc_"
_HC_PARTS = (("w_mix_xm", "fn", 1), ("b_mix_m", "base", None), ("scale_2", "scale", None))
"""An independent hyper-connection's engine arrays, HF names and in_dims."""


def _hf_name(name: str) -> str:
    """GLM-5's name of a tensor -> Hy4's published one (transformers' hy_v4 conversion mapping, reversed)."""
    return name.replace("gate_proj", "linear_gate")


@register_family
class HYV4(GlmMoeDsa):
    name = "hy_v4"
    architecture = "HYV4ForCausalLM"
    model_type = "hy_v4"
    fixed = {
        **GlmMoeDsa.fixed,
        "index_rope_last": True,
        "attention_sinks": True,
        "mla_output_gate": True,
        "swiglu_alpha": 1.0,
        "swiglu_shift": 0.0,
        "moe_clamp_dense": False,
    }
    hf_defaults = {
        **GlmMoeDsa.hf_defaults,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.006,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.827,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 16,
        "hc_mult": 4,
        "hc_magnitude": 2.0,
        "hc_eps": 1e-6,
        "swiglu_limit": 10.0,
    }
    hf_constants = {"attention_bias": False, "output_router_logits": False, "learnable_sink_init": 0.0}

    @staticmethod
    def indexer_types(hf: dict) -> list[str] | None:
        types = hf.get("indexer_types")
        layers = hf.get("num_hidden_layers")
        if types is None and layers is not None:  # HYV4Config's: the first, then every fourth from the second
            types = ["full" if i == 0 or (i - 1) % 4 == 0 else "shared" for i in range(layers)]
        return None if types is None else list(types)

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        limit = self.hf_value(hf, "swiglu_limit")
        if hf.get("first_k_dense_replace") is not None:
            raise ConfigError(f"{where}: first_k_dense_replace is not a {self.architecture} key (mlp_layer_types is)")
        # HYV4Config's q_lora_rank is never null: a file without it has transformers' default
        fields = super().config_from_hf({**hf, "q_lora_rank": self.hf_value(hf, "q_lora_rank")}, where)
        return {**fields, "swiglu_limit": float(limit) if limit > 0 else None}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        fields = super().extra_fields_from_hf(hf)
        layers = hf["num_hidden_layers"]
        types = hf.get("mlp_layer_types") or ["dense"] * min(1, layers) + ["sparse"] * max(layers - 1, 0)
        return {
            **fields,
            "first_dense_layers": types.count("dense"),
            "mtp_layers": 0,
            "index_norm_eps": float(self.hf_value(hf, "rms_norm_eps")),
            "hyper_connections": {
                "streams": self.hf_value(hf, "hc_mult"),
                "eps": float(self.hf_value(hf, "hc_eps")),
                "independent": True,
                "magnitude": float(self.hf_value(hf, "hc_magnitude")),
            },
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = super().extra_hf_keys(cfg)
        del keys["first_k_dense_replace"]
        hc = cfg.hyper_connections
        assert hc is not None
        return {
            **keys,
            "hc_mult": hc.streams,
            "hc_magnitude": hc.magnitude,
            "hc_eps": hc.eps,
            "swiglu_limit": cfg.moe.swiglu_limit or 0.0,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        head = "model.hc_pre.hc_head.hc_head_"
        top += [
            TensorSpec(("hc_head", "w_mix_xn"), head + "fn", 1),
            TensorSpec(("hc_head", "b_mix_n"), head + "base", None),
            TensorSpec(("hc_head", "scale_1"), head + "scale", None),
        ]
        table = []
        for stack, _ in cfg.layer_stacks():
            specs = [spec for spec in per_layer if spec.stack == stack and "experts.{j}" not in spec.hf_name]
            specs = [dataclasses.replace(spec, hf_name=_hf_name(spec.hf_name)) for spec in specs]
            extra = [
                TensorSpec(("attn", "sinks_n"), LAYER + "self_attn.learnable_sink_param", None),
                TensorSpec(("attn", "w_gate_dnw"), LAYER + "self_attn.linear_gate.weight", 1),
                *(
                    TensorSpec((hc, name), _HC.replace("{}", hf_hc) + hf, in_dims)
                    for hc, hf_hc in (("attn_hc", "attn"), ("ffn_hc", "mlp"))
                    for name, hf, in_dims in _HC_PARTS
                ),
            ]
            if not stack.endswith("dense_blocks"):  # the experts, stacked
                extra += [
                    TensorSpec(
                        ("mlp", "w_gate_edf"),
                        LAYER + "mlp.experts.gate_up_proj",
                        None,
                        concatenated_with=(("mlp", "w_up_edf"),),
                        swap_last=True,
                    ),
                    TensorSpec(("mlp", "w_down_efd"), LAYER + "mlp.experts.down_proj", None, swap_last=True),
                ]
            table += specs + [dataclasses.replace(spec, stack=stack) for spec in extra]
        return top, table

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return name.startswith("model.mtp_layers.")  # the multi-token-prediction layers (transformers skips them)

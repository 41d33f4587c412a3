"""LFM2 (LiquidAI/LFM2-*; transformers' lfm2, Lfm2ForCausalLM): layers of gated short
convolutions (the `short_conv` mixer kind, engine/models/short_conv.py) among grouped-query
attention layers with Qwen3's QK norm (q_layernorm, k_layernorm) and RoPE, as config.json's
layer_types (or the older full_attn_idxs) place them; every layer then a SwiGLU MLP (w1 gate,
w3 up, w2 down). The final norm is named embedding_norm.

The MLP's width is derived from intermediate_size (the published configs' block_ff_dim):
with block_auto_adjust_ff_dim, int(2/3 of it), times block_ffn_dim_multiplier, rounded up
to a multiple of block_multiple_of. Export writes the published form where it gives the width
back (intermediate_size 3/2 of it, rounded to 256), else the width itself, unadjusted.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import (
    EXPERT,
    LAYER,
    Family,
    TensorSpec,
    register_family,
    rope_from_hf,
    rope_parameters_to_hf,
    shortest_period,
)

KINDS = {"conv": "short_conv", "full_attention": "attention"}
"""config.json layer_types -> the mixer kind."""
MULTIPLE = 256
"""transformers' block_multiple_of default: the published configs'."""


def mlp_width(hf: dict, intermediate: int) -> int:
    """Lfm2MLP's width of config.json `hf` whose intermediate_size is `intermediate`."""
    if not hf.get("block_auto_adjust_ff_dim", True):
        return intermediate
    width = int(2 * intermediate / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        multiple = hf.get("block_multiple_of", MULTIPLE)
        width = multiple * math.ceil(int(multiplier * width) / multiple)
    return width


def mlp_width_to_hf(width: int) -> dict[str, Any]:
    """The MLP keys of a width: the published form (auto-adjusted, multiplier 1) where it gives
    the width back, else the width unadjusted."""
    published = {"block_multiple_of": MULTIPLE, "block_ffn_dim_multiplier": 1.0}
    intermediate = 3 * width // 2
    if mlp_width({**published, "block_auto_adjust_ff_dim": True}, intermediate) == width:
        return {"intermediate_size": intermediate, "block_auto_adjust_ff_dim": True, **published}
    return {"intermediate_size": width, "block_auto_adjust_ff_dim": False, **published}


def layer_kinds(hf: dict, where: str, kinds: dict[str, str] = KINDS) -> list[str]:
    """Each layer's mixer kind: layer_types (`kinds` maps them), else full_attn_idxs
    (transformers' rule: all attention when neither is given)."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:
        attention = hf.get("full_attn_idxs")
        attention = range(layers) if attention is None else attention
        types = ["full_attention" if i in attention else "conv" for i in range(layers)]
    unknown = sorted(set(types) - set(kinds))
    if unknown or len(types) != layers:
        raise ConfigError(f"{where}: layer_types must name {layers} layers of {', '.join(kinds)}")
    return [kinds[t] for t in types]


def short_conv_tensors(cfg: ModelConfig, prefix: str) -> list[TensorSpec]:
    """A short convolution's tensors under `prefix` (LFM2: model.layers.{i}.conv.)."""
    specs = [
        TensorSpec(("attn", "w_in_d3c"), prefix + "in_proj.weight", 1),
        TensorSpec(("attn", "conv_c1k"), prefix + "conv.weight", None),
        TensorSpec(("attn", "w_out_cd"), prefix + "out_proj.weight", 1),
    ]
    if cfg.short_conv is not None and cfg.short_conv.bias:
        specs += [
            TensorSpec(("attn", "b_in_3c"), prefix + "in_proj.bias", None, flatten=True),
            TensorSpec(("attn", "conv_bias_c"), prefix + "conv.bias", None),
            TensorSpec(("attn", "b_out_d"), prefix + "out_proj.bias", None),
        ]
    return specs


class _Lfm2Base(Family):
    """LFM2's layers and names; LFM2-MoE adds its experts."""

    hf_defaults = {
        "max_position_embeddings": 128000,
        "norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "conv_L_cache": 3,
        "conv_bias": False,
        "rope_theta": 1000000.0,
    }
    fixed = {"qk_norm": True}
    layer_kinds: ClassVar[dict[str, str]] = KINDS
    """config.json's layer_types -> the mixer kind."""

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        hf = {**hf}
        if hf.get("block_ff_dim") is not None:  # the published configs' name of intermediate_size
            hf.setdefault("intermediate_size", hf["block_ff_dim"])
        if hf.get("tie_embedding") is not None:
            hf.setdefault("tie_word_embeddings", hf["tie_embedding"])
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "intermediate_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        d, heads = hf["hidden_size"], hf["num_attention_heads"]
        kinds = layer_kinds(hf, where, self.layer_kinds)
        conv = {"conv_kernel": self.hf_value(hf, "conv_L_cache"), "bias": self.hf_value(hf, "conv_bias")}
        return {
            "family": self.name,
            "vocab_size": hf["vocab_size"],
            "d_model": d,
            "num_layers": hf["num_hidden_layers"],
            "num_heads": heads,
            "num_kv_heads": hf.get("num_key_value_heads") or heads,
            "head_dim": hf.get("head_dim") or d // heads,
            "mlp_dim": self.mlp_width(hf),
            "max_seq_len": self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": self.hf_value(hf, "norm_eps"),
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            **self.rope_from_hf(hf, where),
            **self.fixed,
            "mixer_pattern": shortest_period(kinds) if "short_conv" in kinds else None,
            "short_conv": conv if "short_conv" in kinds else None,
            **self.extra_fields_from_hf(hf),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        conv = cfg.short_conv
        kinds = {"short_conv": "conv", "attention": "full_attention"}
        hf = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "max_position_embeddings": cfg.max_seq_len,
            "initializer_range": cfg.init_std,
            "norm_eps": cfg.norm.eps,
            "use_cache": True,
            "tie_word_embeddings": cfg.tie_embeddings,
            "rope_parameters": rope_parameters_to_hf(cfg.rope.theta, cfg.rope.scaling),
            "conv_bias": conv.bias if conv is not None else False,
            "conv_L_cache": conv.conv_kernel if conv is not None else self.hf_defaults["conv_L_cache"],
            "layer_types": [kinds[layer.mixer] for layer in cfg.layer_pattern()],
            **(
                {}
                if cfg.attention.head_dim == cfg.d_model // cfg.attention.num_heads
                else {"head_dim": cfg.attention.head_dim}
            ),
        }
        hf.update(self.extra_hf_keys(cfg))
        return hf

    def mlp_width(self, hf: dict) -> int:
        """The dense MLP's width (LFM2: intermediate_size auto-adjusted)."""
        return mlp_width(hf, hf["intermediate_size"])

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            **mlp_width_to_hf(cfg.mlp.dim),
            "full_attn_idxs": None,  # (transformers writes it: layer_types rule)
            # the published configs' widths of the convolution and the feed-forward's input, which
            # vLLM 0.32's Lfm2 reads
            "conv_dim": cfg.d_model,
            "block_dim": cfg.d_model,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.embedding_norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            layer = layers[indices[0]]
            mixer = short_conv_tensors(cfg, LAYER + "conv.") if layer.mixer == "short_conv" else None
            post_mixer, post_ffn = self.post_norm_tensors(cfg)
            specs = [
                TensorSpec(("attn_norm", "scale"), LAYER + "operator_norm.weight", None),
                *(self.attention_tensors(cfg) if mixer is None else mixer),
                *post_mixer,
                TensorSpec(("mlp_norm", "scale"), LAYER + "ffn_norm.weight", None),
                *self.feed_forward_tensors(cfg, layer),
                *post_ffn,
            ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        """An attention layer's q, k, v, out projections and QK norms (the input norm is operator_norm)."""
        attn = LAYER + "self_attn."
        return [
            TensorSpec(("attn", "wq_dnh"), attn + "q_proj.weight", 1),
            TensorSpec(("attn", "wk_dkh"), attn + "k_proj.weight", 1),
            TensorSpec(("attn", "wv_dkh"), attn + "v_proj.weight", 1),
            TensorSpec(("attn", "wo_nhd"), attn + "out_proj.weight", 2),
            TensorSpec(("attn", "q_norm", "scale"), attn + "q_layernorm.weight", None),
            TensorSpec(("attn", "k_norm", "scale"), attn + "k_layernorm.weight", None),
        ]

    def post_norm_tensors(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """The norms of the mixer's and the feed-forward's outputs (LFM3's sandwich norms); LFM2 has none."""
        return [], []

    def feed_forward_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        """The layer's feed-forward: the SwiGLU MLP (w1 gate, w3 up, w2 down)."""
        ff = LAYER + "feed_forward."
        return [
            TensorSpec(("mlp", "w_gate_df"), ff + "w1.weight", 1),
            TensorSpec(("mlp", "w_up_df"), ff + "w3.weight", 1),
            TensorSpec(("mlp", "w_down_fd"), ff + "w2.weight", 1),
        ]


@register_family
class Lfm2(_Lfm2Base):
    name = "lfm2"
    architecture = "Lfm2ForCausalLM"
    model_type = "lfm2"


@register_family
class Lfm2Moe(_Lfm2Base):
    """LFM2-MoE (LiquidAI/LFM2-8B-A1B; transformers' lfm2_moe): LFM2's layers whose feed-forward
    is, after num_dense_layers dense ones (an MLP of intermediate_size, unadjusted), a mixture of
    experts: sigmoid scores, the top k chosen by score + expert_bias (a buffer: it only chooses),
    their unbiased scores renormalised (norm_topk_prob) and scaled by routed_scaling_factor.
    transformers sums the chosen scores plus 1e-6 when renormalising, the engine without: a
    relative 1e-6 of k sigmoid scores, below float32's parity tolerance."""

    name = "lfm2_moe"
    architecture = "Lfm2MoeForCausalLM"
    model_type = "lfm2_moe"
    moe = True
    hf_defaults = {
        **_Lfm2Base.hf_defaults,
        "moe_intermediate_size": 1792,
        "num_dense_layers": 2,
        "num_experts_per_tok": 4,
        "num_experts": 32,
        "use_expert_bias": True,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
    }

    def mlp_width(self, hf: dict) -> int:
        return hf["intermediate_size"]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        return {
            "num_experts": self.hf_value(hf, "num_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "expert_mlp_dim": self.hf_value(hf, "moe_intermediate_size"),
            "router_score": "sigmoid",
            "router_bias": self.hf_value(hf, "use_expert_bias"),
            "router_renormalize": self.hf_value(hf, "norm_topk_prob"),
            "router_scale": float(self.hf_value(hf, "routed_scaling_factor")),
            "first_dense_layers": min(self.hf_value(hf, "num_dense_layers"), hf["num_hidden_layers"]),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        return {
            "intermediate_size": cfg.mlp.dim,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "num_dense_layers": cfg.moe.first_dense_layers,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "num_experts": cfg.moe.num_experts,
            "use_expert_bias": cfg.moe.router_bias,
            "routed_scaling_factor": cfg.moe.router_scale,
            "norm_topk_prob": cfg.moe.router_renormalize,
            "output_router_logits": False,
        }

    def feed_forward_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        if layer.ffn != "moe":
            return super().feed_forward_tensors(cfg, layer)
        ff = LAYER + "feed_forward."
        return [
            TensorSpec(("mlp", "w_router_de"), ff + "gate.weight", 1),
            *([TensorSpec(("mlp", "b_router_e"), ff + "expert_bias", None)] if cfg.moe.router_bias else []),
            *(
                TensorSpec(("mlp", w), ff + EXPERT + f"{x}.weight", 1, experts=True)
                for w, x in (("w_gate_edf", "w1"), ("w_up_edf", "w3"), ("w_down_efd", "w2"))
            ),
        ]


LFM3_KINDS = {"conv": "short_conv", "full_attention": "attention", "sliding_attention": "attention"}
LFM3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
}
"""transformers' default rope_parameters of LFM3, per layer type."""


@register_family
class Lfm3(_Lfm2Base):
    """LFM3 (LiquidAI/LFM3-*; transformers' lfm3): LFM2's short convolutions (7 taps by default)
    among attention layers of two kinds, sliding-window (plain RoPE of their own base,
    rope_local_theta) and global (`proportional` RoPE: the whole head's frequencies, the fastest
    half rotating), both with Qwen3's QK norm and a sigmoid gate per head from the layer's input
    (g_proj, ModelConfig.attention.head_gate); sandwich norms (post_operator_norm, post_ffn_norm:
    post_norms); an MLP of intermediate_size as it stands. Llama's o_proj, q_norm, k_norm names."""

    name = "lfm3"
    architecture = "Lfm3ForCausalLM"
    model_type = "lfm3"
    hf_defaults = {
        **_Lfm2Base.hf_defaults,
        "conv_L_cache": 7,
        "head_dim": 128,
        "sliding_window": 256,
        "use_sandwich_norm": True,
        "use_attention_gate": True,
    }
    layer_kinds = LFM3_KINDS

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("attention_bias"):
            raise ConfigError(f"{where}: attention_bias=true is not supported")
        layers = hf.get("num_hidden_layers")
        if hf.get("layer_types") is None and isinstance(layers, int):  # transformers' default pattern
            hf = {**hf, "layer_types": [self.default_type(i) for i in range(layers)]}
        return super().config_from_hf(hf, where)

    @staticmethod
    def default_type(i: int) -> str:
        return "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv"

    def mlp_width(self, hf: dict) -> int:
        return hf["intermediate_size"]

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or LFM3_ROPE
        local_theta, local_scaling = rope_from_hf(
            {"rope_theta": 10_000.0, **(rope.get("sliding_attention") or {})}, where
        )
        if local_scaling is not None:
            raise ConfigError(f"{where}: RoPE scaling of sliding-window layers is not supported")
        global_rope: dict[str, Any] = rope.get("full_attention") or {}
        scaling: dict[str, Any] | None = None
        if global_rope.get("rope_type") == "proportional":
            scaling = {
                "kind": "proportional",
                "factor": global_rope.get("factor", 1.0),
                "rotated_fraction": global_rope.get("partial_rotary_factor", 1.0),
            }
            theta = float(global_rope.get("rope_theta", 1_000_000.0))
        else:
            theta, scaling = rope_from_hf({"rope_theta": 1_000_000.0, **global_rope}, where)
        return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        where = f"config.json ({self.architecture})"
        types = hf["layer_types"]
        unknown = sorted(set(types) - set(LFM3_KINDS))
        if unknown or len(types) != hf["num_hidden_layers"]:
            raise ConfigError(
                f"{where}: layer_types must name {hf['num_hidden_layers']} layers of {', '.join(LFM3_KINDS)}"
            )
        local = [t == "sliding_attention" for t in types]
        kinds = [LFM3_KINDS[t] for t in types]
        return {
            "head_dim": self.hf_value(hf, "head_dim"),
            "mixer_pattern": shortest_period(kinds) if "short_conv" in kinds else None,
            "attention_pattern": ["local" if x else "global" for x in shortest_period(local)],
            "sliding_window": self.hf_value(hf, "sliding_window") if any(local) else None,
            "post_norms": self.hf_value(hf, "use_sandwich_norm"),
            "attention_head_gate": self.hf_value(hf, "use_attention_gate"),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        scaling = cfg.rope.scaling
        if scaling is not None and scaling.kind == "proportional":
            global_rope = {"rope_type": "proportional", "rope_theta": cfg.rope.theta}
            global_rope["partial_rotary_factor"] = scaling.rotated_fraction
            if scaling.factor != 1.0:
                global_rope["factor"] = scaling.factor
        else:
            global_rope = rope_parameters_to_hf(cfg.rope.theta, scaling)
        local = cfg.layer_is_local()
        kinds = [layer.mixer for layer in cfg.layer_pattern()]
        return {
            "intermediate_size": cfg.mlp.dim,
            "head_dim": cfg.attention.head_dim,
            "layer_types": [
                "conv" if kind == "short_conv" else "sliding_attention" if local[i] else "full_attention"
                for i, kind in enumerate(kinds)
            ],
            "sliding_window": cfg.attention.sliding_window or self.hf_defaults["sliding_window"],
            "rope_parameters": {
                "sliding_attention": rope_parameters_to_hf(cfg.rope.local_theta or 10_000.0, None),
                "full_attention": global_rope,
            },
            "use_sandwich_norm": cfg.block.post_norms,
            "use_attention_gate": cfg.attention.head_gate,
            "attention_bias": False,
            "attention_dropout": 0.0,
        }

    def attention_tensors(self, cfg: ModelConfig) -> list[TensorSpec]:
        attn = LAYER + "self_attn."
        return [
            TensorSpec(("attn", "wq_dnh"), attn + "q_proj.weight", 1),
            TensorSpec(("attn", "wk_dkh"), attn + "k_proj.weight", 1),
            TensorSpec(("attn", "wv_dkh"), attn + "v_proj.weight", 1),
            TensorSpec(("attn", "wo_nhd"), attn + "o_proj.weight", 2),
            TensorSpec(("attn", "q_norm", "scale"), attn + "q_norm.weight", None),
            TensorSpec(("attn", "k_norm", "scale"), attn + "k_norm.weight", None),
            *(
                [TensorSpec(("attn", "w_head_gate_dn"), attn + "gate_proj.weight", 1)]
                if cfg.attention.head_gate
                else []
            ),
        ]

    def post_norm_tensors(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        if not cfg.block.post_norms:
            return [], []
        return (
            [TensorSpec(("post_attn_norm", "scale"), LAYER + "post_operator_norm.weight", None)],
            [TensorSpec(("post_mlp_norm", "scale"), LAYER + "post_ffn_norm.weight", None)],
        )

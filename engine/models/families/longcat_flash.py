"""Meituan's LongCat-Flash (LongcatFlashForCausalLM, model_type longcat_flash;
meituan-longcat/LongCat-Flash-Chat): pairs of DeepSeek-V3 latent-attention layers with
shortcut-connected experts and zero-computation experts.

Each of its num_layers layers is two engine layers (ModelConfig.num_layers = 2 * num_layers),
each a latent attention (engine/models/mla.py) and a dense MLP of ffn_hidden_size: the first
also runs the mixture of experts on its MLP's input, and the experts' output joins the stream
at the end of the second (ModelConfig.block.shortcut_moe; the decoder carries it beside the
stream). The router scores n_routed_experts + zero_expert_num experts by a softmax of its
logits, chooses moe_topk of them by those scores plus a choosing bias, weights them by their
scores times routed_scaling_factor (not renormalised); a chosen zero expert adds its weight
times the token itself (moe.zero_experts). The latent attention scales its queries by
sqrt(hidden_size / q_lora_rank) and its normed latent by sqrt(hidden_size / kv_lora_rank)
(mla.lora_scale) and rotates adjacent pairs.

Checkpoints name the first engine layer's parts `model.layers.{i}.self_attn.0`, `mlps.0`,
`input_layernorm.0`, `post_attention_layernorm.0` and the experts `mlp.experts.{j}`,
`mlp.router.classifier`, `mlp.router.e_score_correction_bias`; the second's `.1`. The
multi-token-prediction weights (`model.mtp.*`, which transformers skips) are skipped.
Refused in one sentence: `router_bias` (the classifier's bias, which transformers' router never adds).
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import EXPERT, Family, TensorSpec, register_family


class _Pair(str):
    """A per-layer tensor name whose `{i}` is the checkpoint's layer of the engine layer i:
    engine layers 2i and 2i + 1 are the two halves of the checkpoint's layer i."""

    __slots__ = ()

    def format(self, *args, **kwargs) -> str:
        if "i" in kwargs:
            kwargs = {**kwargs, "i": kwargs["i"] // 2}
        return str(self).format(*args, **kwargs)


_LAYER = "model.layers.{i}."
_MLP = (("gate", "df"), ("up", "df"), ("down", "fd"))
_ROUTER = _LAYER + "mlp.router."


def _half(stack: str, k: int, experts: bool) -> list[TensorSpec]:
    """The tensors of half k (0 or 1) of a checkpoint layer, the engine layers of `stack`."""
    attn = f"self_attn.{k}."
    names = [
        (("attn_norm", "scale"), f"input_layernorm.{k}.weight", None),
        (("attn", "wq_a_dq"), attn + "q_a_proj.weight", 1),
        (("attn", "q_norm", "scale"), attn + "q_a_layernorm.weight", None),
        (("attn", "wq_b_qnh"), attn + "q_b_proj.weight", 1),
        (("attn", "wkv_a_dx"), attn + "kv_a_proj_with_mqa.weight", 1),
        (("attn", "kv_norm", "scale"), attn + "kv_a_layernorm.weight", None),
        (("attn", "wkv_b_cny"), attn + "kv_b_proj.weight", 1),
        (("attn", "wo_nwd"), attn + "o_proj.weight", 2),
        (("mlp_norm", "scale"), f"post_attention_layernorm.{k}.weight", None),
        *((("mlp", f"w_{x}_{dims}"), f"mlps.{k}.{x}_proj.weight", 1) for x, dims in _MLP),
    ]
    specs = [TensorSpec(path, _Pair(_LAYER + name), in_dims, stack=stack) for path, name, in_dims in names]
    if experts:
        specs += [
            TensorSpec(("shortcut", "w_router_de"), _Pair(_ROUTER + "classifier.weight"), 1, stack=stack),
            TensorSpec(("shortcut", "b_router_e"), _Pair(_ROUTER + "e_score_correction_bias"), None, stack=stack),
            *(
                TensorSpec(
                    ("shortcut", f"w_{x}_{dims}"),
                    _Pair(_LAYER + "mlp." + EXPERT + f"{x}_proj.weight"),
                    1,
                    experts=True,
                    stack=stack,
                )
                for x, dims in (("gate", "edf"), ("up", "edf"), ("down", "efd"))
            ),
        ]
    return specs


@register_family
class LongcatFlash(Family):
    name = "longcat_flash"
    architecture = "LongcatFlashForCausalLM"
    model_type = "longcat_flash"
    moe = True
    fixed = {
        "router_score": "softmax",
        "router_bias": True,
        "router_renormalize": False,
        "rope_interleave": True,
        "mla_lora_scale": True,
        "num_shared_experts": 0,
        "first_dense_layers": 0,
        "ffn_pattern": ["moe", "mlp"],
        "shortcut_moe": True,
    }
    hf_defaults = {
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10_000_000.0,
        "ffn_hidden_size": 12288,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "moe_topk": 12,
        "n_routed_experts": 512,
        "zero_expert_num": 256,
        "expert_ffn_hidden_size": 2048,
        "routed_scaling_factor": 6.0,
    }
    unsupported_flags = ("attention_bias", "router_bias")
    hf_constants = {"attention_bias": False, "output_router_logits": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("num_layers") is None and hf.get("num_hidden_layers") is not None:  # transformers' setter
            hf = {**hf, "num_layers": hf["num_hidden_layers"] // 2}
        if hf.get("num_layers") is None:
            raise ConfigError(f"{where}: missing key 'num_layers'")
        if hf.get("router_bias"):
            raise ConfigError(f"{where}: router_bias=true is not supported (transformers' router never adds it)")
        pairs = {"num_hidden_layers": 2 * hf["num_layers"], "intermediate_size": self.hf_value(hf, "ffn_hidden_size")}
        return super().config_from_hf({**hf, **pairs}, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        nope, rope = self.hf_value(hf, "qk_nope_head_dim"), self.hf_value(hf, "qk_rope_head_dim")
        value_dim = self.hf_value(hf, "v_head_dim")
        return {
            "num_kv_heads": hf["num_attention_heads"],
            "head_dim": nope + rope,
            "rope_head_dim": rope,
            "v_head_dim": None if value_dim == nope + rope else value_dim,
            "kv_lora_rank": self.hf_value(hf, "kv_lora_rank"),
            "q_lora_rank": self.hf_value(hf, "q_lora_rank"),
            "num_experts": self.hf_value(hf, "n_routed_experts"),
            "experts_per_token": self.hf_value(hf, "moe_topk"),
            "expert_mlp_dim": self.hf_value(hf, "expert_ffn_hidden_size"),
            "zero_experts": self.hf_value(hf, "zero_expert_num") or 0,
            "router_scale": float(self.hf_value(hf, "routed_scaling_factor")),
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        del hf["intermediate_size"], hf["num_hidden_layers"]  # LongcatFlashConfig's keys are below
        return hf

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        rope = cfg.mla.rope_head_dim
        return {
            "num_layers": cfg.num_layers // 2,
            "ffn_hidden_size": cfg.mlp.dim,
            "head_dim": rope,
            "qk_head_dim": cfg.attention.head_dim,
            "qk_nope_head_dim": cfg.attention.head_dim - rope,
            "qk_rope_head_dim": rope,
            "v_head_dim": cfg.value_head_dim,
            "kv_lora_rank": cfg.mla.kv_lora_rank,
            "q_lora_rank": cfg.mla.q_lora_rank,
            "n_routed_experts": cfg.moe.num_experts,
            "moe_topk": cfg.moe.experts_per_token,
            "expert_ffn_hidden_size": cfg.moe_mlp_dim,
            "zero_expert_num": cfg.moe.zero_experts,
            "routed_scaling_factor": cfg.moe.router_scale,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        layers = cfg.layer_pattern()
        per_layer = []
        for stack, indices in cfg.layer_stacks():
            experts = layers[indices[0]].ffn == "moe"  # the first half of each pair
            per_layer += _half(stack, 0 if experts else 1, experts)
        return top, per_layer

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return name.startswith("model.mtp.")  # the multi-token-prediction weights (transformers skips them)

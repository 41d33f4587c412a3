"""Kimi Linear (moonshotai/Kimi-Linear-48B-A3B-*; transformers' kimi_linear): Kimi Delta
Attention layers (engine/models/kimi_delta_block.py, the `kimi_delta` mixer kind) interleaved
with multi-head latent attention layers without RoPE (engine/models/mla.py, rope_pattern
[false]: the delta layers carry position), each layer's feed-forward a dense MLP (the first
ones) or DeepSeek-V3's mixture of experts: sigmoid router with a score-correction bias,
group-limited top-k, renormalised and scaled weights, shared experts.

transformers names the layer kinds in `layer_types` (published config.json files:
`linear_attn_config`'s 1-based `kda_layers` / `full_attn_layers`) and the feed-forward kinds
in `mlp_layer_types` (published: `first_k_dense_replace`). Tensors sit under `block_sparse_moe.`
(experts w1 gate, w3 up, w2 down) and each of q, k, v has its own short convolution.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import EXPERT, LAYER, Family, TensorSpec, register_family, shortest_period

KINDS = {"linear_attention": "kimi_delta", "full_attention": "attention"}
"""layer_types -> ModelConfig.mixer_pattern's kinds (attention: MLA here)."""
MOE = LAYER + "block_sparse_moe."


def _kimi_delta() -> list[TensorSpec]:
    attn = LAYER + "self_attn."
    return [
        TensorSpec(("attn", "wq_dhk"), attn + "q_proj.weight", 1),
        TensorSpec(("attn", "wk_dhk"), attn + "k_proj.weight", 1),
        TensorSpec(("attn", "wv_dhk"), attn + "v_proj.weight", 1),
        TensorSpec(("attn", "conv_q_c1k"), attn + "q_conv1d.weight", None),
        TensorSpec(("attn", "conv_k_c1k"), attn + "k_conv1d.weight", None),
        TensorSpec(("attn", "conv_v_c1k"), attn + "v_conv1d.weight", None),
        TensorSpec(("attn", "a_log_11h1"), attn + "A_log", None),
        TensorSpec(("attn", "dt_bias_x"), attn + "dt_bias", None),
        TensorSpec(("attn", "w_fa_dk"), attn + "f_a_proj.weight", 1),
        TensorSpec(("attn", "w_fb_khk"), attn + "f_b_proj.weight", 1),
        TensorSpec(("attn", "w_b_dh"), attn + "b_proj.weight", 1),
        TensorSpec(("attn", "w_ga_dk"), attn + "g_a_proj.weight", 1),
        TensorSpec(("attn", "w_gb_khk"), attn + "g_b_proj.weight", 1),
        TensorSpec(("attn", "norm_k"), attn + "o_norm.weight", None),
        TensorSpec(("attn", "wo_hkd"), attn + "o_proj.weight", 2),
    ]


def _mla(q_lora: bool) -> list[TensorSpec]:
    """The latent attention's tensors; the query through a low-rank projection where the config
    sets q_lora_rank (the published Kimi Linear has none), as DeepSeek's."""
    attn = LAYER + "self_attn."
    if q_lora:
        query = [
            TensorSpec(("attn", "wq_a_dq"), attn + "q_a_proj.weight", 1),
            TensorSpec(("attn", "q_norm", "scale"), attn + "q_a_layernorm.weight", None),
            TensorSpec(("attn", "wq_b_qnh"), attn + "q_b_proj.weight", 1),
        ]
    else:
        query = [TensorSpec(("attn", "wq_dnh"), attn + "q_proj.weight", 1)]
    return [
        *query,
        TensorSpec(("attn", "wkv_a_dx"), attn + "kv_a_proj_with_mqa.weight", 1),
        TensorSpec(("attn", "kv_norm", "scale"), attn + "kv_a_layernorm.weight", None),
        TensorSpec(("attn", "wkv_b_cny"), attn + "kv_b_proj.weight", 1),
        TensorSpec(("attn", "wo_nwd"), attn + "o_proj.weight", 2),
    ]


def _dense_mlp() -> list[TensorSpec]:
    return [
        TensorSpec(("mlp", f"w_{x}_{dims}"), MOE + f"{x}_proj.weight", 1)
        for x, dims in (("gate", "df"), ("up", "df"), ("down", "fd"))
    ]


def _experts() -> list[TensorSpec]:
    return [
        TensorSpec(("mlp", "w_router_de"), MOE + "gate.weight", 1),
        TensorSpec(("mlp", "b_router_e"), MOE + "gate.e_score_correction_bias", None),
        *(
            TensorSpec(("mlp", f"w_{x}_{dims}"), MOE + EXPERT + f"{w}.weight", 1, experts=True)
            for x, dims, w in (("gate", "edf", "w1"), ("up", "edf", "w3"), ("down", "efd", "w2"))
        ),
        *(
            TensorSpec(("mlp", f"w_shared_{x}_{dims}"), MOE + f"shared_experts.{x}_proj.weight", 1)
            for x, dims in (("gate", "dg"), ("up", "dg"), ("down", "gd"))
        ),
    ]


@register_family
class KimiLinear(Family):
    name = "kimi_linear"
    architecture = "KimiLinearForCausalLM"
    model_type = "kimi_linear"
    moe = True
    fixed = {"router_score": "sigmoid", "router_bias": True, "rope_pattern": [False]}
    hf_defaults = {
        "vocab_size": 163840,
        "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "moe_intermediate_size": 1024,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.446,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "num_expert_group": 1,
        "topk_group": 1,
        "moe_renormalize": True,
        "linear_head_dim": 128,
        "linear_num_heads": 32,
        "linear_conv_kernel_dim": 4,
    }
    unsupported_flags = ("attention_bias",)
    hf_constants = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "use_cache": True,
        "pretraining_tp": 1,
        "output_router_logits": False,
    }
    ALIASES = {  # older / transformers' own config.json keys -> the ones transformers 5 writes
        "max_position_embeddings": "model_max_length",
        "norm_topk_prob": "moe_renormalize",
        "n_group": "num_expert_group",
        "num_local_experts": "num_experts",
        "n_routed_experts": "num_experts",
        "num_experts_per_tok": "num_experts_per_token",
        "n_shared_experts": "num_shared_experts",
    }

    def layer_kinds(self, hf: dict, layers: int, where: str) -> tuple[list[str], list[str]]:
        """(layer_types, mlp_layer_types) as transformers' KimiLinearConfig reads them."""
        linear = hf.get("linear_attn_config") or {}
        types = hf.get("layer_types")
        if types is None and "full_attn_layers" in linear and "kda_layers" in linear:
            types = [""] * layers
            for i in linear["full_attn_layers"]:
                types[i - 1] = "full_attention"  # 1-based in published checkpoints
            for i in linear["kda_layers"]:
                types[i - 1] = "linear_attention"
        if types is None:  # transformers' default: attention every 4th layer from the 5th
            types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
        if len(types) != layers or set(types) - set(KINDS):
            raise ConfigError(f"{where}: layer_types must name {layers} layers of {', '.join(KINDS)}")
        mlp = hf.get("mlp_layer_types")
        if mlp is None:
            dense = hf.get("first_k_dense_replace", 1)
            mlp = ["dense" if i < dense else "sparse" for i in range(layers)]
        if len(mlp) != layers or set(mlp) - {"dense", "sparse"}:
            raise ConfigError(f"{where}: mlp_layer_types must name {layers} layers of dense, sparse")
        return types, mlp

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        hf = {**hf, **{new: hf[old] for old, new in self.ALIASES.items() if hf.get(old) is not None}}
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            if hf.get(key) is None:
                raise ConfigError(f"{where}: missing key '{key}'")
        for key in self.unsupported_flags:
            if hf.get(key):
                raise ConfigError(f"{where}: {key}=true is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act '{hf['hidden_act']}' is not supported (silu)")
        if hf.get("mla_use_nope") is False:
            raise ConfigError(f"{where}: mla_use_nope=false (RoPE on the latent attention) is not supported")
        linear = hf.get("linear_attn_config") or {}
        layers = hf["num_hidden_layers"]
        types, mlp = self.layer_kinds(hf, layers, where)
        sparse = [t == "sparse" for t in mlp]
        leading = sparse.index(True) if any(sparse) else layers
        ffn = {}
        if not all(sparse[leading:]):  # dense layers after the first expert layer: one entry per layer
            ffn = {"ffn_pattern": ["moe" if s else "mlp" for s in sparse]}
        nope, rope = self.hf_value(hf, "qk_nope_head_dim"), self.hf_value(hf, "qk_rope_head_dim")
        value_dim, heads = self.hf_value(hf, "v_head_dim"), hf["num_attention_heads"]
        linear_heads = linear.get("num_heads") or self.hf_value(hf, "linear_num_heads")
        linear_dim = linear.get("head_dim") or self.hf_value(hf, "linear_head_dim")
        kernel = linear.get("short_conv_kernel_size") or self.hf_value(hf, "linear_conv_kernel_dim")
        return {
            "family": self.name,
            "vocab_size": self.hf_value(hf, "vocab_size"),
            "d_model": hf["hidden_size"],
            "num_layers": layers,
            "num_heads": heads,
            "num_kv_heads": heads,  # latent attention: no key-value heads
            "head_dim": nope + rope,
            "rope_head_dim": rope,
            "v_head_dim": None if value_dim == nope + rope else value_dim,
            "kv_lora_rank": self.hf_value(hf, "kv_lora_rank"),
            "q_lora_rank": hf.get("q_lora_rank"),
            "mlp_dim": hf["intermediate_size"],
            # transformers saves it as model_max_length (its attribute_map); older files name it
            # max_position_embeddings; neither: transformers' default
            "max_seq_len": hf.get("model_max_length") or self.hf_value(hf, "max_position_embeddings"),
            "norm_eps": self.hf_value(hf, "rms_norm_eps"),
            "tie_embeddings": self.hf_value(hf, "tie_word_embeddings"),
            "init_std": self.hf_value(hf, "initializer_range"),
            "mixer_pattern": shortest_period([KINDS[t] for t in types]),
            "gated_delta": {
                "num_key_heads": linear_heads,
                "num_value_heads": linear_heads,
                "key_head_dim": linear_dim,
                "value_head_dim": linear_dim,
                "conv_kernel": kernel,
            },
            "num_experts": self.hf_value(hf, "num_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_token"),
            "expert_mlp_dim": self.hf_value(hf, "moe_intermediate_size"),
            "num_shared_experts": self.hf_value(hf, "num_shared_experts"),
            "router_renormalize": bool(self.hf_value(hf, "moe_renormalize")),
            "router_groups": self.hf_value(hf, "num_expert_group"),
            "router_group_top": self.hf_value(hf, "topk_group"),
            "router_scale": float(self.hf_value(hf, "routed_scaling_factor")),
            "first_dense_layers": 0 if ffn else leading,
            **ffn,
            **self.fixed,
        }

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        gd = cfg.gated_delta
        assert gd is not None and cfg.mla.kv_lora_rank is not None
        kinds = {"kimi_delta": "linear_attention", "mla": "full_attention"}
        layers = cfg.layer_pattern()
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.d_model,
            "intermediate_size": cfg.mlp.dim,
            "moe_intermediate_size": cfg.moe_mlp_dim,
            "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.attention.num_heads,
            "num_key_value_heads": cfg.attention.num_kv_heads,
            "head_dim": cfg.mla.rope_head_dim,  # as transformers writes them
            "qk_head_dim": cfg.attention.head_dim,
            "qk_nope_head_dim": cfg.attention.head_dim - cfg.mla.rope_head_dim,
            "qk_rope_head_dim": cfg.mla.rope_head_dim,
            "v_head_dim": cfg.value_head_dim,
            "kv_lora_rank": cfg.mla.kv_lora_rank,
            "q_lora_rank": cfg.mla.q_lora_rank,
            "model_max_length": cfg.max_seq_len,
            "rms_norm_eps": cfg.norm.eps,
            "initializer_range": cfg.init_std,
            "tie_word_embeddings": cfg.tie_embeddings,
            "layer_types": [kinds[layer.mixer] for layer in layers],
            "mlp_layer_types": ["sparse" if layer.ffn == "moe" else "dense" for layer in layers],
            "linear_num_heads": gd.num_key_heads,
            "linear_head_dim": gd.key_head_dim,
            "linear_conv_kernel_dim": gd.conv_kernel,
            "num_experts": cfg.moe.num_experts,
            "num_experts_per_token": cfg.moe.experts_per_token,
            "num_shared_experts": cfg.moe.num_shared_experts,
            "moe_renormalize": cfg.moe.router_renormalize,
            "num_expert_group": cfg.moe.router_groups,
            "topk_group": cfg.moe.router_group_top,
            "routed_scaling_factor": cfg.moe.router_scale,
            **self.hf_constants,
        }

    embedding_name = "model.embed_tokens.weight"

    def mixer_and_ffn_tensors(self, cfg: ModelConfig, layer) -> tuple[list[TensorSpec], list[TensorSpec]]:
        """A layer's mixer and feed-forward tensors (the norms around them are the table's)."""
        mixer = _kimi_delta() if layer.mixer == "kimi_delta" else _mla(cfg.mla.q_lora_rank is not None)
        return mixer, _experts() if layer.ffn == "moe" else _dense_mlp()

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), self.embedding_name, None),
            TensorSpec(("final_norm", "scale"), "model.norm.weight", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "lm_head.weight", 1))
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            mixer, ffn = self.mixer_and_ffn_tensors(cfg, layers[indices[0]])
            specs = [
                TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
                *mixer,
                TensorSpec(("mlp_norm", "scale"), LAYER + "post_attention_layernorm.weight", None),
                *ffn,
            ]
            per_layer += [dataclasses.replace(spec, stack=stack) for spec in specs]
        return top, per_layer

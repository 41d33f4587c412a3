"""DeepSeek-V4 (DeepseekV4ForCausalLM; V4-Flash and V4-Pro, arXiv 2512.24880).

Every layer: DeepSeek-V4's attention (engine/models/compressed_attention.py: one shared
key-value head through a sliding window, beside CSA's or HCA's compressed entries per
`layer_types`), a mixture of experts (sqrt(softplus) router scores with a choosing bias,
clamped SwiGLU experts and shared expert; the first layers hash-routed, `mlp_layer_types`
hash_moe, engine/models/hash_routing.py) and n residual streams (hyper_connection.py).
Tensors are named as DeepSeek publishes them and transformers saves them (`attn.wq_a`,
`ffn.experts.{j}.w1`, `hc_attn_fn`, ...; its conversion mapping renames them on loading).
The multi-token-prediction modules published checkpoints carry (`mtp.{k}.*`, which
transformers' class does not build; num_nextn_predict_layers) are converted, trained under
ComputeConfig.mtp_loss and exported as DeepSeek publishes them (its inference/model.py
MTPBlock, engine/models/mtp.py): a layer of the sliding_attention kind (its compress ratio 0)
with scored experts, `e_proj`/`h_proj`, `enorm`/`hnorm`, its own streams' mix (`hc_head_fn`,
`hc_head_base`, `hc_head_scale`) and norm (`norm`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import EXPERT, LAYER, Family, TensorSpec, register_family, rope_from_hf, rope_to_hf

MTP = "mtp.{k}."
"""The published multi-token-prediction module k's names (its layer's as the decoder's, from `attn.`)."""

ATTENTION_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def _attention(stack: str, kind: str) -> list[TensorSpec]:
    attn = LAYER + "attn."
    specs = [
        TensorSpec(("attn", "wq_a_dq"), attn + "wq_a.weight", 1),
        TensorSpec(("attn", "q_norm_q"), attn + "q_norm.weight", None),
        TensorSpec(("attn", "wq_b_qnh"), attn + "wq_b.weight", 1),
        TensorSpec(("attn", "wkv_dh"), attn + "wkv.weight", 1),
        TensorSpec(("attn", "kv_norm_h"), attn + "norm.weight", None),
        TensorSpec(("attn", "wo_a_igr"), attn + "wo_a.weight", 1),
        TensorSpec(("attn", "wo_b_xd"), attn + "wo_b.weight", 1),
        TensorSpec(("attn", "sinks_n"), attn + "attn_sink", None),
    ]
    compressors = {"sliding_attention": [], "heavily_compressed_attention": [("compressor", attn + "compressor.")]}
    for name, prefix in compressors.get(
        kind, [("compressor", attn + "compressor."), ("indexer", attn + "indexer.compressor.")]
    ):
        specs += [
            TensorSpec(("attn", name, "w_kv_dc"), prefix + "wkv.weight", 1),
            TensorSpec(("attn", name, "w_gate_dc"), prefix + "wgate.weight", 1),
            TensorSpec(("attn", name, "b_pos_mc"), prefix + "ape", None),
            TensorSpec(("attn", name, "norm_h"), prefix + "norm.weight", None),
        ]
    if kind == "compressed_sparse_attention":
        specs += [
            TensorSpec(("attn", "wi_q_qgi"), attn + "indexer.wq_b.weight", 1),
            TensorSpec(("attn", "wi_weights_dg"), attn + "indexer.weights_proj.weight", 1),
        ]
    return [dataclasses.replace(spec, stack=stack) for spec in specs]


def _layer_rest(stack: str, hashed: bool) -> list[TensorSpec]:
    """The norms, hyper-connections and experts of a layer of `stack`."""
    ffn, shared = LAYER + "ffn.", LAYER + "ffn.shared_experts."
    choice = ("hash_experts_vk", "gate.tid2eid") if hashed else ("b_router_e", "gate.bias")
    specs = [
        TensorSpec(("attn_norm", "scale"), LAYER + "attn_norm.weight", None),
        TensorSpec(("mlp_norm", "scale"), LAYER + "ffn_norm.weight", None),
        *(
            TensorSpec((hc, name), LAYER + f"hc_{hc[:-3]}_{hf}", in_dims)
            for hc in ("attn_hc", "ffn_hc")
            for name, hf, in_dims in (("w_mix_xm", "fn", 1), ("b_mix_m", "base", None), ("scale_3", "scale", None))
        ),
        TensorSpec(("mlp", "w_router_de"), ffn + "gate.weight", 1),
        TensorSpec(("mlp", choice[0]), ffn + choice[1], None),
        *(
            TensorSpec(("mlp", f"w_{x}_{dims}"), ffn + EXPERT + f"{w}.weight", 1, experts=True)
            for x, dims, w in (("gate", "edf", "w1"), ("up", "edf", "w3"), ("down", "efd", "w2"))
        ),
        *(
            TensorSpec(("mlp", f"w_shared_{x}_{dims}"), shared + f"{w}.weight", 1)
            for x, dims, w in (("gate", "dg", "w1"), ("up", "dg", "w3"), ("down", "gd", "w2"))
        ),
    ]
    return [dataclasses.replace(spec, stack=stack) for spec in specs]


@register_family
class DeepseekV4(Family):
    name = "deepseek_v4"
    architecture = "DeepseekV4ForCausalLM"
    model_type = "deepseek_v4"
    moe = True
    fixed = {
        "router_score": "sqrtsoftplus",
        "router_bias": True,
        "mixer_pattern": ["compressed_attention"],
        "swiglu_shift": 0.0,
        "swiglu_alpha": 1.0,
        "num_kv_heads": 1,  # one shared key-value head, whatever num_key_value_heads says (transformers')
        "num_shared_experts": 1,
    }
    hf_defaults = {
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": 10.0,
        "sliding_window": 128,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "hc_mult": 4,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6,
        "q_lora_rank": 1024,
    }
    unsupported_flags: ClassVar[tuple[str, ...]] = ("attention_bias", "mlp_bias")
    hf_constants = {
        "attention_bias": False,
        "mlp_bias": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if self.hf_value(hf, "scoring_func") != "sqrtsoftplus":
            raise ConfigError(f"{where}: scoring_func {hf['scoring_func']!r} is not supported (sqrtsoftplus)")
        # the shared expert's width is transformers' intermediate_size, an alias of moe_intermediate_size
        hf = {**hf, "intermediate_size": hf.get("moe_intermediate_size") or 2048}
        return super().config_from_hf(hf, where)

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        rope = hf.get("rope_parameters") or {}
        main = rope.get("main") or {"rope_theta": self.hf_value(hf, "rope_theta")}
        theta, scaling = rope_from_hf({k: v for k, v in main.items() if k != "partial_rotary_factor"}, where)
        if scaling is not None:
            raise ConfigError(f"{where}: rope_parameters.main must be default RoPE (the sliding layers')")
        return {"rope_theta": theta, "rope_scaling": None}

    def _compress_rope(self, hf: dict, where: str) -> tuple[float, dict | None]:
        rope = hf.get("rope_parameters") or {}
        compress = rope.get("compress")
        if compress is None:  # flat rope_parameters / rope_scaling: YaRN's keys for the compressed layers
            flat = {k: v for k, v in (hf.get("rope_scaling") or rope).items() if k not in ("main", "compress")}
            compress = {**flat, "rope_theta": self.hf_value(hf, "compress_rope_theta")}
        params = {k: v for k, v in compress.items() if k not in ("partial_rotary_factor", "attention_factor")}
        params.setdefault("original_max_position_embeddings", self.hf_value(hf, "max_position_embeddings"))
        if params.get("rope_type", "default") == "default":
            params.pop("original_max_position_embeddings")
        return rope_from_hf({"max_position_embeddings": self.hf_value(hf, "max_position_embeddings"), **params}, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        where = "config.json"
        n = hf["num_hidden_layers"]
        types = hf.get("layer_types") or (["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention" for i in range(max(n - 2, 0))
        ])  # fmt: skip
        unknown = sorted(set(types) - set(ATTENTION_KINDS))
        if unknown or len(types) != n:
            raise ConfigError(f"{where}: layer_types must list one of {ATTENTION_KINDS} per layer")
        mlp_types = hf.get("mlp_layer_types") or ["hash_moe"] * min(n, 3) + ["moe"] * max(n - 3, 0)
        hashed = mlp_types.count("hash_moe")
        if mlp_types != ["hash_moe"] * hashed + ["moe"] * (n - hashed):
            raise ConfigError(f"{where}: mlp_layer_types must be hash_moe layers first, then moe")
        head_dim = hf.get("head_dim") or 512
        factor = hf.get("partial_rotary_factor") or 64 / 512
        rates = {
            "compressed_sparse_attention": 4,
            "heavily_compressed_attention": 128,
            **(hf.get("compress_rates") or {}),
        }
        theta, scaling = self._compress_rope(hf, where)
        return {
            "mlp_dim": hf.get("moe_intermediate_size") or 2048,
            "num_experts": self.hf_value(hf, "n_routed_experts"),
            "experts_per_token": self.hf_value(hf, "num_experts_per_tok"),
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
            "router_scale": float(self.hf_value(hf, "routed_scaling_factor")),
            "swiglu_limit": float(self.hf_value(hf, "swiglu_limit")),
            "hash_layers": hashed,
            "compressed_attention": {
                "layer_types": types,
                "csa_ratio": rates["compressed_sparse_attention"],
                "hca_ratio": rates["heavily_compressed_attention"],
                "window": self.hf_value(hf, "sliding_window"),
                "q_lora_rank": self.hf_value(hf, "q_lora_rank"),
                "rope_head_dim": int(head_dim * factor),
                "out_groups": self.hf_value(hf, "o_groups"),
                "out_rank": self.hf_value(hf, "o_lora_rank"),
                "index_topk": self.hf_value(hf, "index_topk"),
                "index_heads": self.hf_value(hf, "index_n_heads"),
                "index_head_dim": self.hf_value(hf, "index_head_dim"),
                "compress_rope_theta": theta,
                "compress_rope_scaling": scaling,
            },
            "hyper_connections": {
                "streams": self.hf_value(hf, "hc_mult"),
                "iterations": self.hf_value(hf, "hc_sinkhorn_iters"),
                "eps": float(self.hf_value(hf, "hc_eps")),
            },
            **self.mtp_fields(None, hf.get("num_nextn_predict_layers", 1)),  # transformers' default: one
        }

    def mtp_fields(self, cfg: ModelConfig | None, modules: int) -> dict[str, Any]:
        return {"mtp_layers": modules, "mtp_layer_kind": {"local": True, "ffn": "moe"} if modules else None}

    def mtp_prefix(self, cfg: ModelConfig, depth: int) -> str:
        return f"mtp.{depth}."

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().config_to_hf(cfg)
        for key in ("intermediate_size", "rope_scaling"):
            hf.pop(key)
        return hf

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        ca, hc = cfg.compressed_attention, cfg.hyper_connections
        assert ca is not None and hc is not None
        factor = ca.rope_head_dim / cfg.attention.head_dim
        compress = {**(rope_to_hf(ca.compress_rope_scaling) or {"rope_type": "default"})}
        compress.update({"rope_theta": ca.compress_rope_theta, "partial_rotary_factor": factor})
        if compress["rope_type"] == "yarn":
            compress["attention_factor"] = 1.0
        return {
            "moe_intermediate_size": cfg.mlp.dim,
            "n_routed_experts": cfg.moe.num_experts,
            "num_experts_per_tok": cfg.moe.experts_per_token,
            "norm_topk_prob": cfg.moe.router_renormalize,
            "routed_scaling_factor": cfg.moe.router_scale,
            "swiglu_limit": cfg.moe.swiglu_limit,
            "layer_types": list(ca.layer_types),
            "compress_rates": {
                "compressed_sparse_attention": ca.csa_ratio,
                "heavily_compressed_attention": ca.hca_ratio,
            },
            "compress_rope_theta": ca.compress_rope_theta,
            "mlp_layer_types": ["hash_moe"] * cfg.moe.hash_layers + ["moe"] * (cfg.num_layers - cfg.moe.hash_layers),
            "sliding_window": ca.window,
            "q_lora_rank": ca.q_lora_rank,
            "o_groups": ca.out_groups,
            "o_lora_rank": ca.out_rank,
            "index_n_heads": ca.index_heads,
            "index_head_dim": ca.index_head_dim,
            "index_topk": ca.index_topk,
            "hc_mult": hc.streams,
            "hc_sinkhorn_iters": hc.iterations,
            "hc_eps": hc.eps,
            "num_nextn_predict_layers": cfg.mtp_layers,
            "partial_rotary_factor": factor,
            "qk_rope_head_dim": ca.rope_head_dim,
            "rope_parameters": {
                "main": {"rope_type": "default", "rope_theta": cfg.rope.theta, "partial_rotary_factor": factor},
                "compress": compress,
            },
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top = [
            TensorSpec(("embed_vd",), "model.embed_tokens.weight", None),
            TensorSpec(("final_norm", "scale"), "model.norm.weight", None),
            TensorSpec(("hc_head", "w_mix_xn"), "model.hc_head.hc_fn", 1),
            TensorSpec(("hc_head", "b_mix_n"), "model.hc_head.hc_base", None),
            TensorSpec(("hc_head", "scale_1"), "model.hc_head.hc_scale", None),
        ]
        if not cfg.tie_embeddings:
            top.append(TensorSpec(("lm_head_dv",), "head.weight", 1))
        layers, per_layer = cfg.layer_pattern(), []
        for stack, indices in cfg.layer_stacks():
            layer = layers[indices[0]]
            assert layer.compressed is not None
            per_layer += _attention(stack, layer.compressed) + _layer_rest(stack, layer.hashed)
        if cfg.mtp_layers:  # DeepSeek's names under mtp.{k}.: a sliding_attention layer, then its own
            layer = cfg.mtp_layer()
            assert layer.compressed is not None
            for spec in _attention(layer.stack, layer.compressed) + _layer_rest(layer.stack, False):
                per_layer.append(dataclasses.replace(spec, hf_name=spec.hf_name.replace(LAYER, MTP)))
            for k, name in enumerate(cfg.mtp_head_names()):
                mtp = MTP.format(k=k)
                top += [
                    TensorSpec((name, "enorm", "scale"), mtp + "enorm.weight", None),
                    TensorSpec((name, "hnorm", "scale"), mtp + "hnorm.weight", None),
                    TensorSpec((name, "w_e_dd"), mtp + "e_proj.weight", 1),
                    TensorSpec((name, "w_h_dd"), mtp + "h_proj.weight", 1),
                    TensorSpec((name, "post_norm", "scale"), mtp + "norm.weight", None),
                    TensorSpec((name, "hc_head", "w_mix_xn"), mtp + "hc_head_fn", 1),
                    TensorSpec((name, "hc_head", "b_mix_n"), mtp + "hc_head_base", None),
                    TensorSpec((name, "hc_head", "scale_1"), mtp + "hc_head_scale", None),
                ]
        return top, per_layer

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return name.startswith("mtp.") and not cfg.mtp_layers  # multi-token prediction the config leaves out

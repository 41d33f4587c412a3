"""Qwen4-Exp's text decoder (Qwen4ExpForCausalLM, model_type qwen4_exp_text), as transformers
5.25 defines it; also read from the published multimodal Qwen4ExpForConditionalGeneration
(its vision tower and multi-token-prediction layer skipped).

Qwen3.5-MoE's layers (Gated DeltaNet linear layers with split projections, zero-centred norms,
softmax experts beside a sigmoid-gated shared expert, QK-norm attention with a sigmoid output
gate per head and dimension) with three changes:

- the attention layers (`indexed_attention`; the released config's `full_attention`) are QSA
  sparse attention: a pooled-block indexer of its own chooses the key blocks each query sees
  (`qsa`, engine/models/qsa.py);
- the residual is hc_count gated streams (`gated_residual`, engine/models/gated_residual.py):
  each sublayer's connection (attn_hyper_connection, mlp_hyper_connection) replaces its
  pre-norm, and the model ends with one more (hyper_connection_mixer) instead of a final norm;
- RoPE covers the whole head unless rope_parameters says partial_rotary_factor;
- the ple_layer_ids layers (linear ones) add hashed n-gram embeddings to the streams first
  (`ngram_embedding`, engine/models/ngram_embedding.py), each table stored in
  split_ngram_parts pieces (ngram_embedding.shard_{k}, torch.chunk's), the hash's constant
  buffers (layer_multipliers, ngram_heads_*: int64) skipped on conversion and written back on
  export (constant_tensors), computed from the config as transformers computes them.

Not supported (refused in one sentence): a sigmoid output gate on the linear layers
(output_gate_type sigmoid).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Multimodal, TensorSpec, qk_norm_tensors, register_family
from engine.models.families.qwen3_next import _DEFAULTS, _VLM_PREFIXES, Qwen3_5Moe

_LAYER_TYPES = {"linear_attention": "gated_delta", "indexed_attention": "qsa", "full_attention": "qsa"}
_INDEXER_KEYS = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
_NGRAM_KEYS = {
    "order": "ngram_size",
    "heads_per_order": "heads_per_ngram",
    "vocab_base": "ngram_vocab_size_base",
    "vocab_multiple": "make_ngram_vocab_size_divisible_by",
    "conv_kernel": "ple_conv_kernel_size",
    "seed": "seed",
    "checkpoint_shards": "split_ngram_parts",
}
"""NGramEmbeddingConfig's fields and their config.json keys."""
_NGRAM_DEFAULTS = {
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 8,
    "ngram_vocab_size_base": 20_000_000,
    "make_ngram_vocab_size_divisible_by": 128,
    "seed": 1234,
    "split_ngram_parts": 512,
}
_NGRAM_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")
"""The hash's constants transformers saves as buffers (int64): computed from the config,
skipped on conversion, written back on export."""


def _connection(engine: str, hf: str, inject: bool = True) -> list[TensorSpec]:
    """A gated residual connection's tensors (gated_residual.GatedResidual)."""
    return [
        TensorSpec((*engine.split("/"), "norm_x"), hf + "hc_norm.weight", None),
        TensorSpec((*engine.split("/"), "w_down_xr"), hf + "input_mix_weight_down.weight", 1),
        TensorSpec((*engine.split("/"), "w_up_rx"), hf + "input_mix_weight_up.weight", 1),
        *([TensorSpec((*engine.split("/"), "w_inject_xn"), hf + "block_inject_weight.weight", 1)] if inject else []),
    ]


@register_family
class Qwen4Exp(Qwen3_5Moe):
    name = "qwen4_exp"
    architecture = "Qwen4ExpForCausalLM"
    model_type = "qwen4_exp_text"
    multimodal = Multimodal("Qwen4ExpForConditionalGeneration", "qwen4_exp", _VLM_PREFIXES)
    fixed = {"qk_norm": True, "norm_zero_centered": True, "attention_output_gate": True}
    fixed |= {"router_score": "softmax", "shared_expert_gate": True}
    hf_defaults = {
        **_DEFAULTS,
        "partial_rotary_factor": 1.0,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "hc_count": 4,
        "hc_lowrank": 320,
        **_NGRAM_DEFAULTS,
    }
    hf_constants = {
        "attention_bias": False,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "output_gate_type": None,
    }

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("ple_layer_ids") and self._eos(hf) is None:
            raise ConfigError(f"{where}: ple_layer_ids needs eos_token_id (n-grams end at it)")
        if hf.get("output_gate_type") not in (None, "silu"):
            raise ConfigError(
                f"{where}: output_gate_type '{hf['output_gate_type']}' is not supported (silu, the linear layers' gate)"
            )
        if "qsa" in self.mixers(hf):
            missing = [key for key in _INDEXER_KEYS if hf.get(key) is None]
            if missing:
                raise ConfigError(f"{where}: the indexed_attention layers need '{missing[0]}' (QSA's indexer)")
            if hf["indexer_kv_heads"] != 1 or hf["indexer_budget"] % hf["indexer_compress_ratio"]:
                raise ConfigError(
                    f"{where}: indexer_kv_heads must be 1 and indexer_budget a multiple of indexer_compress_ratio "
                    f"(got {hf['indexer_kv_heads']}, {hf['indexer_budget']}, {hf['indexer_compress_ratio']})"
                )
        return super().config_from_hf(hf, where)

    @staticmethod
    def _eos(hf: dict) -> int | None:
        eos = hf.get("eos_token_id")
        return (eos or [None])[0] if isinstance(eos, list) else eos

    def mixers(self, hf: dict) -> list[str]:
        """transformers' layer_types (linear_attention / indexed_attention, the released
        full_attention read as indexed), or its default: every 4th layer indexed."""
        layers = hf["num_hidden_layers"]
        types = hf.get("layer_types") or [
            "linear_attention" if (i + 1) % self.hf_value(hf, "full_attention_interval") else "indexed_attention"
            for i in range(layers)
        ]
        where = f"config.json ({self.architecture})"
        if len(types) != layers:
            raise ConfigError(f"{where}: layer_types has {len(types)} entries for {layers} layers")
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown:
            raise ConfigError(
                f"{where}: layer type '{unknown[0]}' is not supported (linear_attention, indexed_attention)"
            )
        return [_LAYER_TYPES[t] for t in types]

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        fields = super().extra_fields_from_hf(hf)
        qsa = "qsa" in self.mixers(hf)
        return {
            **fields,
            "router_renormalize": bool(self.hf_value(hf, "norm_topk_prob")),
            "qsa": (
                {
                    "heads": hf["indexer_n_heads"],
                    "head_dim": hf["indexer_head_dim"],
                    "budget": hf["indexer_budget"],
                    "block": hf["indexer_compress_ratio"],
                }
                if qsa
                else None
            ),
            "gated_residual": {"streams": self.hf_value(hf, "hc_count"), "rank": self.hf_value(hf, "hc_lowrank")},
            "ngram_embedding": self._ngram_from_hf(hf),
        }

    def _ngram_from_hf(self, hf: dict) -> dict[str, Any] | None:
        layers = sorted(set(hf.get("ple_layer_ids") or []))
        if not layers:
            return None
        return {
            "layers": [i - 1 for i in layers],
            "dim": hf.get("ple_embed_dim") or hf["hidden_size"],
            "eos_token_id": self._eos(hf),
            **{field: self.hf_value(hf, key) for field, key in _NGRAM_KEYS.items()},
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        hf = super().extra_hf_keys(cfg)
        factor = hf.pop("partial_rotary_factor")
        if factor == 1.0:  # transformers' default: no key
            del hf["rope_parameters"]["partial_rotary_factor"]
        kinds = [layer.mixer for layer in cfg.layer_pattern()]
        indexer = cfg.qsa
        gated = cfg.gated_residual
        assert gated is not None  # every model of the family
        return {
            **hf,
            "layer_types": ["linear_attention" if kind == "gated_delta" else "indexed_attention" for kind in kinds],
            "norm_topk_prob": cfg.moe.router_renormalize,
            "hc_count": gated.streams,
            "hc_lowrank": gated.rank,
            "indexer_n_heads": None if indexer is None else indexer.heads,
            "indexer_kv_heads": None if indexer is None else 1,
            "indexer_head_dim": None if indexer is None else indexer.head_dim,
            "indexer_budget": None if indexer is None else indexer.budget,
            "indexer_compress_ratio": None if indexer is None else indexer.block,
            **self._ngram_to_hf(cfg),
        }

    @staticmethod
    def _ngram_to_hf(cfg: ModelConfig) -> dict[str, Any]:
        ngram = cfg.ngram_embedding
        if ngram is None:  # transformers' defaults, as it writes them
            return {"ple_layer_ids": [], "number_of_conv_states": 1, "ple_embed_dim": cfg.d_model, **_NGRAM_DEFAULTS}
        return {
            "ple_layer_ids": [i + 1 for i in ngram.layers],
            "number_of_conv_states": 3,
            "ple_embed_dim": ngram.dim,
            "eos_token_id": ngram.eos_token_id,  # the n-grams end at it (a preset has no tokenizer to say so)
            **{key: getattr(ngram, field) for field, key in _NGRAM_KEYS.items()},
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        top = [spec for spec in top if spec.path != ("final_norm", "scale")]
        head = _connection("gr_head", "model.hyper_connection_mixer.", inject=False)
        return top[:1] + head + top[1:], per_layer

    def mixer_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        connections = [
            *_connection("attn_gr", LAYER + "attn_hyper_connection."),
            *_connection("ffn_gr", LAYER + "mlp_hyper_connection."),
        ]
        if layer.mixer == "gated_delta":
            linear = [s for s in super().mixer_tensors(cfg, layer) if s.path != ("attn_norm", "scale")]
            return linear + connections + self._ngram_tensors(cfg, layer)
        indexer = LAYER + "self_attn.indexer."
        attention = [s for s in self.attention_tensors(cfg) if s.path != ("attn_norm", "scale")]
        return [
            *attention,
            *qk_norm_tensors(),
            TensorSpec(
                ("attn", "indexer", "wq_dgi"),
                indexer + "index_qk_proj.weight",
                1,
                fused_with=(("attn", "indexer", "wk_di"),),
            ),
            TensorSpec(("attn", "indexer", "q_norm", "scale"), indexer + "q_layernorm.weight", None),
            TensorSpec(("attn", "indexer", "k_norm", "scale"), indexer + "k_layernorm.weight", None),
            *connections,
        ]

    @staticmethod
    def _ngram_tensors(cfg: ModelConfig, layer) -> list[TensorSpec]:
        """A layer's hashed n-gram embedding (ngram_embedding.NGramEmbedding); its table in
        split_ngram_parts pieces of rows, as torch.chunk cuts it."""
        spec = cfg.layer_specs()[cfg.layer_pattern().index(layer)].ngram_embedding
        if spec is None:
            return []
        assert cfg.ngram_embedding is not None  # (spec set)
        ple = LAYER + "ple."
        size = -(-spec.rows // cfg.ngram_embedding.checkpoint_shards)
        table = [
            TensorSpec(
                ("ple", "table_ri"),
                ple + f"ple_embedding.ngram_embedding.shard_{k}.weight",
                None,
                last_axis_slice=(start, min(start + size, spec.rows)),
                slice_axis=0,
            )
            for k, start in enumerate(range(0, spec.rows, size))
        ]
        return [
            *table,
            TensorSpec(("ple", "w_key_ex"), ple + "key_proj.weight", 1),
            TensorSpec(("ple", "w_value_ed"), ple + "value_proj.weight", 1),
            TensorSpec(("ple", "norm_key_x"), ple + "norm_key.weight", None),
            TensorSpec(("ple", "norm_query_x"), ple + "norm_query.weight", None),
            TensorSpec(("ple", "norm_conv_x"), ple + "norm_conv.weight", None),
            TensorSpec(("ple", "conv_x1k"), ple + "conv1d.weight", None),
        ]

    def constant_tensors(self, cfg: ModelConfig) -> dict[str, Any]:
        out = {}
        for i, spec in enumerate(cfg.layer_specs()):
            e = spec.ngram_embedding
            if e is not None:
                prefix = LAYER.format(i=i) + "ple.ple_embedding."
                offsets = np.cumsum([0, *e.primes[:-1]])
                out[prefix + "layer_multipliers"] = np.asarray(e.multipliers, np.int64)
                out[prefix + "ngram_heads_vocab_sizes"] = np.asarray(e.primes, np.int64)
                out[prefix + "ngram_heads_offsets"] = offsets.astype(np.int64)
        return out

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        return super().ignored_tensor(name, cfg) or name.rsplit(".", 1)[-1] in _NGRAM_BUFFERS

    def mlp_norm_tensors(self) -> list[TensorSpec]:
        return []  # the feed-forward's connection norms its input (mixer_tensors)

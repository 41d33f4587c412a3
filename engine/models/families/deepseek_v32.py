"""DeepSeek-V3.2 (DeepseekV32ForCausalLM) and GLM-5 (GlmMoeDsaForCausalLM, model_type
glm_moe_dsa): DeepSeek-V3's layers (families/deepseek.py) with DeepSeek Sparse Attention, a
lightning indexer per layer choosing the index_topk keys each query attends to
(engine/models/dsa.py; ModelConfig.index_*).

MLA's RoPE always rotates adjacent pairs (the config has no rope_interleave); the indexer's
rotates halves in DeepSeek-V3.2 and adjacent pairs in GLM-5. The dense layers come first
(mlp_layer_types, or first_k_dense_replace). GLM-5's config may let a layer reuse the
previous layer's selection (indexer_types "shared", or the older index_topk_pattern /
index_topk_freq keys; GLM-5 itself runs its indexer in every layer): such a layer has no
indexer (ModelConfig.mla.index_shared_layers). Checkpoints name the indexer's tensors
`model.layers.{i}.self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, TensorSpec, register_family
from engine.models.families.deepseek import DeepseekV3

_INDEXER = LAYER + "self_attn.indexer."


def indexer_tensors(stack: str) -> list[TensorSpec]:
    """The lightning indexer of one layer of `stack` (dsa.Indexer)."""
    return [
        TensorSpec(("attn", "indexer", "wq_b_qgi"), _INDEXER + "wq_b.weight", 1, stack=stack),
        TensorSpec(("attn", "indexer", "wk_di"), _INDEXER + "wk.weight", 1, stack=stack),
        TensorSpec(("attn", "indexer", "k_norm_scale"), _INDEXER + "k_norm.weight", None, stack=stack),
        TensorSpec(("attn", "indexer", "k_norm_bias"), _INDEXER + "k_norm.bias", None, stack=stack),
        TensorSpec(("attn", "indexer", "w_weights_dg"), _INDEXER + "weights_proj.weight", 1, stack=stack),
    ]


@register_family
class DeepseekV32(DeepseekV3):
    name = "deepseek_v32"
    architecture = "DeepseekV32ForCausalLM"
    model_type = "deepseek_v32"
    fixed = {**DeepseekV3.fixed, "rope_interleave": True, "index_rope_interleave": False}
    hf_defaults = {
        **DeepseekV3.hf_defaults,
        "max_position_embeddings": 163840,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 64,
    }
    hf_constants = {"attention_bias": False, "mlp_bias": False, "output_router_logits": False}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("mlp_bias"):  # (attention_bias: DeepseekV3.unsupported_flags)
            raise ConfigError(f"{where}: mlp_bias=true is not supported")
        layers = hf.get("num_hidden_layers")
        types = hf.get("layer_types")
        if types is not None and any(t != "indexed_attention" for t in types):
            raise ConfigError(
                f"{where}: layer_types must all be 'indexed_attention' ({self.architecture}), got {types}"
            )
        mlp_types = hf.get("mlp_layer_types")
        if mlp_types is not None:
            dense = mlp_types.count("dense")
            if len(mlp_types) != layers or mlp_types != ["dense"] * dense + ["sparse"] * (len(mlp_types) - dense):
                raise ConfigError(
                    f"{where}: mlp_layer_types must be {layers} entries, 'dense' ones first then 'sparse', "
                    f"got {mlp_types}"
                )
        if hf.get("q_lora_rank") is None:
            raise ConfigError(
                f"{where}: q_lora_rank must be set ({self.architecture}'s indexer reads the compressed query)"
            )
        return super().config_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        fields = super().extra_fields_from_hf(hf)
        fields.pop("rope_interleave")  # fixed: adjacent pairs
        if hf.get("mlp_layer_types") is not None:
            fields["first_dense_layers"] = hf["mlp_layer_types"].count("dense")
        return {
            **fields,
            "index_topk": self.hf_value(hf, "index_topk"),
            "index_heads": self.hf_value(hf, "index_n_heads"),
            "index_head_dim": self.hf_value(hf, "index_head_dim"),
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = super().extra_hf_keys(cfg)
        del keys["rope_interleave"]
        dense = min(cfg.moe.first_dense_layers, cfg.num_layers)
        return {
            **keys,
            "mlp_layer_types": ["dense"] * dense + ["sparse"] * (cfg.num_layers - dense),
            "layer_types": ["indexed_attention"] * cfg.num_layers,
            "index_topk": cfg.mla.index_topk,
            "index_n_heads": cfg.mla.index_heads,
            "index_head_dim": cfg.mla.index_head_dim,
        }

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        shared = {cfg.layer_pattern()[i].stack for i in cfg.mla.index_shared_layers or []}
        for stack, _ in cfg.layer_stacks():
            if stack not in shared:  # (a shared indexer layer has none)
                per_layer += indexer_tensors(stack)
        return top, per_layer


@register_family
class GlmMoeDsa(DeepseekV32):
    name = "glm_moe_dsa"
    architecture = "GlmMoeDsaForCausalLM"
    model_type = "glm_moe_dsa"
    fixed = {**DeepseekV32.fixed, "index_rope_interleave": True}
    hf_defaults = {
        **DeepseekV32.hf_defaults,
        "max_position_embeddings": 202752,
        "rms_norm_eps": 1e-5,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 2048,
        "qk_nope_head_dim": 192,
        "v_head_dim": 256,
        "index_n_heads": 32,
    }

    @staticmethod
    def indexer_types(hf: dict) -> list[str] | None:
        """transformers' indexer_types, or its schedule from the older keys (None without a
        layer count to schedule)."""
        layers = hf.get("num_hidden_layers")
        types = hf.get("indexer_types")
        if types is None:
            pattern = hf.get("index_topk_pattern")
            if pattern is not None:
                types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
            elif layers is not None:
                freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
                types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]
        return None if types is None else list(types)

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        types = self.indexer_types(hf)
        layers = hf.get("num_hidden_layers")
        if types is not None and (len(types) != layers or set(types) - {"full", "shared"} or types[:1] != ["full"]):
            raise ConfigError(
                f"{where}: indexer_types {types} must be one 'full' or 'shared' per layer ({layers}), the first "
                "'full' (a 'shared' layer reuses the last earlier layer's top-k)"
            )
        return super().config_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        shared = [i for i, t in enumerate(self.indexer_types(hf) or []) if t == "shared"]
        return {**super().extra_fields_from_hf(hf), "index_shared_layers": shared or None}

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        shared = set(cfg.mla.index_shared_layers or [])
        types = ["shared" if i in shared else "full" for i in range(cfg.num_layers)]
        return {**super().extra_hf_keys(cfg), "indexer_types": types}

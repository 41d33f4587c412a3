"""MiniMax-Text-01 (MiniMaxAI/MiniMax-Text-01; transformers' minimax, MiniMaxForCausalLM):
Mixtral's layers (softmax top-k experts under block_sparse_moe, grouped-query attention with
RoPE) where layer_types says linear_attention replaced by lightning attention (the `lightning`
mixer kind, engine/models/lightning.py: a fixed decay per head, falling with depth), and a
residual form of its own: each sublayer sets the stream to alpha * norm(x) + beta *
sublayer(norm(x)), its factors per sublayer kind (ModelConfig.normed_residual).

transformers saves each lightning layer's decay tables as buffers (slope_rate, query_decay,
key_decay, diagonal_decay, all functions of block_size, the heads and the layer's depth):
conversion skips them and export writes them back (constant_tensors), computed as transformers
does, to float32's rounding (not its last bit). (MiniMax-M2, model_type minimax_m2, is families/minimax.py.)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, TensorSpec, register_family, shortest_period
from engine.models.families.moe import Mixtral

KINDS = {"linear_attention": "lightning", "full_attention": "attention"}
"""config.json layer_types -> the mixer kind."""
KINDS_TO_HF = {kind: name for name, kind in KINDS.items()}
FACTORS = {
    "attention_alpha": "full_attn_alpha_factor",
    "attention_beta": "full_attn_beta_factor",
    "lightning_alpha": "linear_attn_alpha_factor",
    "lightning_beta": "linear_attn_beta_factor",
    "mlp_alpha": "mlp_alpha_factor",
    "mlp_beta": "mlp_beta_factor",
}
"""NormedResidualConfig's fields -> config.json's keys."""
BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")


def decay_buffers(heads: int, block: int, layer: int, layers: int) -> dict[str, np.ndarray]:
    """MiniMaxLightningAttention's buffers of layer `layer` of `layers`, as transformers computes them."""
    base = np.float32(1 / (2 ** (8 / heads)))
    factor = np.float32(1 - layer / (layers - 1 + 1e-5) + 1e-5)
    slope = (base ** np.arange(1, heads + 1, dtype=np.float32) * factor).astype(np.float32)[:, None, None]
    steps = np.arange(1, block + 1, dtype=np.float32)
    distance = (steps[:, None] - steps[None, :])[None, None] * slope
    diagonal = np.exp(np.where(distance >= 0, -distance, -np.inf)).astype(np.float32)
    return {
        "slope_rate": slope,
        "query_decay": np.exp(-slope * steps[:, None]).astype(np.float32),
        "key_decay": np.exp(-slope * (block - steps[:, None])).astype(np.float32),
        "diagonal_decay": diagonal,
    }


@register_family
class MiniMaxText01(Mixtral):
    name = "minimax01"
    architecture = "MiniMaxForCausalLM"
    model_type = "minimax"
    hf_defaults = {**Mixtral.hf_defaults, "block_size": 256}

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        layers = hf.get("num_hidden_layers")
        if hf.get("layer_types") is None and isinstance(layers, int):  # transformers' default: alternating
            hf = {**hf, "layer_types": ["full_attention" if (i + 1) % 2 else "linear_attention" for i in range(layers)]}
        types = hf.get("layer_types") or []
        if sorted(set(types) - set(KINDS)) or len(types) != layers:
            raise ConfigError(f"{where}: layer_types must name {layers} layers of {', '.join(KINDS)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{where}: hidden_act '{hf['hidden_act']}' is not supported (silu)")
        return super().config_from_hf(hf, where)

    def extra_fields_from_hf(self, hf: dict) -> dict[str, Any]:
        kinds = [KINDS[t] for t in hf["layer_types"]]
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        factors = {field: float(hf.get(key, 1.0)) for field, key in FACTORS.items()}
        lightning = "lightning" in kinds
        return {
            **super().extra_fields_from_hf(hf),
            "mixer_pattern": shortest_period(kinds) if lightning else None,
            "lightning": (
                {"num_heads": heads, "head_dim": head_dim, "chunk_size": self.hf_value(hf, "block_size")}
                if lightning
                else None
            ),
            "normed_residual": factors,
        }

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        factors = cfg.normed_residual.model_dump() if cfg.normed_residual is not None else {}
        return {
            **super().extra_hf_keys(cfg),
            "layer_types": [
                "linear_attention" if x.mixer == "lightning" else "full_attention" for x in cfg.layer_pattern()
            ],
            "block_size": cfg.lightning.chunk_size if cfg.lightning is not None else self.hf_defaults["block_size"],
            **{key: factors.get(field, 1.0) for field, key in FACTORS.items()},
            "router_jitter_noise": 0.0,
        }

    def mixer_tensors(self, cfg: ModelConfig, layer) -> list[TensorSpec]:
        if layer.mixer != "lightning":
            return super().mixer_tensors(cfg, layer)
        attn = LAYER + "self_attn."
        return [
            TensorSpec(("attn_norm", "scale"), LAYER + "input_layernorm.weight", None),
            TensorSpec(("attn", "w_qkv_dnx"), attn + "qkv_proj.weight", 1),
            TensorSpec(("attn", "w_gate_dnh"), attn + "output_gate.weight", 1),
            TensorSpec(("attn", "norm_f"), attn + "norm.weight", None),
            TensorSpec(("attn", "w_out_nhd"), attn + "out_proj.weight", 2),
        ]

    def constant_tensors(self, cfg: ModelConfig) -> dict[str, Any]:
        lightning = cfg.lightning
        if lightning is None:
            return {}
        out: dict[str, Any] = {}
        for i, layer in enumerate(cfg.layer_pattern()):
            if layer.mixer == "lightning":
                buffers = decay_buffers(lightning.num_heads, lightning.chunk_size, i, cfg.num_layers)
                out |= {f"model.layers.{i}.self_attn.{name}": value for name, value in buffers.items()}
        return out

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        layer = name.removeprefix("model.layers.").split(".", 1)
        return len(layer) == 2 and layer[1] in {f"self_attn.{b}" for b in BUFFERS}

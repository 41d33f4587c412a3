"""Dots3 Note's text decoder (Dots3NoteForCausalLM, model_type dots3_note_text;
dots-studio/dots3-note-prev): DeepSeek-V3's layers (families/deepseek.py: multi-head latent
attention, a first dense layer, DeepSeek's sigmoid router over groups plus shared experts) in
two kinds, as `layer_types` says:

- indexed_attention layers: latent attention with GLM-5's lightning indexer (DeepSeek Sparse
  Attention, engine/models/dsa.py; its RoPE on adjacent pairs), at rope_parameters'
  indexed_attention base;
- sliding_attention layers: latent attention over a sliding window, without an indexer, with
  sizes of their own (heads, head widths, both latent ranks: `per_layer_config`, or the older
  swa_* keys; ModelConfig.mla.local) and their own RoPE base (rope.local_theta).

Every layer's latent attention also normalises its shared rotary key (RMSNorm, before RoPE:
mla.key_norm), scales the normed query and key-value latents by sqrt(hidden / rank)
(mla.lora_scale; the indexer reads the scaled query) and gates each head's output with
sigmoid(x . w) (g_proj: attention.head_gate). The shared experts are one gated MLP
shared_experts_intermediate_size * n_shared_experts wide. config.json's head_dim only sets the
rotary fraction transformers derives (qk_rope_head_dim / head_dim): kept for export
(mla.nominal_head_dim).

Published checkpoints (Dots3NoteForConditionalGeneration) store the text decoder under
`model.` and `lm_head.` beside the vision and audio towers (`vision_encoder.`, `audio_encoder.`,
`audio_adapter.`), which conversion skips, with the text config's keys at the top level of
config.json. Their multi-token-prediction layer (`model.layers.{num_hidden_layers}.`,
`model.mtp.`), which transformers does not load, is skipped too. Experts are stored one tensor
each (`experts.{j}.`), as transformers saves them.
"""

from __future__ import annotations

from typing import Any

from engine.config import ConfigError
from engine.models.config import ModelConfig
from engine.models.families.base import LAYER, Multimodal, TensorSpec, register_family, shortest_period
from engine.models.families.deepseek_v32 import DeepseekV32, indexer_tensors

_SHAPE_KEYS = (
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "head_dim",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
"""The per-layer keys of a Dots3 layer's latent attention (per_layer_config's)."""
_SWA_DEFAULTS = {
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1024,
    "kv_lora_rank": 1024,
    "head_dim": 256,
    "qk_nope_head_dim": 192,
    "v_head_dim": 128,
}
"""transformers' sizes of the sliding layers where config.json gives no swa_* key."""
_INDEXED, _SLIDING, _FULL = "indexed_attention", "sliding_attention", "full_attention"


def normalised(hf: dict) -> dict:
    """config.json `hf` in transformers 5's keys, as Dots3NoteTextConfig reads the released
    checkpoints' older ones (first_k_dense_replace, moe_layer_freq, use_dsa,
    use_sliding_window, sliding_window_size, swa_*, rope_theta, swa_rope_theta)."""
    hf = dict(hf)
    layers = hf["num_hidden_layers"]
    if hf.get("mlp_layer_types") is None:
        first, freq = hf.get("first_k_dense_replace", 1), hf.get("moe_layer_freq", 1)
        hf["mlp_layer_types"] = [
            "sparse"
            if i >= first and (bool(freq[i]) if isinstance(freq, (list, tuple)) else i % freq == 0)
            else "dense"
            for i in range(layers)
        ]
    if hf.get("moe_shared_expert_intermediate_size") is not None:
        hf["shared_experts_intermediate_size"] = hf["moe_shared_expert_intermediate_size"]
    if hf.get("sliding_window") is None:
        hf["sliding_window"] = hf.get("sliding_window_size", 512)
    use_dsa = hf.get("use_dsa", None if "per_layer_config" in hf else True)
    if hf.get("layer_types") is None:
        full = _FULL if use_dsa is False else _INDEXED
        sliding = hf.get("use_sliding_window", True)
        hf["layer_types"] = [full if not sliding or i < 2 or i % 4 == 1 else _SLIDING for i in range(layers)]
    if use_dsa is not None:
        old, new = (_FULL, _INDEXED) if use_dsa else (_INDEXED, _FULL)
        hf["layer_types"] = [new if t == old else t for t in hf["layer_types"]]
    if hf.get("per_layer_config") is None:
        swa = {key: hf.get(f"swa_{key}", default) for key, default in _SWA_DEFAULTS.items()}
        swa["qk_rope_head_dim"] = hf.get("swa_qk_rope_head_dim", swa["head_dim"] - swa["qk_nope_head_dim"])
        hf["per_layer_config"] = {str(i): swa for i, t in enumerate(hf["layer_types"]) if t == _SLIDING}
    if hf.get("rope_parameters") is None:
        theta = hf.get("rope_theta", Dots3NoteText.hf_defaults["rope_theta"])
        swa_theta = hf.get("swa_rope_theta", 50_000.0)
        hf["rope_parameters"] = hf.get("rope_scaling") or {
            t: {"rope_type": "default", "rope_theta": swa_theta if t == _SLIDING else theta}
            for t in set(hf["layer_types"])
        }
    return hf


@register_family
class Dots3NoteText(DeepseekV32):
    name = "dots3_note_text"
    architecture = "Dots3NoteForCausalLM"
    model_type = "dots3_note_text"
    fixed = {
        **DeepseekV32.fixed,
        "index_rope_interleave": True,
        "attention_head_gate": True,
        "mla_key_norm": True,
        "mla_lora_scale": True,
    }
    hf_defaults = {
        **DeepseekV32.hf_defaults,
        "max_position_embeddings": 524288,
        "rms_norm_eps": 1e-5,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1536,
        "n_shared_experts": 1,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": 1024,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "shared_experts_intermediate_size": 1536,
        "rope_theta": 80_000_000.0,
        "sliding_window": 512,
    }
    hf_constants = {"attention_bias": False, "mlp_bias": False, "output_router_logits": False}
    multimodal = Multimodal(
        architecture="Dots3NoteForConditionalGeneration",
        model_type="dots3_note",
        prefixes=(("model.", "model."), ("lm_head.", "lm_head.")),
    )

    @staticmethod
    def _shapes(hf: dict, where: str) -> dict[str, dict]:
        """Each layer type's latent-attention sizes (the top-level keys, over them its
        per_layer_config entries), one per type: refused where layers of a type differ."""
        overrides = {int(i): values for i, values in (hf.get("per_layer_config") or {}).items()}
        shapes: dict[str, dict] = {}
        for i, layer_type in enumerate(hf["layer_types"]):
            unknown = sorted(set(overrides.get(i, {})) - set(_SHAPE_KEYS))
            if unknown:
                raise ConfigError(
                    f"{where}: per_layer_config[{i}] sets {unknown[0]}; only the latent attention's sizes may "
                    f"differ per layer ({', '.join(_SHAPE_KEYS)})"
                )
            top = {key: hf.get(key, Dots3NoteText.hf_defaults.get(key)) for key in _SHAPE_KEYS}
            top["head_dim"] = hf.get("head_dim", 256)
            shape = {**top, **overrides.get(i, {})}
            if shapes.setdefault(layer_type, shape) != shape:
                raise ConfigError(
                    f"{where}: the {layer_type} layers must all have the same sizes (per_layer_config), "
                    f"got {shapes[layer_type]} and {shape} (layer {i})"
                )
        for layer_type, shape in shapes.items():
            if shape["q_lora_rank"] is None:
                raise ConfigError(f"{where}: {layer_type} layers need q_lora_rank (Dots3's compressed query)")
        return shapes

    def rope_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        return {}  # a RoPE per layer type: _layer_fields

    def config_from_hf(self, hf: dict, where: str) -> dict[str, Any]:
        if hf.get("num_hidden_layers") is None:
            raise ConfigError(f"{where}: missing key 'num_hidden_layers'")
        hf = normalised(hf)
        types = hf["layer_types"]
        if len(types) != hf["num_hidden_layers"] or set(types) - {_INDEXED, _SLIDING, _FULL}:
            raise ConfigError(
                f"{where}: layer_types must be one of indexed_attention, sliding_attention, full_attention per "
                f"layer ({hf['num_hidden_layers']}), got {types}"
            )
        if {_INDEXED, _FULL} <= set(types):
            raise ConfigError(f"{where}: layer_types mixes indexed_attention and full_attention layers")
        if not self.hf_value(hf, "n_shared_experts"):
            raise ConfigError(f"{where}: n_shared_experts must be at least 1 (Dots3 always has shared experts)")
        self._shapes(hf, where)
        return super().config_from_hf(
            {**hf, "layer_types": [_INDEXED] * len(types), "q_lora_rank": self.hf_value(hf, "q_lora_rank")},
            where,
        ) | self._layer_fields(hf, where)

    def _layer_fields(self, hf: dict, where: str) -> dict[str, Any]:
        """The fields of the layer kinds: which layers slide, their sizes and RoPE bases."""
        types = hf["layer_types"]
        shapes = self._shapes(hf, where)
        local = [t == _SLIDING for t in types]
        rope = hf["rope_parameters"]
        if not all(isinstance(rope.get(t), dict) for t in set(types)):
            rope = {t: rope for t in set(types)}  # one RoPE for every layer type
        thetas = {}
        for layer_type in set(types):
            params, shape = rope[layer_type], shapes[layer_type]
            if params.get("rope_type", "default") != "default":
                raise ConfigError(
                    f"{where}: rope_parameters.{layer_type}: only the default RoPE is supported, got "
                    f"{params.get('rope_type')!r}"
                )
            rotary = shape["qk_rope_head_dim"]
            fraction = params.get("partial_rotary_factor", rotary / shape["head_dim"])
            if int(shape["head_dim"] * fraction) != rotary:
                raise ConfigError(
                    f"{where}: rope_parameters.{layer_type}.partial_rotary_factor must make head_dim * it = "
                    f"qk_rope_head_dim ({rotary}), got {fraction}"
                )
            thetas[layer_type] = float(params.get("rope_theta", self.hf_defaults["rope_theta"]))
        main = shapes.get(_INDEXED) or shapes.get(_FULL) or shapes[_SLIDING]
        fields: dict[str, Any] = {
            "attention_pattern": ["local" if x else "global" for x in shortest_period(local)],
            "sliding_window": hf["sliding_window"] if any(local) else None,
            "rope_theta": thetas.get(_INDEXED, thetas.get(_FULL, thetas.get(_SLIDING))),
            "rope_scaling": None,
            "rope_local_theta": thetas.get(_SLIDING) if any(local) else None,
            "num_heads": main["num_attention_heads"],
            "num_kv_heads": main["num_attention_heads"],
            "head_dim": main["qk_nope_head_dim"] + main["qk_rope_head_dim"],
            "rope_head_dim": main["qk_rope_head_dim"],
            "v_head_dim": _value_dim(main),
            "kv_lora_rank": main["kv_lora_rank"],
            "q_lora_rank": main["q_lora_rank"],
            "mla_nominal_head_dim": hf.get("head_dim", 256),
            "mla_latent_norm_eps": self.hf_value(hf, "rms_norm_eps"),
            "shared_expert_mlp_dim": self.hf_value(hf, "shared_experts_intermediate_size")
            * self.hf_value(hf, "n_shared_experts"),
        }
        if _SLIDING in shapes and any(x != _SLIDING for x in types):
            swa = shapes[_SLIDING]
            if swa["head_dim"] != swa["qk_nope_head_dim"] + swa["qk_rope_head_dim"]:
                raise ConfigError(f"{where}: the sliding layers' head_dim must be qk_nope_head_dim + qk_rope_head_dim")
            fields["mla_local"] = {
                "num_heads": swa["num_attention_heads"],
                "head_dim": swa["head_dim"],
                "rope_head_dim": swa["qk_rope_head_dim"],
                "v_head_dim": swa["v_head_dim"],
                "kv_lora_rank": swa["kv_lora_rank"],
                "q_lora_rank": swa["q_lora_rank"],
            }
        if _INDEXED not in types:
            fields["index_topk"] = None
        return fields

    def extra_hf_keys(self, cfg: ModelConfig) -> dict[str, Any]:
        keys = super().extra_hf_keys(cfg)
        for key in ("qk_head_dim", "first_k_dense_replace", "rope_theta", "rope_scaling"):
            keys.pop(key, None)
        full = _INDEXED if cfg.mla.index_topk is not None else _FULL
        types = [_SLIDING if x else full for x in cfg.layer_is_local()]
        head_dim = cfg.mla.nominal_head_dim or cfg.attention.head_dim
        rope = {full: self._rope(cfg.rope.theta, cfg.mla.rope_head_dim, head_dim)}
        per_layer: dict[str, dict] = {}
        local = cfg.mla.local
        if _SLIDING in types:
            theta = cfg.rope.local_theta or cfg.rope.theta
            if local is None:
                rope[_SLIDING] = self._rope(theta, cfg.mla.rope_head_dim, head_dim)
            else:
                rope[_SLIDING] = self._rope(theta, local.rope_head_dim, local.head_dim)
                swa = {
                    "num_attention_heads": local.num_heads,
                    "num_key_value_heads": local.num_heads,
                    "q_lora_rank": local.q_lora_rank,
                    "kv_lora_rank": local.kv_lora_rank,
                    "head_dim": local.head_dim,
                    "qk_nope_head_dim": local.head_dim - local.rope_head_dim,
                    "qk_rope_head_dim": local.rope_head_dim,
                    "v_head_dim": local.v_head_dim,
                }
                top = {  # transformers writes only what differs from these
                    "num_attention_heads": cfg.attention.num_heads,
                    "num_key_value_heads": cfg.attention.num_heads,
                    "q_lora_rank": cfg.mla.q_lora_rank,
                    "kv_lora_rank": cfg.mla.kv_lora_rank,
                    "head_dim": head_dim,
                    "qk_nope_head_dim": cfg.attention.head_dim - cfg.mla.rope_head_dim,
                    "qk_rope_head_dim": cfg.mla.rope_head_dim,
                    "v_head_dim": cfg.value_head_dim,
                }
                swa = {key: value for key, value in swa.items() if value != top[key]}
                layers = [i for i, t in enumerate(types) if t == _SLIDING and swa]
                width = len(str(max(layers, default=0)))  # transformers zero-pads them, to sort in JSON
                per_layer = {str(i).zfill(width): swa for i in layers}
        return {
            **keys,
            "head_dim": head_dim,
            "layer_types": types,
            "sliding_window": cfg.attention.sliding_window or self.hf_defaults["sliding_window"],
            "rope_parameters": rope,
            "per_layer_config": per_layer,
            "shared_experts_intermediate_size": cfg.shared_mlp_dim // cfg.moe.num_shared_experts,
            **({} if cfg.mla.index_topk is not None else {k: self.hf_defaults[k] for k in _INDEX_KEYS}),
        }

    @staticmethod
    def _rope(theta: float, rotary: int, head_dim: int) -> dict:
        return {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary / head_dim}

    def tensor_table(self, cfg: ModelConfig) -> tuple[list[TensorSpec], list[TensorSpec]]:
        top, per_layer = super().tensor_table(cfg)
        attn = LAYER + "self_attn."
        local = {name for name, _ in cfg.layer_stacks() if name.startswith("local_")}
        indexers = {spec for stack in local for spec in indexer_tensors(stack)}
        per_layer = [spec for spec in per_layer if spec not in indexers]  # (the sliding layers have none)
        for stack, _ in cfg.layer_stacks():
            per_layer += [
                TensorSpec(("attn", "k_rope_norm", "scale"), attn + "k_rope_only_layernorm.weight", None, stack=stack),
                TensorSpec(("attn", "w_head_gate_dn"), attn + "g_proj.weight", 1, stack=stack),
            ]
        return top, per_layer

    def ignored_tensor(self, name: str, cfg: ModelConfig) -> bool:
        # The published multi-token-prediction layer, which transformers does not load either.
        return name.startswith("model.mtp.") or super().ignored_tensor(name, cfg)


_INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")


def _value_dim(shape: dict) -> int | None:
    """ModelConfig's v_head_dim of a layer type's sizes (None: the query/key width)."""
    value = shape["v_head_dim"]
    return None if value == shape["qk_nope_head_dim"] + shape["qk_rope_head_dim"] else value

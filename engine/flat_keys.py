"""ModelConfig's flat keys: every field had one name at the top level before the sections
(engine/models/sections.py) existed, `num_heads`, `router_scale`, `rope_theta`. Presets, run
configs, overrides (`model.num_heads=4`) and the checkpoints written before keep that form, so
it stays readable: `fold` moves flat keys into their sections as a config is validated, and
`unfold` writes a config back in the flat names, which is what artifact ids hash
(engine/models/fingerprint.py), so the ids of everything written before stay as they were.
"""

from __future__ import annotations

from typing import Any

FLAT: dict[str, tuple[str, str]] = {
    # attention
    "num_heads": ("attention", "num_heads"),
    "num_kv_heads": ("attention", "num_kv_heads"),
    "head_dim": ("attention", "head_dim"),
    "qkv_bias": ("attention", "qkv_bias"),
    "attention_out_bias": ("attention", "out_bias"),
    "qk_norm": ("attention", "qk_norm"),
    "qk_norm_across_heads": ("attention", "qk_norm_across_heads"),
    "qk_norm_per_head": ("attention", "qk_norm_per_head"),
    "qk_norm_after_rope": ("attention", "qk_norm_after_rope"),
    "qk_l2_norm": ("attention", "qk_l2_norm"),
    "attention_pattern": ("attention", "pattern"),
    "sliding_window": ("attention", "sliding_window"),
    "attention_chunk_size": ("attention", "chunk_size"),
    "query_pre_attn_scalar": ("attention", "query_pre_attn_scalar"),
    "attention_scale": ("attention", "scale"),
    "attn_logit_softcap": ("attention", "softcap"),
    "attention_sinks": ("attention", "sinks"),
    "attention_output_gate": ("attention", "output_gate"),
    "value_norm": ("attention", "value_norm"),
    "qkv_clip": ("attention", "qkv_clip"),
    "attn_temperature_floor": ("attention", "temperature_floor"),
    "attn_temperature_scale": ("attention", "temperature_scale"),
    "query_position_scale": ("attention", "query_position_scale"),
    "global_head_dim": ("attention", "global_head_dim"),
    "global_num_kv_heads": ("attention", "global_num_kv_heads"),
    "global_values_from_keys": ("attention", "global_values_from_keys"),
    "kv_shared_layers": ("attention", "kv_shared_layers"),
    "attention_experts": ("attention", "experts"),
    "attention_value_dim": ("attention", "value_dim"),
    "attention_value_scale": ("attention", "value_scale"),
    "local_sinks_only": ("attention", "local_sinks_only"),
    "attention_head_gate": ("attention", "head_gate"),
    "attention_head_gate_activation": ("attention", "head_gate_activation"),
    # rope
    "rope_theta": ("rope", "theta"),
    "rope_scaling": ("rope", "scaling"),
    "rope_local_theta": ("rope", "local_theta"),
    "rotary_dim": ("rope", "rotary_dim"),
    "rope_pattern": ("rope", "pattern"),
    "rope_interleave": ("rope", "interleave"),
    "mrope_section": ("rope", "mrope_section"),
    "local_rotary_dim": ("rope", "local_rotary_dim"),
    # norm (a NormSpec)
    "norm_kind": ("norm", "kind"),
    "norm_eps": ("norm", "eps"),
    "norm_zero_centered": ("norm", "zero_centered"),
    "norm_scale": ("norm", "scale"),
    "norm_bias": ("norm", "bias"),
    # block
    "pre_norms": ("block", "pre_norms"),
    "post_norms": ("block", "post_norms"),
    "residual": ("block", "residual"),
    "residual_multiplier": ("block", "residual_multiplier"),
    "layer_scale": ("block", "layer_scale"),
    "laurel_rank": ("block", "laurel_rank"),
    "linear_pre_norms": ("block", "linear_pre_norms"),
    # mlp
    "mlp_dim": ("mlp", "dim"),
    "activation": ("mlp", "activation"),
    "mlp_gated": ("mlp", "gated"),
    "mlp_bias": ("mlp", "bias"),
    "kv_shared_wide_mlp": ("mlp", "kv_shared_wide"),
    "activation_sparsity": ("mlp", "gate_sparsity"),
    # moe
    "num_experts": ("moe", "num_experts"),
    "experts_per_token": ("moe", "experts_per_token"),
    "expert_mlp_dim": ("moe", "expert_dim"),
    "router_score": ("moe", "router_score"),
    "router_renormalize": ("moe", "router_renormalize"),
    "router_bias": ("moe", "router_bias"),
    "router_logits_bias": ("moe", "router_logits_bias"),
    "router_groups": ("moe", "router_groups"),
    "router_group_top": ("moe", "router_group_top"),
    "router_group_score": ("moe", "router_group_score"),
    "router_scale": ("moe", "router_scale"),
    "router_scales_input": ("moe", "router_scales_input"),
    "router_input_norm": ("moe", "router_input_norm"),
    "router_expert_scale": ("moe", "router_expert_scale"),
    "router_sparsemixer_eps": ("moe", "sparsemixer_eps"),
    "expert_bias": ("moe", "expert_bias"),
    "swiglu_limit": ("moe", "swiglu_limit"),
    "swiglu_alpha": ("moe", "swiglu_alpha"),
    "num_shared_experts": ("moe", "num_shared_experts"),
    "shared_expert_mlp_dim": ("moe", "shared_dim"),
    "shared_expert_gate": ("moe", "shared_gate"),
    "shared_expert_scale": ("moe", "shared_scale"),
    "first_dense_layers": ("moe", "first_dense_layers"),
    "moe_beside_mlp": ("moe", "beside_mlp"),
    "moe_output_bias": ("moe", "output_bias"),
    "swiglu_shift": ("moe", "swiglu_shift"),
    "hash_layers": ("moe", "hash_layers"),
    "router_softcap": ("moe", "router_softcap"),
    "moe_clamp_dense": ("moe", "clamp_dense"),
    "zero_experts": ("moe", "zero_experts"),
    "shortcut_moe": ("block", "shortcut_moe"),
    # mla
    "kv_lora_rank": ("mla", "kv_lora_rank"),
    "q_lora_rank": ("mla", "q_lora_rank"),
    "rope_head_dim": ("mla", "rope_head_dim"),
    "v_head_dim": ("mla", "v_head_dim"),
    "index_topk": ("mla", "index_topk"),
    "index_heads": ("mla", "index_heads"),
    "index_head_dim": ("mla", "index_head_dim"),
    "index_rope_interleave": ("mla", "index_rope_interleave"),
    "index_rope_last": ("mla", "index_rope_last"),
    "mla_output_gate": ("mla", "output_gate"),
    "mla_lora_scale": ("mla", "lora_scale"),
    "index_norm_eps": ("mla", "index_norm_eps"),
    "index_shared_layers": ("mla", "index_shared_layers"),
    "mla_key_norm": ("mla", "key_norm"),
    "mla_local": ("mla", "local"),
    "mla_nominal_head_dim": ("mla", "nominal_head_dim"),
    "mla_latent_norm_eps": ("mla", "latent_norm_eps"),
    # embedding
    "scale_embeddings": ("embedding", "scale"),
    "embedding_multiplier": ("embedding", "multiplier"),
    "embedding_norm": ("embedding", "norm"),
    "position_offset": ("embedding", "position_offset"),
    "per_layer_input_dim": ("embedding", "per_layer_input_dim"),
    "per_layer_vocab_size": ("embedding", "per_layer_vocab_size"),
    # head
    "lm_head_bias": ("head", "bias"),
    "final_logit_softcap": ("head", "softcap"),
    "logits_scaling": ("head", "divisor"),
    "logits_multiplier": ("head", "multiplier"),
    "final_norm_eps": ("head", "norm_eps"),
    "output_vocab_size": ("head", "vocab_size"),
}
"""Flat key -> (section, field)."""

_SECTIONED = {section_field: flat for flat, section_field in FLAT.items()}


def fold(data: Any) -> Any:
    """A ModelConfig's input with its flat keys moved into their sections. A flat key wins over
    the same field given in its section (`{**cfg.model_dump(), "num_heads": 4}` changes the heads)."""
    if not isinstance(data, dict) or not any(key in FLAT for key in data):
        return data
    out = {key: value for key, value in data.items() if key not in FLAT}
    for key, value in data.items():
        if key in FLAT:
            section, field = FLAT[key]
            current = out.get(section)
            current = dict(current) if isinstance(current, dict) else _as_dict(section, current)
            current[field] = value
            out[section] = current
    return out


def _as_dict(name: str, section: Any) -> dict:
    if section is None:
        return {}
    if hasattr(section, "model_dump"):  # a section object given as such
        return section.model_dump()
    # a ValueError: pydantic reports it as the config's one line, naming the key
    raise ValueError(f"section '{name}' must be a mapping of its fields, got {section!r}")


def value(cfg: Any, key: str) -> Any:
    """The value of a ModelConfig's field by its flat name (`value(cfg, "embedding_multiplier")`),
    for a family whose config.json keys are those names."""
    if key in FLAT:
        section, field = FLAT[key]
        return getattr(getattr(cfg, section), field)
    return getattr(cfg, key)


def unfold(dumped: dict) -> dict:
    """A ModelConfig's model_dump(mode="json") in the flat keys: each section's fields under
    their flat names; a section field with no flat name (added since) as `section.field`."""
    flat: dict[str, Any] = {}
    sections = {section for section, _ in FLAT.values()}
    for key, value in dumped.items():
        if key in sections and isinstance(value, dict):
            for field, inner in value.items():
                flat[_SECTIONED.get((key, field), f"{key}.{field}")] = inner
        else:
            flat[key] = value
    return flat

"""What of a model's config its artifacts' ids hash: every field that existed when ids were
first defined, and any field added since only where it differs from its default.

So a field added to ModelConfig (or to a config inside it) at a default that means what the
engine did before changes no existing artifact's id, with nothing to list: the ids of a store's
finished stages stay, and a pipeline that sets the new field gets a new id. JAX-free (pipeline
validation fingerprints stages).
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, TypeAdapter

from engine import flat_keys

IDS_V1 = frozenset(
    """
    family vocab_size d_model num_layers num_heads num_kv_heads head_dim mlp_dim max_seq_len norm_eps
    rope_theta rope_scaling rope_scaling.kind rope_scaling.factor rope_scaling.low_freq_factor
    rope_scaling.high_freq_factor rope_scaling.original_max_position rope_scaling.beta_fast
    rope_scaling.beta_slow rope_scaling.attention_factor rope_scaling.mscale rope_scaling.mscale_all_dim
    rope_scaling.truncate tie_embeddings activation qkv_bias qk_norm norm_zero_centered scale_embeddings
    post_norms attention_pattern sliding_window rope_local_theta query_pre_attn_scalar attn_logit_softcap
    final_logit_softcap init_std num_experts experts_per_token expert_mlp_dim router_score
    router_renormalize router_bias num_shared_experts router_groups router_group_top router_scale
    first_dense_layers kv_lora_rank q_lora_rank rope_head_dim v_head_dim rope_interleave attention_sinks
    attention_out_bias router_logits_bias expert_bias swiglu_limit swiglu_alpha
    gated_delta.num_key_heads gated_delta.num_value_heads gated_delta.key_head_dim
    gated_delta.value_head_dim gated_delta.conv_kernel gated_delta.fused_projections
    mamba2.num_heads mamba2.head_dim mamba2.state_size mamba2.n_groups mamba2.conv_kernel
    mamba2.chunk_size mamba2.conv_bias mamba2.proj_bias mamba2.dt_limit
    mup.lm_head mup.key mup.attention_in mup.attention_out mup.ssm_in mup.ssm_out mup.ssm_projections
    mup.mlp_gate mup.mlp_down
    """.split()
)
"""The (dotted) fields ids have always hashed, whatever their value: frozen. Never add to it."""


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for candidate in typing.get_args(annotation) or (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _default_json(field) -> Any:
    if field.is_required():
        return _REQUIRED
    return TypeAdapter(field.annotation).dump_python(field.get_default(call_default_factory=True), mode="json")


_REQUIRED = object()  # a required field has no default: always hashed


def model_id_fields(dumped: dict, schema: type[BaseModel], prefix: str = "") -> dict:
    """`dumped` (a ModelConfig's model_dump(mode="json")) in its flat keys (flat_keys.unfold:
    the names ids have always hashed), less the fields added since IDS_V1 that hold their
    defaults; nested configs (rope_scaling, mamba2, ...) field by field."""
    fields = id_fields(schema)
    kept = {}
    for name, value in (flat_keys.unfold(dumped) if not prefix else dumped).items():
        path, field = prefix + name, fields[name]
        sub = _submodel(field.annotation)
        if isinstance(value, dict) and sub is not None:
            kept[name] = model_id_fields(value, sub, path + ".")
        elif path in IDS_V1 or value != _default_json(field):
            kept[name] = value
    return kept


def id_fields(schema: type[BaseModel]) -> dict[str, Any]:
    """`schema`'s fields by the names model_id_fields sees: a section's (engine/models/sections.py)
    by their flat keys, or `section.field` for one added since the sections."""
    fields: dict[str, Any] = {}
    sections = {section for section, _ in flat_keys.FLAT.values()}
    named = {section_field: flat for flat, section_field in flat_keys.FLAT.items()}
    for name, field in schema.model_fields.items():
        sub = _submodel(field.annotation)
        if name in sections and sub is not None:
            for inner, inner_field in sub.model_fields.items():
                fields[named.get((name, inner), f"{name}.{inner}")] = inner_field
        else:
            fields[name] = field
    return fields

"""Artifact ids and the model's fields (engine/models/fingerprint.py): the fields ids always
hashed stay hashed at any value, and a field added since is hashed only where it is not at its
default, with no list of added fields to keep (the shipped pipelines' ids are pinned in
tests/test_stage_kinds.py)."""

from __future__ import annotations

from engine.config import load_preset
from engine.models.config import ModelConfig
from engine.models.fingerprint import IDS_V1, model_id_fields


def tiny(**fields) -> ModelConfig:
    raw = load_preset("tiny", "test")
    raw.pop("compute", None)
    return ModelConfig(**{**raw, **fields})


def test_fields_added_since_ids_were_defined_count_only_off_their_defaults():
    plain = model_id_fields(tiny().model_dump(mode="json"), ModelConfig)
    assert "norm_kind" not in plain and "mixer_pattern" not in plain and "positions" not in plain
    assert plain["qkv_bias"] is False and plain["rope_scaling"] is None  # always hashed (IDS_V1)
    layer_norm = model_id_fields(tiny(norm_kind="layer", norm_bias=True).model_dump(mode="json"), ModelConfig)
    assert layer_norm["norm_kind"] == "layer" and layer_norm["norm_bias"] is True
    assert {k: v for k, v in layer_norm.items() if k not in ("norm_kind", "norm_bias")} == plain


def test_nested_configs_are_pruned_field_by_field():
    yarn = {"kind": "yarn", "factor": 4.0, "original_max_position": 64}
    fields = model_id_fields(tiny(rope_scaling=yarn).model_dump(mode="json"), ModelConfig)
    assert fields["rope_scaling"]["kind"] == "yarn" and fields["rope_scaling"]["beta_fast"] == 32.0
    assert "rotated_fraction" not in fields["rope_scaling"]  # added later, at its default


def test_every_current_model_field_is_either_frozen_or_defaulted():
    """A required field added to ModelConfig would change every id: it needs a default."""
    for name, field in ModelConfig.model_fields.items():
        assert name in IDS_V1 or not field.is_required(), name

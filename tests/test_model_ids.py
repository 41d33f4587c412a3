"""Artifact ids and the model's fields (engine/models/fingerprint.py): the fields ids always
hashed stay hashed at any value, and a field added since is hashed only where it is not at its
default, with no list of added fields to keep (the shipped pipelines' ids are pinned in
tests/test_stage_kinds.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from engine import flat_keys
from engine.config import load_preset
from engine.models.config import ModelConfig
from engine.models.fingerprint import IDS_V1, id_fields, model_id_fields


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
    """A required field added to ModelConfig (or to one of its sections) would change every id:
    it needs a default."""
    for name, field in id_fields(ModelConfig).items():
        assert name in IDS_V1 or not field.is_required(), name


def test_sections_read_flat_keys_and_hash_as_the_flat_form():
    """A config written with flat keys (presets, checkpoints from before the sections) is the
    same config as one written in sections, with the same id fields, under the flat names."""
    flat = tiny(num_experts=0, qkv_bias=True, rope_theta=5e5, router_scale=2.0)
    dumped = flat.model_dump(mode="json")
    assert "qkv_bias" not in dumped and dumped["attention"]["qkv_bias"] is True and dumped["rope"]["theta"] == 5e5
    assert ModelConfig.model_validate(dumped) == flat
    fields = model_id_fields(dumped, ModelConfig)
    assert fields["qkv_bias"] is True and fields["rope_theta"] == 5e5 and fields["router_scale"] == 2.0
    assert set(fields) <= set(flat_keys.FLAT) | set(ModelConfig.model_fields)
    # a flat key wins over its section's field, as in `{**cfg.model_dump(), "num_heads": ...}`
    assert ModelConfig(**{**dumped, "num_heads": 2, "num_kv_heads": 1}).attention.num_heads == 2


def test_a_section_field_added_since_is_hashed_under_its_dotted_name_only_off_its_default():
    dumped = tiny().model_dump(mode="json")
    dumped["attention"]["added_later"] = True  # as if AttentionConfig had grown it, default False
    assert flat_keys.unfold(dumped)["attention.added_later"] is True


def test_every_preset_keeps_the_id_fields_it_had_before_the_sections():
    """tests/model_ids_v1.json: the sha256 of each preset's id fields as the flat ModelConfig
    (107 fields, before engine/models/sections.py) gave them. The sections change no id."""
    pinned = json.loads((Path(__file__).parent / "model_ids_v1.json").read_text())
    for name, digest in pinned.items():
        raw = load_preset(name, "test")
        raw.pop("compute", None)
        fields = model_id_fields(ModelConfig(**raw).model_dump(mode="json"), ModelConfig)
        assert hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest() == digest, name


def test_a_section_given_as_a_value_is_refused_in_one_sentence_naming_it():
    from engine.config import ConfigError, load_config
    from engine.train.config import TrainConfig

    with pytest.raises(ConfigError, match=r"section 'attention' must be a mapping of its fields, got 4") as refusal:
        load_config(tree={"model": {"preset": "tiny", "attention": 4, "num_heads": 2}}, schema=TrainConfig)
    assert len(str(refusal.value).splitlines()) == 1


def test_the_model_config_keeps_model_wide_fields_and_sections_only():
    """Issue 59's bound: the per-layer parts live in sections (engine/models/sections.py) and
    the optional per-kind sections, not as flat fields of ModelConfig (107 before)."""
    fields = ModelConfig.model_fields
    assert len(fields) <= 40, sorted(fields)
    assert not set(fields) & set(flat_keys.FLAT)  # every flat name is a section's, none a field

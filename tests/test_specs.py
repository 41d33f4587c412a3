"""Typed per-layer specs (engine/models/specs.py): every preset's layers become specs, the
specs count exactly the parameters the decoder builds from them, and the layers of one stack
share one parameter structure (what lets them be stacked and scanned together)."""

from __future__ import annotations

import math

import jax
import pytest

from engine.config import load_preset, preset_names
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import abstract_model_params
from engine.models.specs import AttentionSpec, LayerSpec, RotarySpec


def preset(name: str) -> ModelConfig:
    raw = load_preset(name, "test")
    raw.pop("compute", None)
    return ModelConfig(**raw)


TINY = [name for name in preset_names() if name.startswith("tiny")]


@pytest.mark.parametrize("name", TINY)
def test_the_specs_count_the_parameters_the_decoder_builds(name):
    cfg = preset(name)
    params = abstract_model_params(cfg, ComputeConfig(), None)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    # the router's choosing bias and DeepSeek-V4's token -> experts table are buffers in
    # transformers, so num_params leaves them out
    buffers = ("b_router_e", "hash_experts_vk")
    counted = [a for path, a in leaves if not any(b in jax.tree_util.keystr(path) for b in buffers)]
    assert sum(math.prod(a.shape) for a in counted) == cfg.num_params()


@pytest.mark.parametrize("name", preset_names())
def test_layers_of_one_stack_share_their_parameter_structure(name):
    specs = preset(name).layer_specs()
    by_stack: dict[str, set] = {}
    for spec in specs:
        mixer = spec.mixer.structure() if hasattr(spec.mixer, "structure") else spec.mixer  # (less its call fields)
        ffn = spec.ffn.structure() if hasattr(spec.ffn, "structure") else spec.ffn  # (Gemma 3n's gate sparsity)
        by_stack.setdefault(spec.stack, set()).add((mixer, ffn, spec.norm, spec.pre_norms, spec.post_norms))
    assert all(len(kinds) == 1 for kinds in by_stack.values()), by_stack.keys()


def test_a_spec_is_frozen_hashable_and_refuses_unknown_fields():
    spec = AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=8, window=5, rope=RotarySpec(theta=500.0))
    assert hash(spec) == hash(AttentionSpec(**spec.model_dump()))
    assert spec.structure() == AttentionSpec(num_heads=6, num_kv_heads=2, head_dim=8)  # window, RoPE: call fields
    with pytest.raises(ValueError):
        spec.model_copy(update={}).__setattr__("num_heads", 3)
    with pytest.raises(ValueError, match="kv_head"):
        LayerSpec.model_validate({"stack": "blocks", "mixer": {"kind": "attention", "kv_head": 2}, "ffn": None})
    with pytest.raises(ValueError, match="'attention', 'mla'"):
        LayerSpec.model_validate({"stack": "blocks", "mixer": {"kind": "lstm"}, "ffn": None})

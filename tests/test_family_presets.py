"""Every registered family has a tiny preset that bench/family_sweep.py runs (issue 59: expert
parallelism, GRPO, LoRA and `trainflow plan` on every family; bench/results/family_sweep.json),
every tiny preset takes a LoRA adapter (a B on exactly the weights its tensor table names for
the targeted modules) or refuses it in one sentence, and one preset of each
kind of layer the newer families brought (block-sparse attention beside experts, a Mamba2
hybrid, attention whose values are narrower than its keys, with sinks) trains its adapter and
compiles for a v5e-8 slice."""

from __future__ import annotations

import importlib.util

import jax
import pytest

from bench.family_sweep import CASES, LORA, model_config, run_lora_plan
from engine.config import load_preset, preset_names
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.families import family_names, get_family
from engine.models.lora import is_adapter_key
from engine.models.lora_targets import adaptable_modules
from engine.models.params import abstract_model_params

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")


def preset(name: str) -> ModelConfig:
    raw = load_preset(name, "test")
    raw.pop("compute", None)
    return ModelConfig(**raw)


def test_the_sweep_covers_every_registered_family():
    assert set(family_names()) <= {model_config(name).family for name in CASES}


def test_every_tiny_preset_takes_a_lora_adapter_or_refuses_it_in_one_sentence():
    for name in (n for n in preset_names() if n.startswith("tiny")):
        cfg = preset(name)
        try:
            targets = LORA.targets(cfg)
        except ValueError as refusal:
            assert len(str(refusal).splitlines()) == 1 and f"'{cfg.family}'" in str(refusal), name
            continue
        params = abstract_model_params(cfg, ComputeConfig(), None, LORA)
        paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
        b_factors = {p for p in paths if is_adapter_key(p[-1]) and p[-1].endswith("_lora_b")}
        modules, _ = adaptable_modules(cfg)
        top = get_family(cfg.family).tensor_table(cfg)[0]
        wanted = {
            (*(() if spec in top else (spec.stack,)), *part[:-1], part[-1] + "_lora_b")
            for m in targets
            for spec in modules[m]
            for part in (spec.path, *spec.fused_with)
        }
        # a module that holds a targeted weight but takes no adapter would train nothing there
        assert targets and b_factors == wanted, (name, sorted(b_factors ^ wanted))


@needs_libtpu
@pytest.mark.parametrize("name", ["tiny-minimax-m3-vl-text", "tiny-bamba", "tiny-mimo-v2-flash"])
def test_the_adapter_trains_and_the_step_compiles_for_a_tpu_slice(name):
    record = run_lora_plan(name)
    losses = record["lora"]["loss"]
    assert losses[-1] < losses[0] and record["lora"]["adapter_params"] > 0
    assert record["plan"] == {**record["plan"], "how": "compiled", "fits": True, "with_lora": True}

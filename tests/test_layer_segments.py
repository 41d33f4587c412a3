"""The multi-unit layer schedule (engine/models/transformer.py: layer_segments): a layer
pattern that one repeating unit covers badly (Nemotron-H's M-M-M*-M-M*-..., attention layers
breaking the M- period irregularly) scans several units, units inside units and runs inside
units; the scanned model gives exactly what running the layers one by one gives.

- the schedule covers every layer once, in order, and compiles fewer bodies than one unit;
- patterns one unit already covers (every preset but Nemotron-H's) keep layer_schedule's
  program (layer_segments is None);
- a tiny Nemotron-H-shaped hybrid's logits, float32, scanned by segments == unrolled, bitwise
  (both jitted);
- a mixture of experts whose dense and expert layers alternate irregularly: a training step's
  loss, router statistics and every gradient equal the unrolled step's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import resolve_model_preset
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import apply_model, graphdef_of
from engine.models.transformer import Segment, layer_schedule, layer_segments, segments_cost
from engine.train.step import lm_loss_fn
from tests.test_moe import random_params

REPO = Path(__file__).resolve().parent.parent
KIND = {"M": ("mamba2", "none"), "-": ("none", "mlp"), "*": ("attention", "none")}


def hybrid(pattern: str) -> ModelConfig:
    """A tiny Nemotron-H of `pattern` (M Mamba2, - MLP, * attention), odd sizes."""
    return ModelConfig(
        family="nemotron_h",
        vocab_size=37,
        d_model=22,
        num_layers=len(pattern),
        num_heads=2,
        num_kv_heads=1,
        head_dim=6,
        mlp_dim=18,
        activation="relu2",
        mlp_gated=False,
        rope_pattern=[False],
        tie_embeddings=False,
        mixer_pattern=[KIND[c][0] for c in pattern],
        ffn_pattern=[KIND[c][1] for c in pattern],
        mamba2=dict(num_heads=2, head_dim=5, state_size=7, n_groups=1, conv_kernel=4, chunk_size=8),
    )


def covered(segments, offset: int = 0) -> list[int]:
    """The layers a schedule runs, in order."""
    layers: list[int] = []
    for seg in segments:
        for step in range(seg.steps):
            start = offset + seg.start + step * seg.period
            layers += [start] if seg.unit is None else covered(seg.unit, start)
    return layers


def per_layer(cfg: ModelConfig, params: dict) -> dict:
    """Stacked params as the unrolled model holds them: one entry per layer of each stack."""
    return {
        **params,
        **{
            name: {i: jax.tree.map(lambda a, i=i: a[i], params[name]) for i in range(len(indices))}
            for name, indices in cfg.layer_stacks()
        },
    }


def test_nemotron_h_8b_scans_several_units():
    cfg = ModelConfig.model_validate(resolve_model_preset({"model": "nemotron-h-8b"}, "nemotron-h-8b")["model"])
    layers = cfg.layer_pattern()
    assert layer_schedule(layers) == (41, 2, 5)  # one unit: 41 layers one by one, then M- five times, one more
    segments = layer_segments(layers)
    assert covered(segments) == list(range(52))
    assert segments_cost(segments) == 7  # M, [- M] x3, [* [- M] x5] x4, -: seven layer bodies, not 44
    assert segments[2] == Segment(7, 11, 4, (Segment(0, 1, 1), Segment(1, 2, 5, (Segment(0, 1, 1), Segment(1, 1, 1)))))


@pytest.mark.parametrize(
    "fields",
    [
        dict(num_layers=32),
        dict(family="gemma3", num_layers=26, attention_pattern=["local"] * 5 + ["global"], sliding_window=4),
        dict(family="qwen3_moe", num_layers=48, ffn_pattern=["mlp", "moe"], num_experts=4, experts_per_token=2),
        dict(family="smollm3", num_layers=36, rope_pattern=[True, True, True, False]),
        dict(family="qwen3", num_layers=7, mixer_pattern=["gated_delta", "gated_delta", "attention"]),
    ],
)
def test_patterns_one_unit_covers_keep_its_program(fields):
    tiny = dict(vocab_size=17, d_model=8, num_heads=2, num_kv_heads=1, head_dim=4, mlp_dim=8)
    if "mixer_pattern" in fields:
        tiny["gated_delta"] = dict(num_key_heads=1, num_value_heads=2, key_head_dim=4, value_head_dim=4)
    assert layer_segments(ModelConfig(**{**tiny, **fields}).layer_pattern()) is None


PATTERNS = ("M-M-M*-M-M*-M-M*-M-M-", "MM*-MM*-M-")  # units inside units; a run of two inside a unit


def scanned_and_unrolled_logits(pattern: str) -> tuple[np.ndarray, np.ndarray]:
    """A tiny hybrid's logits (one row right-padded), scanned by segments and unrolled, both jitted."""
    cfg = hybrid(pattern)
    segments = layer_segments(cfg.layer_pattern())
    assert segments is not None and covered(segments) == list(range(len(pattern)))
    scanned, unrolled = ComputeConfig(), ComputeConfig(scan_layers=False)
    params = random_params(cfg, scanned)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 13)))
    mask = jnp.ones((2, 13), jnp.int32).at[1, 10:].set(0)
    got = jax.jit(lambda p: apply_model(graphdef_of(cfg, scanned), p, tokens, None, mask))(params)
    want = jax.jit(lambda p: apply_model(graphdef_of(cfg, unrolled), p, tokens, None, mask))(per_layer(cfg, params))
    return np.asarray(got), np.asarray(want)


def test_a_hybrid_scanned_by_segments_is_the_unrolled_model_bitwise():
    """Bitwise under XLA's default CPU compiler, in a child process: this session compiles at
    LLVM -O0 with the loop emitter (conftest.py), where the scan's body and the unrolled layers
    are fused apart and round differently (6e-7 here), so here they agree to 1e-5."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-m", "tests.test_layer_segments"], env=env, cwd=REPO, capture_output=True, text=True
    )
    assert child.returncode == 0, child.stderr[-2000:]
    for pattern, (diff, scale) in json.loads(child.stdout.splitlines()[-1]).items():
        assert scale > 0.1, pattern
        assert diff == 0.0, f"{pattern}: max |dlogit| {diff}"
    got, want = scanned_and_unrolled_logits(PATTERNS[1])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_training_step_over_irregular_expert_layers_is_the_unrolled_step():
    """Dense and expert layers as [mlp moe moe] x2 then [mlp moe] x3: two units, a run of two
    expert layers inside the first; each expert layer's router statistics reach its own bias."""
    preset = resolve_model_preset({"model": "tiny-qwen3-moe-mixed"}, "tiny")["model"]
    ffn = ["mlp", "moe", "moe", "mlp", "moe", "moe", "mlp", "moe", "mlp", "moe", "mlp", "moe"]
    cfg = ModelConfig.model_validate(
        {**preset, "num_layers": 12, "ffn_pattern": ffn, "router_score": "sigmoid", "router_bias": True}
    )
    segments = layer_segments(cfg.layer_pattern())
    assert segments is not None and segments_cost(segments) < 6 and covered(segments) == list(range(12))
    scanned, unrolled = ComputeConfig(), ComputeConfig(scan_layers=False)
    params = random_params(cfg, scanned)
    experts = len(dict(cfg.layer_stacks())["blocks"])
    bias = np.random.default_rng(3).normal(size=(experts, cfg.moe.num_experts)) * 0.1
    params["blocks"]["mlp"]["b_router_e"] = jnp.asarray(bias, jnp.float32)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 12))
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(12), (2, 12)),
        "segment_ids": np.ones((2, 12), np.int32),
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": np.ones((2, 12), np.float32),
    }
    results = []
    for compute, p in ((scanned, params), (unrolled, per_layer(cfg, params))):
        step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
        results.append(step(p, batch, 24.0))
    ((loss_a, aux_a), grads_a), ((loss_b, aux_b), grads_b) = results
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for key in aux_a:
        np.testing.assert_allclose(aux_a[key], aux_b[key], rtol=1e-5, atol=1e-7, err_msg=key)
    bias_grad = np.asarray(grads_a["blocks"]["mlp"]["b_router_e"])
    assert np.abs(bias_grad[1] - bias_grad[2]).max() > 0  # each layer its own imbalance
    for name, indices in cfg.layer_stacks():
        for i in range(len(indices)):
            for a, b in zip(
                jax.tree.leaves(jax.tree.map(lambda x, i=i: x[i], grads_a[name])),
                jax.tree.leaves(grads_b[name][i]),
                strict=True,
            ):
                np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def pads_to(jaxpr, shapes: set) -> list:
    """Shapes in `shapes` that a pad in `jaxpr` (its inner jaxprs included) produces."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pad" and tuple(eqn.outvars[0].aval.shape) in shapes:
            found.append(tuple(eqn.outvars[0].aval.shape))
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += pads_to(sub, shapes)
    return found


@pytest.mark.parametrize("pattern", ["M-M-M*-M-M*-M-M*-M-M-", None])
def test_a_stack_taken_in_several_ranges_has_one_gradient_not_one_per_range(pattern):
    """A stack whose layers several parts of the schedule take (Nemotron-H's Mamba2 and MLP
    stacks; the expert stack of irregular expert layers) is split once: its gradient is one
    concatenation. Sliced per range, each range's gradient was padded to the whole stack and
    the pads added, a stack-sized temporary per range (Nemotron 3 Nano's experts on a v5p-8:
    184 GiB per chip, 132 GiB split, at 1,024 positions; docs/engine.md)."""
    if pattern is None:
        preset = resolve_model_preset({"model": "tiny-qwen3-moe-mixed"}, "tiny")["model"]
        ffn = ["mlp", "moe", "moe", "mlp", "moe", "moe", "mlp", "moe", "mlp", "moe", "mlp", "moe"]
        cfg = ModelConfig.model_validate({**preset, "num_layers": 12, "ffn_pattern": ffn})
    else:
        cfg = hybrid(pattern)
    segments = layer_segments(cfg.layer_pattern())
    assert segments is not None and len(segments) > 1
    compute = ComputeConfig()
    params = random_params(cfg, compute)
    stacks = {name: indices for name, indices in cfg.layer_stacks() if len(indices) > 1}
    shapes = {a.shape for name in stacks for a in jax.tree.leaves(params[name])}
    tokens = jnp.zeros((1, 9), jnp.int32)
    loss = lambda p: apply_model(graphdef_of(cfg, compute), p, tokens, None, jnp.ones((1, 9), jnp.int32)).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(params).jaxpr
    assert pads_to(jaxpr, shapes) == []
    assert any(eqn.primitive.name == "split" for eqn in jaxpr.eqns)


if __name__ == "__main__":  # the child of the bitwise test: max |dlogit| and the logits' scale per pattern
    out = {}
    for pattern in PATTERNS:
        got, want = scanned_and_unrolled_logits(pattern)
        out[pattern] = (float(np.abs(got - want).max()), float(np.abs(want).max()))
    print(json.dumps(out))

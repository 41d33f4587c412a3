"""Expert parallelism on one family of each router and expert kind (issues 50 and 51): a
training step with the experts split over `expert` (data 4 x expert 2 on 8 simulated devices,
the tokens reaching their experts by all-to-all: engine/models/moe_ep.py) equals the same step
on one device, in loss, router balance loss and every gradient.

The families' tiny presets cut to two layers (one of each kind the preset mixes), at their
own initialisation with the routers scaled x20 so that no token's top-k is a near tie that
float32 rounding could flip. bench/family_sweep.py runs every family with experts at expert
2 and 4 over two steps, and a GRPO step on every family (docs/engine.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import resolve_model_preset
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import graphdef_of, init_params, param_shardings
from engine.ops.partitioning import use_mesh
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import batch_sharding, global_array, make_mesh
from engine.train.step import lm_loss_fn

# (preset, overrides) per router / expert kind.
KINDS = {
    # softmax top-3 without renormalising; dense and expert layers mixed (decoder_sparse_step 2)
    "softmax_topk": ("tiny-qwen3-moe-mixed", dict(num_layers=2)),
    # sigmoid scores with a choosing (correction) bias, a shared expert, a dense first layer
    "sigmoid_bias": ("tiny-glm4-moe", dict(num_layers=2)),
    # softmax group-limited (the best expert of each group picks 2 of 4 groups), latent attention
    "group_limited": ("tiny-deepseek-v2", dict(num_layers=2)),
    # top-1 sigmoid that scales the expert's input, a shared expert, MoE layers every other layer
    "top1_sigmoid_shared": ("tiny-llama4", dict(num_layers=2, rope_pattern=[True, False])),
    # experts in a Mamba2 hybrid beside a shared MLP
    "hybrid_mamba2": ("tiny-granite-hybrid-moe", dict(num_layers=2, mixer_pattern=["mamba2", "attention"])),
    # experts and a gated shared expert in a Gated DeltaNet hybrid
    "hybrid_deltanet": ("tiny-qwen3-next", dict(num_layers=2, mixer_pattern=["gated_delta", "attention"])),
}
ROWS, SEQ = 8, 10


def model_config(kind: str) -> ModelConfig:
    preset, overrides = KINDS[kind]
    tree = dict(resolve_model_preset({"model": preset}, preset)["model"])
    tree.pop("compute", None)
    return ModelConfig.model_validate({**tree, "vocab_size": 61, **overrides})


def one_step(cfg: ModelConfig, compute: ComputeConfig, params_host: dict, batch: dict, mesh):
    """(loss, balance loss, gradients as numpy, optimized HLO) of a step on `mesh`."""
    step = jax.jit(jax.value_and_grad(lm_loss_fn(graphdef_of(cfg, compute)), has_aux=True))
    params = jax.device_put(params_host, param_shardings(cfg, compute, mesh)[1])
    sharded = {k: global_array(v, batch_sharding(mesh)) for k, v in batch.items()}
    denominator = float(batch["loss_mask"].sum())
    with use_mesh(mesh):
        compiled = step.lower(params, sharded, denominator).compile()
        (loss, aux), grads = compiled(params, sharded, denominator)
    return float(loss), float(aux["moe_balance_loss"]), jax.device_get(grads), compiled.as_text(), params


@pytest.mark.parametrize("kind", list(KINDS))
def test_expert_parallel_step_equals_one_device(kind):
    cfg = model_config(kind)
    compute = ComputeConfig(dtype="float32")
    one = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    scaled = lambda path, x: x * 20 if "w_router" in jax.tree_util.keystr(path) else x  # noqa: E731
    params_host = jax.tree_util.tree_map_with_path(scaled, jax.device_get(init_params(cfg, compute, one, 0)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (ROWS, SEQ))
    segments = np.ones((ROWS, SEQ), np.int32)
    segments[3, 6:] = 0  # a right-padded row: out of the loss and the router's statistics
    batch = {
        "tokens": tokens,
        "positions": np.broadcast_to(np.arange(SEQ), (ROWS, SEQ)),
        "segment_ids": segments,
        "targets": np.roll(tokens, -1, 1),
        "loss_mask": segments.astype(np.float32),
    }
    loss_1, balance_1, grads_1, _, _ = one_step(cfg, compute, params_host, batch, one)
    loss_8, balance_8, grads_8, hlo, params_8 = one_step(
        cfg, compute, params_host, batch, make_mesh(MeshConfig(data=4, expert=2))
    )
    routed = [p for p in jax.tree_util.tree_leaves_with_path(params_8) if "w_up_edf" in jax.tree_util.keystr(p[0])]
    assert routed and all("expert" in leaf.sharding.spec for _, leaf in routed)  # each device holds half the experts
    assert "all-to-all" in hlo
    assert np.isfinite(loss_1) and loss_8 == pytest.approx(loss_1, rel=1e-6)
    assert balance_8 == pytest.approx(balance_1, rel=1e-6)
    # float32 sums in another order: each gradient to 1e-5 of its largest entry (at least
    # 1e-3 of the largest of all, for a gradient that is all rounding)
    top = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads_1))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_1), jax.tree.leaves(grads_8), strict=True):
        scale = max(float(np.abs(a).max()), 1e-3 * top)
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))

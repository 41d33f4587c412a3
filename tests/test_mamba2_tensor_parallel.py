"""Mamba2 layers with tensor parallelism (engine/models/mamba2.py, Mamba2._mix_by_heads): the
tensor axis splits the mixer's heads (in_proj's z, x, dt sections and the convolution of x by
heads, B and C by groups when the axis divides n_groups, out_proj's rows and the norm by heads).
A training step of a tiny Nemotron-H hybrid (Mamba2, attention and MLP layers; packed rows with
padding) gives one device's loss and gradients on tensor=2 and tensor=4 meshes, and so does a
tiny Falcon-H1 (attention and Mamba2 side by side; one group, in_proj's sections scaled)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from engine.config import load_config
from engine.models.config import ComputeConfig
from engine.models.mamba2 import Mamba2
from engine.models.params import init_params
from engine.ops.partitioning import MESH_AXES, use_mesh
from engine.ops.ssd import Mamba2Dims
from engine.train.config import TrainConfig
from engine.train.trainer import Trainer

MODEL = {
    "family": "nemotron_h",
    "vocab_size": 44,
    "d_model": 24,
    "num_layers": 4,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 6,
    "mlp_dim": 20,
    "max_seq_len": 64,
    "activation": "relu2",
    "mlp_gated": False,
    "rope_pattern": [False],
    "mixer_pattern": ["mamba2", "none", "attention", "mamba2"],
    "ffn_pattern": ["none", "mlp", "none", "none"],
    # 4 heads of 6 in 2 groups: tensor=2 splits the groups, tensor=4 keeps B and C whole
    "mamba2": {"num_heads": 4, "head_dim": 6, "state_size": 5, "n_groups": 2, "conv_kernel": 4, "chunk_size": 8},
}

MODELS = {"nemotron_h": MODEL, "falcon_h1": {"preset": "tiny-falcon-h1", "vocab_size": 44, "num_layers": 2}}
_ONE_DEVICE: dict = {}


def _step(model: str, mesh: dict, devices: int):
    cfg = load_config(
        tree={"model": dict(MODELS[model]), "mesh": mesh, "data": {"batch_size": 4, "seq_len": 19}}, schema=TrainConfig
    )
    trainer = Trainer(cfg, devices=jax.devices()[:devices])
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 44, (4, 20)).astype(np.int32)
    segments = np.ones((4, 19), np.int32)
    segments[0, 7:], segments[1, 15:] = 2, 0  # a packed second document, a right-padded row
    positions = np.tile(np.arange(19, dtype=np.int32), (4, 1))
    positions[0, 7:] -= 7
    batch = trainer.global_batch(
        {
            "tokens": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": positions,
            "segment_ids": segments,
            "loss_mask": (segments > 0).astype(np.float32),
        }
    )
    params = init_params(trainer.cfg.model, trainer.cfg.compute, trainer.mesh, seed=0)
    grad_fn = jax.jit(
        jax.value_and_grad(trainer.objective.loss_fn, has_aux=True),
        in_shardings=(trainer.param_shardings, trainer.batch_sharding, None),
    )
    with use_mesh(trainer.mesh):
        (loss, _), grads = grad_fn(params, batch, jnp.float32(60))
    return params, float(loss), grads


@pytest.mark.parametrize("model, tensor", [("nemotron_h", 2), ("nemotron_h", 4), ("falcon_h1", 2)])
def test_a_training_step_with_mamba2_heads_over_the_tensor_axis_equals_one_device(model, tensor):
    if model not in _ONE_DEVICE:
        _ONE_DEVICE[model] = _step(model, {"data": 1}, 1)
    _, loss_1, grads_1 = _ONE_DEVICE[model]
    params, loss_n, grads_n = _step(model, {"data": 8 // tensor // 2, "fsdp": 2, "tensor": tensor}, 8)
    assert np.isfinite(loss_1) and loss_n == pytest.approx(loss_1, rel=1e-5)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_1), jax.tree.leaves(grads_n)):
        np.testing.assert_allclose(
            b, a, rtol=1e-4, atol=1e-5 * float(np.abs(a).max()), err_msg=jax.tree_util.keystr(path)
        )
    paths = {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    mamba = {
        key.split("'")[-2]: leaf
        for key, leaf in paths.items()
        if "w_out_fd" in key or "norm_f" in key or "w_in_dp" in key
    }
    inner = 24 if model == "nemotron_h" else 64  # (layers, ...) arrays below
    assert mamba["w_out_fd"].sharding.spec == P(None, "tensor", "fsdp")  # out_proj's rows by heads
    assert mamba["w_out_fd"].addressable_shards[0].data.shape[1] == inner // tensor
    assert mamba["norm_f"].sharding.spec == P(None, "tensor")
    assert mamba["w_in_dp"].sharding.spec == P(None, "fsdp", None)  # z|x|B|C|dt columns: split by embed only


def test_the_tensor_axis_divides_the_mixers_work():
    """One Mamba2 mixer compiled on tensor=4 does about a quarter of one device's FLOPs per device
    (its heads' share of in_proj, convolution, scan and out_proj), not all of them."""
    dims = Mamba2Dims(num_heads=8, head_dim=16, state_size=16, n_groups=4, conv_kernel=4, norm_eps=1e-5)
    graph, state = nnx.split(Mamba2(dims, 64, ComputeConfig(), rngs=nnx.Rngs(0), chunk_size=32))
    x_btd = jnp.ones((2, 128, 64), jnp.float32)
    flops = {}
    for tensor in (1, 4):
        mesh = Mesh(np.asarray(jax.devices()[:tensor]).reshape(1, 1, 1, 1, tensor), MESH_AXES)

        def mix(state, x_btd, mesh=mesh):
            with use_mesh(mesh):
                return nnx.merge(graph, state).mix(x_btd)[0]

        with use_mesh(mesh):
            cost = jax.jit(mix).lower(state, x_btd).compile().cost_analysis()
        flops[tensor] = (cost[0] if isinstance(cost, list) else cost)["flops"]
    assert flops[4] < 0.35 * flops[1], flops

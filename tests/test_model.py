"""Model behaviour: packing isolation, remat/scan invariance, sharded == unsharded."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from engine import compat
from engine.config import load_config
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import apply_model, graphdef_of, init_params
from engine.models.rope import apply_rope, rope_inverse_frequencies
from engine.models.transformer import Transformer
from engine.train.config import TrainConfig
from engine.train.trainer import Trainer

# Odd sizes so a transposed or mis-broadcast dimension cannot hide.
ODD = dict(
    vocab_size=37, d_model=22, num_layers=3, num_heads=6, num_kv_heads=2, head_dim=10, mlp_dim=26, max_seq_len=64
)


def test_a_documents_logits_in_a_packed_row_equal_its_logits_alone():
    cfg = ModelConfig(**ODD)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(0)
    doc_a, doc_b = rng.integers(0, 37, 9), rng.integers(0, 37, 13)
    packed = np.concatenate([doc_a, doc_b, [0, 0]])[None]
    segments = np.array([[1] * 9 + [2] * 13 + [0, 0]])
    positions = np.array([list(range(9)) + list(range(13)) + [0, 0]])
    logits_packed = model(jnp.asarray(packed), jnp.asarray(positions), jnp.asarray(segments))
    alone_a = model(jnp.asarray(doc_a[None]))
    alone_b = model(jnp.asarray(doc_b[None]))
    np.testing.assert_allclose(logits_packed[0, :9], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(logits_packed[0, 9:22], alone_b[0], atol=1e-5)
    # Without segment ids the second document would attend to the first: the test can fail.
    unsegmented = model(jnp.asarray(packed), jnp.asarray(positions))
    assert np.abs(np.asarray(unsegmented[0, 9:22] - alone_b[0])).max() > 1e-3


_NO_REMAT: dict = {}  # the parameters and gradients without remat


@pytest.mark.parametrize("unroll", [ODD["num_layers"], 1], ids=["unrolled", "loop"])
@pytest.mark.parametrize("remat", ["full", "save_dots", "save_qkv_proj"])
def test_remat_changes_memory_not_math(remat, unroll):
    """The gradients under each remat policy, the layer loop rolled or unrolled, equal those
    without remat (computed once for every case)."""
    base = ModelConfig(**ODD)
    remat_graphdef = graphdef_of(base, ComputeConfig(remat=remat, scan_unroll=unroll))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 37, (2, 11)))

    def grad(gd, p):
        return jax.jit(jax.grad(lambda p: jnp.mean(apply_model(gd, p, tokens) ** 2)))(p)

    if "remat" not in _NO_REMAT:
        model = Transformer(base, ComputeConfig(scan_unroll=1), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(model)
        params = nnx.to_pure_dict(state)
        _NO_REMAT["remat"] = params, grad(graphdef, params)
    params, g0 = _NO_REMAT["remat"]
    g1 = grad(remat_graphdef, params)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), g0, g1)


def test_scanned_and_unrolled_layers_compute_the_same_function():
    cfg = ModelConfig(**ODD)
    scanned = nnx.to_pure_dict(nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))[1])
    graphdef, state = nnx.split(Transformer(cfg, ComputeConfig(scan_layers=False), rngs=nnx.Rngs(0)))
    unrolled = nnx.to_pure_dict(state)
    for i in range(cfg.num_layers):  # copy layer i of the stacked params into block i
        unrolled["blocks"][i] = jax.tree.map(lambda x: x[i], scanned["blocks"])  # noqa: B023
    for key in ("embed_vd", "final_norm", "lm_head_dv"):
        unrolled[key] = scanned[key]
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 37, (2, 7)))
    a = apply_model(graphdef_of(cfg, ComputeConfig()), scanned, tokens)
    b = apply_model(graphdef, unrolled, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5)


def _compiled_grad(compute: ComputeConfig) -> str:
    """The optimized HLO of a loss gradient under `compute`, on CPU, as XLA compiles it outside
    the suite: with its MLIR fusion emitters (tests/conftest.py turns them off, and XLA's loop
    emitter turns the embedding gradient's scatter into a while loop of its own)."""
    cfg = ModelConfig(**ODD)
    graphdef, state = nnx.split(Transformer(cfg, compute, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 37, (2, 11)))
    grad = jax.jit(jax.grad(lambda p: jnp.mean(apply_model(graphdef, p, tokens) ** 2)))
    lowered = grad.lower(nnx.to_pure_dict(state))
    return lowered.compile(compiler_options=compat.cpu_fusion_emitter_options()).as_text()


def test_the_layer_scan_is_unrolled_on_cpu_and_remat_still_recomputes():
    """scan_unroll auto runs a bfloat16 stack as straight-line code on CPU (no while loop),
    and keeps the loop in float32, as 1 does; under remat the unrolled stack still
    recomputes its layers' products in the backward pass (the same gradients:
    test_remat_changes_memory_not_math)."""
    bf16 = dict(dtype="bfloat16")
    unrolled = _compiled_grad(ComputeConfig(**bf16))
    assert " while(" not in unrolled
    assert " while(" in _compiled_grad(ComputeConfig(scan_unroll=1, **bf16))
    assert " while(" in _compiled_grad(ComputeConfig())
    dots = lambda hlo: hlo.count(" dot(") + hlo.count("__ynn")  # YNNPACK fusions hold most of them
    plain, full = dots(unrolled), dots(_compiled_grad(ComputeConfig(remat="full", **bf16)))
    assert full > plain, (plain, full)


def test_llama3_rope_scaling_matches_the_published_formula():
    from engine.models.config import RopeScaling

    scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position=8192)
    ours = np.asarray(rope_inverse_frequencies(128, 500000.0, scaling))
    # Reference: the per-frequency loop from Meta's llama-models repository.
    base = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    ref = []
    for f in base:
        wavelen = 2 * np.pi / f
        if wavelen < 8192 / 4.0:
            ref.append(f)
        elif wavelen > 8192 / 1.0:
            ref.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            ref.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(ours, np.array(ref), rtol=1e-5)


def test_rope_from_a_position_table_equals_the_direct_rotation():
    """Decoding looks cos/sin up in a table of the cache's length (rope.py); the rotation
    must be the one training computes, for every position below the limit, under jit (where
    XLA may fold the table) and with YaRN's scale."""
    inv_freq = rope_inverse_frequencies(10, 10000.0, None)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 5, 6, 10)), jnp.float32)
    positions = jnp.asarray([[0, 1, 2, 3, 4], [0, 0, 7, 8, 9], [63, 62, 40, 1, 0]], jnp.int32)
    for scale in (1.0, 1.3):
        direct = jax.jit(lambda x, p: apply_rope(x, p, inv_freq, scale))(x, positions)  # noqa: B023
        table = jax.jit(lambda x, p: apply_rope(x, p, inv_freq, scale, max_position=64))(x, positions)  # noqa: B023
        np.testing.assert_allclose(np.asarray(table), np.asarray(direct), rtol=1e-6, atol=1e-6)
    # A table too short for a position is not silently clamped to its last row.
    short = jax.jit(lambda x, p: apply_rope(x, p, inv_freq, 1.0, max_position=10))(x, positions)
    assert not np.allclose(np.asarray(short[2, :3]), np.asarray(direct[2, :3]), atol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_training_gradient_evaluates_rope_cos_and_sin_once_per_position(dtype):
    """The forward and backward rotations look cos and sin up in one (t, head_dim / 2) table:
    computed directly, XLA fused them into every rotation and evaluated them again for each
    head of q and k in every layer, forward and backward (docs/benchmarks.md)."""
    hlo = _compiled_grad(ComputeConfig(dtype=dtype))  # tokens (2, 11), head_dim 10
    shapes = re.findall(r"= f32\[([\d,]*)\]\S* (?:cosine|sine)\(", hlo)
    assert shapes and all(math.prod(int(d) for d in shape.split(",") if d) <= 11 * 5 for shape in shapes), shapes


def _sharded_case(mesh):
    model = {**ODD, "vocab_size": 38, "d_model": 24, "mlp_dim": 28}  # divisible by the mesh axes
    cfg = load_config(tree={"model": model, "mesh": mesh, "data": {"batch_size": 8, "seq_len": 16}}, schema=TrainConfig)
    devices = jax.devices()[: 1 if mesh == {"data": 1} else 8]
    return Trainer(cfg, devices=devices)


def test_a_step_on_a_2x2x2_mesh_equals_one_device_and_params_are_sharded():
    single = _sharded_case({"data": 1})
    sharded = _sharded_case({"data": 2, "fsdp": 2, "tensor": 2})
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 38, (8, 17)).astype(np.int32)
    batch_np = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.tile(np.arange(16, dtype=np.int32), (8, 1)),
        "segment_ids": np.ones((8, 16), np.int32),
        "loss_mask": np.ones((8, 16), np.float32),
    }
    results = []
    for trainer in (single, sharded):
        params = init_params(trainer.cfg.model, trainer.cfg.compute, trainer.mesh, seed=0)
        batch = trainer.global_batch(batch_np)
        grad_fn = jax.jit(
            jax.value_and_grad(trainer.objective.loss_fn, has_aux=True),
            in_shardings=(trainer.param_shardings, trainer.batch_sharding, None),
        )
        from engine.ops.partitioning import use_mesh

        with use_mesh(trainer.mesh):
            (loss, _), grads = grad_fn(params, batch, jnp.float32(8 * 16))
        results.append((params, loss, grads))
    (p1, l1, g1), (p8, l8, g8) = results
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), p1, p8)
    np.testing.assert_allclose(l1, l8, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), g1, g8)

    # The rules table, applied: wq (layers, embed, heads, head_dim) -> (None, fsdp, tensor, None).
    wq = p8["blocks"]["attn"]["wq_dnh"]
    assert wq.sharding.spec == P(None, "fsdp", "tensor", None)
    assert wq.addressable_shards[0].data.shape == (3, 12, 3, 10)
    embed = p8["embed_vd"]
    assert embed.sharding.spec == P("tensor", "fsdp")
    assert embed.addressable_shards[0].data.shape == (19, 12)

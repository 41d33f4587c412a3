"""Pipeline parallelism (engine/ops/pipeline.py): a `pipeline` mesh axis of S stages over the
layer stack, GPipe over micro-batches. On 8 simulated CPU devices: the loss and gradients
equal the same model's without stages (combined with fsdp, data and tensor), the stages
really are split over the axis and handed on by a collective-permute, a checkpoint saved
at one pipeline degree continues at another, and a family whose layers differ is refused."""

from __future__ import annotations

import importlib.util
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import ConfigError, load_config, load_preset
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.params import apply_model_with_aux, graphdef_of, init_params
from engine.ops.partitioning import use_mesh
from engine.ops.pipeline import bubble
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import batch_sharding, make_mesh
from engine.train.config import TrainConfig
from engine.train.plan import network_bytes, plan_step
from engine.train.pretrain import run_pretrain
from engine.train.step import cross_entropy
from engine.train.targets import get_target
from tests.test_train import losses, tiny_config

MODEL = ModelConfig(
    vocab_size=98, d_model=48, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=12, mlp_dim=80, max_seq_len=64
)
COMPUTE = ComputeConfig(remat="full", attention_impl="blocked")
B, T = 8, 24


def _batch():
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, MODEL.vocab_size, (B, T)), jnp.int32)
    segments = np.ones((B, T), np.int32)
    segments[0, 10:] = 2  # two documents in a row: their positions restart, as packing writes them
    segments[3, 20:] = 0  # padding
    positions = np.tile(np.arange(T), (B, 1))
    positions[0, 10:] -= 10
    return tokens, jnp.asarray(positions), jnp.asarray(segments)


def _loss_and_grads(mesh_cfg: MeshConfig, compute: ComputeConfig = COMPUTE):
    """(loss, gradients, the compiled step's HLO, the params) of one batch on `mesh_cfg`."""
    mesh = make_mesh(mesh_cfg, jax.devices()[: mesh_cfg.pipeline * int(np.prod(mesh_cfg.sizes()))])
    graphdef = graphdef_of(MODEL, compute)
    tokens, positions, segments = _batch()

    def loss(params):
        logits, _ = apply_model_with_aux(graphdef, params, tokens, positions, segments)
        mask = (segments != 0).astype(jnp.float32)
        total, _ = cross_entropy(logits.astype(jnp.float32), jnp.roll(tokens, -1, axis=1), mask)
        return total / jnp.sum(mask)

    params = init_params(MODEL, compute, mesh, seed=0)
    with use_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss))
        compiled = step.lower(params).compile()
        value, grads = step(params)
    return float(value), grads, compiled.as_text(), params


@pytest.fixture(scope="module")
def without_stages():
    return _loss_and_grads(MeshConfig(data=1, fsdp=2))


@pytest.mark.parametrize(
    ("mesh", "microbatches"),
    [
        (dict(pipeline=2, data=1, fsdp=2), 0),
        (dict(pipeline=4, data=2), 0),
        (dict(pipeline=2, data=1, fsdp=2, tensor=2), 4),
    ],
    ids=["pipeline2-fsdp2", "pipeline4-data2", "pipeline2-fsdp2-tensor2-micro4"],
)
def test_loss_and_gradients_with_pipeline_stages_equal_those_without(without_stages, mesh, microbatches):
    """The same loss and gradients up to float32 summation order (XLA:CPU blocks a product of
    fewer rows differently; the weight gradients are summed over micro-batches and stages):
    the loss within 1e-6 relative, each gradient within 2e-6 of its tensor's largest entry."""
    want_loss, want_grads, _, _ = without_stages
    compute = COMPUTE.model_copy(update={"pipeline_microbatches": microbatches})
    loss, grads, hlo, params = _loss_and_grads(MeshConfig(**mesh), compute)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for path, got in jax.tree_util.tree_leaves_with_path(grads):
        want = np.asarray(_at(want_grads, path))
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=2e-6 * np.abs(want).max(), err_msg=str(path))
    # each device holds its stage's layers only, and hands activations on by collective-permute
    wq = params["blocks"]["attn"]["wq_dnh"]
    assert wq.sharding.spec[0] == "pipeline"
    assert wq.addressable_shards[0].data.shape[0] == MODEL.num_layers // mesh["pipeline"]
    assert "collective-permute" in hlo


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_outside_the_stages_the_rows_are_split_over_them():
    """The embedding and the head run on each stage's share of the rows (MaxText's
    activation_embed_and_logits_batch), not on all of them on every stage."""
    mesh = make_mesh(MeshConfig(pipeline=2, data=1, fsdp=2), jax.devices()[:4])
    assert batch_sharding(mesh).spec[0] == ("pipeline", "data", "expert", "fsdp")
    graphdef = graphdef_of(MODEL, COMPUTE)
    params = init_params(MODEL, COMPUTE, mesh, seed=0)
    tokens = jax.device_put(_batch()[0], batch_sharding(mesh))
    with use_mesh(mesh):
        logits = jax.jit(lambda p, t: apply_model_with_aux(graphdef, p, t)[0])(params, tokens)
    assert logits.sharding.spec[0][0] == "pipeline"
    assert logits.addressable_shards[0].data.shape[0] == B // 4


def test_a_one_way_hand_off_counts_for_the_devices_that_send():
    """network_bytes: a collective-permute's Megascale transfer counts for the share of devices
    that are its pairs' sources (one way between two slices: half), an all-reduce's for all."""
    attrs = 'frontend_attributes={{_xla_host_transfer_handler_name="x",_xla_megascale_transfer_type="{}"'
    one_way = "_xla_megascale_target={{100000->200000},{100001->200001}}"
    both = "_xla_megascale_target={{100000->200000},{200000->100000}}"
    hlo = "\n".join(
        [
            "ENTRY %main (p: bf16[1024]) -> token[] {",
            *(
                f"  %send.{i} = (bf16[1024]{{0}}, u32[], token[]) send(%p, %a), {attrs.format(kind)},{t}}}"
                for i, (kind, t) in enumerate([("ONE_TO_ONE", one_way), ("ONE_TO_ONE", both), ("ALL_REDUCE", "x=1")])
            ),
            "}",
        ]
    )
    assert network_bytes(hlo)["dcn"] == 2048 * (0.5 + 1 + 1)


def test_the_bubble_is_gpipes():
    assert bubble(4, 4) == pytest.approx(3 / 7)
    assert bubble(2, 8) == pytest.approx(1 / 9)


def test_a_family_whose_layers_differ_is_refused_in_one_sentence():
    model = ModelConfig(**load_preset("tiny-qwen3-moe-mixed", "test"))  # dense and expert layers in turn
    mesh = make_mesh(MeshConfig(pipeline=2, data=1), jax.devices()[:2])
    graphdef = graphdef_of(model, COMPUTE)
    params = init_params(model, COMPUTE, mesh, seed=0)
    tokens = jnp.zeros((2, 8), jnp.int32)
    with use_mesh(mesh), pytest.raises(ConfigError, match=r"^mesh.pipeline: the layers of family qwen3_moe .*"):
        jax.eval_shape(lambda p: apply_model_with_aux(graphdef, p, tokens), params)


def test_a_run_saved_at_pipeline_2_continues_at_pipeline_1_and_4_with_the_same_losses(byte_dataset, tmp_path):
    """The checkpoint keeps each stack's `[layers, ...]` layout whatever the degree: restoring
    at another one is Orbax placing the same arrays under another sharding."""
    common = {"model.num_layers": 4, "mesh.data": 1}
    degrees = {
        "pp2": {"mesh.pipeline": 2, "mesh.fsdp": 4},
        "pp1": {"mesh.pipeline": 1, "mesh.fsdp": 8},
        "pp4": {"mesh.pipeline": 4, "mesh.fsdp": 2},
    }
    run_pretrain(tiny_config(byte_dataset, tmp_path / "pp2", steps=6, **common, **degrees["pp2"]))
    for name in ("pp1", "pp4"):
        shutil.copytree(tmp_path / "pp2", tmp_path / name)
    results = {}
    for name, mesh in degrees.items():
        run_pretrain(tiny_config(byte_dataset, tmp_path / name, steps=9, **common, **mesh))
        results[name] = losses(tmp_path / name)
        assert len(results[name]) == 9, name
    for name in ("pp1", "pp4"):
        np.testing.assert_allclose(results[name][5:], results["pp2"][5:], rtol=1e-5, err_msg=name)


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")


@needs_libtpu
def test_the_plan_prices_pipeline_stages_over_slices():
    """Two v5p-8 slices with the 4 layers in 2 stages, one per slice (dcn pipeline 2): each
    chip holds half the layers, and what crosses DCN is the micro-batches' activations at the
    stage boundary, not the gradient all-reduce of `data` over the slices."""

    def plan(mesh):
        tree = {
            "model": {"preset": "tiny", "num_layers": 4},
            "mesh": mesh,
            "data": {"seq_len": 128, "batch_size": 8},
            "steps": 3,
            "compute": {"dtype": "bfloat16", "pipeline_microbatches": 4},
        }
        return plan_step(load_config(tree=tree, schema=TrainConfig), get_target("v5p-8x2"))

    staged = plan({"data": 1, "fsdp": 4, "pipeline": 2, "dcn": {"pipeline": 2}})
    data = plan({"data": 2, "fsdp": 4, "dcn": {"data": 2}})
    assert staged.mesh["pipeline"] == 2
    assert staged.memory.parameters < data.memory.parameters
    assert staged.network["dcn"] > 0
    assert staged.hardware_flops > data.hardware_flops  # the bubble's slots: 1 of 5 per stage
    assert "GPipe bubble (1 of 5 slots" in staged.flops_source

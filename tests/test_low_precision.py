"""compute.matmul_precision: fp8 and int8 training of the layers' matmuls through qwix.

Each recipe's forward product is its quantization written out by hand (absmax per token and
per output channel, engine/ops/low_precision.py: fake_quantize) to float32 rounding; its
product and gradients stay within the recipe's rounding of the float ones; inside a model it
reaches every projection of the layers (LoRA's adapters too) and neither the LM head nor the
MoE router; a few steps of the tiny pretraining end within a stated distance of bf16's loss;
the default leaves the program and the artifact ids as they were."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import load_config
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.params import apply_model, graphdef_of, init_params
from engine.ops.dense import dense, gated_mlp, matmuls_in
from engine.ops.low_precision import fake_quantize
from engine.parallel.config import MeshConfig
from engine.parallel.mesh import make_mesh
from engine.train.config import TrainConfig
from engine.train.plan import format_plan, plan_step
from engine.train.pretrain import run_pretrain
from engine.train.targets import get_target
from tasks.registry import get_stage_kind
from tests.test_train import losses, tiny_config

FORWARD = {"fp8": (jnp.float8_e4m3fn, 0.06), "int8": (jnp.int8, 0.015)}
"""Recipe -> (forward operands' type, bound on the relative error of a product against float32
on normal operands). e4m3 keeps 3 mantissa bits (a relative step of 2^-4 at most), int8 127
steps of the channel's maximum: measured 0.036 and 0.009 at these shapes."""
GRADIENT = {"fp8": 0.10, "int8": 0.025}
"""The same bound for the gradients (their incoming cotangent e5m2 in fp8, 2 mantissa bits;
int8 as the forward): measured 0.053-0.058 and 0.010-0.012."""


def _operands(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return draw(3, 13, 64), draw(64, 40), draw(64, 24), draw(64, 24), draw(24, 40)


def _relative(a, b) -> float:
    a, b = np.float32(a), np.float32(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("recipe", ["fp8", "int8"])
def test_each_recipe_is_its_quantization_written_out_and_near_the_float_product(recipe):
    """dense(x, w) under the recipe equals the float product of x quantized per token and w
    per output channel (within float32 rounding); it and its gradients stay within the
    recipe's bound of the unquantized float32 ones."""
    qtype, bound = FORWARD[recipe]
    x, w, *_ = _operands()
    with matmuls_in(recipe):
        y = dense(x, w)
        grads = jax.grad(lambda x, w: (dense(x, w) ** 2).sum(), argnums=(0, 1))(x, w)
    written_out = fake_quantize(x, qtype, (2,)) @ fake_quantize(w, qtype, (0,))
    np.testing.assert_allclose(np.asarray(y), np.asarray(written_out), rtol=2e-5, atol=2e-5 * float(jnp.abs(y).max()))
    exact = x @ w
    assert 1e-4 < _relative(y, exact) < bound  # quantized (not the plain product), and close
    reference = jax.grad(lambda x, w: ((x @ w) ** 2).sum(), argnums=(0, 1))(x, w)
    for got, want in zip(grads, reference):
        assert got.dtype == want.dtype and 1e-4 < _relative(got, want) < GRADIENT[recipe]


@pytest.mark.parametrize("recipe", ["fp8", "int8"])
def test_the_gated_mlp_in_bfloat16_stays_within_the_recipes_bound(recipe):
    """The MLP's three products in bf16 under the recipe against the float32 MLP: its output and
    its weight gradients within the recipe's bounds (bf16 rounding adds little: 2^-9)."""
    x, _, wg, wu, wd = _operands()

    def mlp(*args):
        return gated_mlp(*args, jax.nn.silu)

    def loss(*args):
        return (mlp(*args).astype(jnp.float32) ** 2).sum()

    narrow = [a.astype(jnp.bfloat16) for a in (x, wg, wu, wd)]
    with matmuls_in(recipe):
        y = mlp(*narrow)
        grads = jax.grad(loss, argnums=(1, 2, 3))(*narrow)
    assert y.dtype == jnp.bfloat16 and _relative(y, mlp(x, wg, wu, wd)) < 1.5 * FORWARD[recipe][1]
    for got, want in zip(grads, jax.grad(loss, argnums=(1, 2, 3))(x, wg, wu, wd)):
        assert got.dtype == jnp.bfloat16 and _relative(got, want) < 1.5 * GRADIENT[recipe]


def test_default_is_the_program_of_before():
    """Inside matmuls_in("default") the gradient's jaxpr is the same text as outside any scope."""
    x, w, wg, wu, wd = _operands(jnp.bfloat16)

    def grad():  # a new function each time: the scope is read while tracing
        def loss(x, w, wg, wu, wd):
            y = dense(x, w).astype(jnp.float32).sum()
            return y + gated_mlp(x, wg, wu, wd, jax.nn.silu).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(1, 2, 3, 4))

    plain = str(jax.make_jaxpr(grad())(x, w, wg, wu, wd))
    with matmuls_in("default"):
        assert str(jax.make_jaxpr(grad())(x, w, wg, wu, wd)) == plain
    with matmuls_in("fp8"):
        assert str(jax.make_jaxpr(grad())(x, w, wg, wu, wd)) != plain


def _dot_operand_types(jaxpr) -> list[tuple[str, str]]:
    """(lhs dtype, rhs dtype) of every dot_general in a jaxpr, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars[:2]))
        for value in eqn.params.values():
            for inner in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found += _dot_operand_types(inner)
    return found


def _forward_dots(model: ModelConfig, recipe: str, lora: LoraConfig | None = None):
    compute = ComputeConfig(dtype="bfloat16", matmul_precision=recipe)
    mesh = make_mesh(MeshConfig(data=1), jax.devices()[:1])
    params = init_params(model, compute, mesh, 0, lora)
    tokens = jnp.zeros((2, 16), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: apply_model(graphdef_of(model, compute, lora), p, tokens))(params)
    return _dot_operand_types(jaxpr.jaxpr)


def test_the_recipe_reaches_every_layer_projection_and_not_the_head_or_the_router():
    """fp8 on the tiny model: the layer scan's seven projections (q, k, v, o, gate, up, down)
    multiply e4m3 operands; the LM head multiplies bf16. With LoRA on q and v the adapters'
    products are quantized too (their x.A as one product, engine/models/lora.py, and one
    (x.A).B each); in a mixture of experts the router stays float32."""
    tiny = load_config(tree={"model": "tiny", "steps": 1}, schema=TrainConfig).model
    fp8 = ("float8_e4m3fn", "float8_e4m3fn")
    dots = _forward_dots(tiny, "fp8")
    assert dots.count(fp8) == 7 and ("bfloat16", "bfloat16") in dots
    assert _forward_dots(tiny, "default").count(fp8) == 0
    lora = LoraConfig(rank=4, target_modules=["q_proj", "v_proj"])
    assert _forward_dots(tiny, "fp8", lora).count(fp8) == 7 + 1 + 2
    moe = load_config(tree={"model": "tiny-qwen3-moe", "steps": 1}, schema=TrainConfig).model
    assert ("float32", "float32") in _forward_dots(moe, "fp8")  # the router


def test_default_stays_out_of_artifact_ids_and_a_recipe_enters_them():
    kind = get_stage_kind("pretrain")
    base = {"model": "tiny", "steps": 3, "data": {"seq_len": 32, "batch_size": 4}}
    prints = {
        recipe: kind.fingerprint(kind.resolve_config({**base, "compute": {"matmul_precision": recipe}}, "t.yaml"))
        for recipe in ("default", "fp8", "int8")
    }
    assert "matmul_precision" not in prints["default"]["compute"]
    assert prints["default"] == kind.fingerprint(kind.resolve_config(base, "t.yaml"))
    assert prints["fp8"]["compute"]["matmul_precision"] == "fp8" and prints["fp8"] != prints["int8"]


LOSS_TOLERANCE = {"fp8": 0.01, "int8": 0.01}
"""After 12 steps of the tiny pretraining on real text (bf16: 6.27 -> 4.64), the mean loss of the
last 4 steps within this many nats of bf16's (measured: fp8 +0.0006, int8 +0.0013)."""


def test_a_few_steps_of_pretraining_with_each_recipe_end_near_bfloat16s_loss(byte_dataset, tmp_path):
    curves = {}
    for recipe in ("default", "fp8", "int8"):
        cfg = tiny_config(
            byte_dataset,
            tmp_path / recipe,
            steps=12,
            **{"compute.dtype": "bfloat16", "compute.matmul_precision": recipe, "checkpoint.every_steps": 12},
        )
        run_pretrain(cfg, log=lambda _: None)
        curves[recipe] = losses(tmp_path / recipe)
    bf16 = np.mean(curves["default"][-4:])
    assert bf16 < curves["default"][0] - 0.5  # it learns
    for recipe, tolerance in LOSS_TOLERANCE.items():
        assert len(curves[recipe]) == 12 and curves[recipe] != curves["default"]
        assert abs(np.mean(curves[recipe][-4:]) - bf16) < tolerance, (recipe, curves[recipe][-4:], bf16)


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")


@needs_libtpu
def test_the_plan_compiles_each_recipe_for_a_tpu_slice_and_names_it():
    """The tiny model in bf16 on a v5p-8 with each recipe: the TPU compiler's step holds the
    quantized operands (f8e4m3fn / s8 arrays; none in bf16's), the plan's header names the
    recipe, and the memory it holds stays within 10% of bf16's."""
    plans = {}
    for recipe in ("default", "fp8", "int8"):
        tree = {
            "model": "tiny",
            "mesh": {"data": 1, "fsdp": -1},
            "data": {"seq_len": 128, "batch_size": 8},
            "steps": 3,
            "compute": {"dtype": "bfloat16", "matmul_precision": recipe},
        }
        plans[recipe] = plan_step(load_config(tree=tree, schema=TrainConfig), get_target("v5p-8"))
    for recipe, narrow in (("default", None), ("fp8", "f8e4m3fn["), ("int8", "s8[")):
        plan = plans[recipe]
        hlo = plan.compiled.as_text()
        assert plan.how == "compiled" and plan.fits and plan.matmuls == recipe
        assert (f", {recipe} matmuls;" in format_plan(plan)) == (recipe != "default")
        if narrow:
            assert narrow in hlo and plan.memory.total < 1.1 * plans["default"].memory.total
    assert "f8e4m3fn[" not in plans["default"].compiled.as_text()

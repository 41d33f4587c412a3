"""compute.weight_grad_dtype: the dtype in which the dense layers' weight gradients are produced,
and so reduced over the devices that split the batch. float32 (the default) is the program of
before the option existed; bfloat16 (MaxText's) puts the gradients' all-reduce/reduce-scatter
in bf16, half the bytes, on the real TPU compiler (through libtpu on this CPU host)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config import load_config
from engine.ops.dense import dense, gated_mlp, weight_grads_in
from engine.train.config import TrainConfig
from engine.train.plan import collective_bytes, plan_step
from engine.train.targets import get_target
from tasks.registry import get_stage_kind

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="needs libtpu (the test extra)")


def _operands(dtype):
    rng = np.random.default_rng(0)
    draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)  # noqa: E731
    return draw(3, 13, 11), draw(11, 7), draw(11, 17), draw(11, 17), draw(17, 11)


def _dot_dtypes(jaxpr) -> list[str]:
    """The output dtypes of every dot_general in a jaxpr, nested ones (custom VJPs) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(str(eqn.outvars[0].aval.dtype))
        for value in eqn.params.values():  # a custom VJP's or checkpoint's body
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _dot_dtypes(inner)
    return found


@pytest.mark.parametrize("backward", ["cpu", "autodiff"])
def test_float32_is_the_program_of_before_and_bfloat16_rounds_only_the_products(backward):
    """Outside any scope and inside weight_grads_in("float32") the gradient's jaxpr is the same
    text (so the same program, bitwise); inside "bfloat16" the backward's products come out in
    bf16, and the gradients stay within bf16 rounding of the float32 ones."""
    x, w, wg, wu, wd = _operands(jnp.bfloat16)

    def grad():  # a new function each time: JAX caches a function's trace, and the scope is read while tracing
        def loss(x, w, wg, wu, wd):
            y = dense(x, w, backward=backward).astype(jnp.float32).sum()
            return y + gated_mlp(x, wg, wu, wd, jax.nn.silu, backward=backward).astype(jnp.float32).sum()

        return jax.grad(loss, argnums=(1, 2, 3, 4))

    args = (x, w, wg, wu, wd)
    plain = jax.make_jaxpr(grad())(*args)
    with weight_grads_in("float32"):
        assert str(jax.make_jaxpr(grad())(*args)) == str(plain)
        wide = grad()(*args)
    with weight_grads_in("bfloat16"):
        narrow_jaxpr = jax.make_jaxpr(grad())(*args)
        narrow = grad()(*args)
    # Four weight gradients, each one product: f32 accumulators before, bf16 outputs within.
    assert _dot_dtypes(narrow_jaxpr.jaxpr).count("bfloat16") >= _dot_dtypes(plain.jaxpr).count("bfloat16") + 4
    for a, b in zip(wide, narrow):
        a, b = np.float32(a), np.float32(b)
        assert a.dtype == b.dtype and np.abs(a - b).max() <= 2**-6 * np.abs(a).max()


def test_float32_stays_out_of_artifact_ids_and_bfloat16_enters_them():
    """The field at float32 is left out of the fingerprint (the quickstart's ids stay those of
    before, tests/test_pipeline_spec.py); bfloat16 changes the id, through the config alone."""
    kind = get_stage_kind("pretrain")
    base = {"model": "tiny", "steps": 3, "data": {"seq_len": 32, "batch_size": 4}}
    prints = {
        dtype: kind.fingerprint(kind.resolve_config({**base, "compute": {"weight_grad_dtype": dtype}}, "t.yaml"))
        for dtype in ("float32", "bfloat16")
    }
    assert "weight_grad_dtype" not in prints["float32"]["compute"]
    assert prints["bfloat16"]["compute"]["weight_grad_dtype"] == "bfloat16"
    assert prints["float32"] == kind.fingerprint(kind.resolve_config(base, "t.yaml"))


@needs_libtpu
def test_bfloat16_halves_the_gradient_reductions_of_the_step_compiled_for_a_tpu_slice():
    """The tiny model in bf16 compute, fsdp over a v5p-8's 4 chips: with float32 weight
    gradients its reductions are all f32; with bfloat16 the dense weights' move to bf16 (the
    norms' scales stay f32), half their bytes, and the memory the step holds does not grow."""
    figures = {}
    for dtype in ("float32", "bfloat16"):
        tree = {
            "model": "tiny",
            "mesh": {"data": 1, "fsdp": -1},
            "data": {"seq_len": 128, "batch_size": 8},
            "steps": 3,
            "compute": {"dtype": "bfloat16", "weight_grad_dtype": dtype},
        }
        plan = plan_step(load_config(tree=tree, schema=TrainConfig), get_target("v5p-8"))
        figures[dtype] = (collective_bytes(plan.compiled.as_text()), plan.memory.total)
    (wide, wide_total), (narrow, narrow_total) = figures["float32"], figures["bfloat16"]
    moved = wide["f32"] - narrow.get("f32", 0.0)  # f32 bytes no longer reduced in f32
    assert wide.get("bf16", 0.0) < 0.1 * wide["f32"]
    assert moved > 0.8 * wide["f32"]
    assert narrow["bf16"] - wide.get("bf16", 0.0) == pytest.approx(moved / 2, rel=0.02)
    assert narrow_total <= wide_total * 1.02

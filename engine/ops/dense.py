"""The model's matmuls: y = x . w over x's trailing and w's leading axes. On CPU they have a
hand-written backward pass that is cheap on XLA:CPU; elsewhere autodiff's.

Autodiff computes a weight gradient as a contraction over the batch and sequence axes, the
major axes of both operands. XLA:CPU's matmul kernels want the left operand contracted on
its minor axis, so XLA transposes one operand first; left to itself it often transposes the
wide one (an MLP's 4096 x 1024 activation gradient rather than the 4096 x 384 input) and
fuses the elementwise producer into that transposing copy, which then runs at a fraction of
memory speed. Here the narrower of the two operands is always the one put on the left, so
only it is transposed. At the benchmark shape those copies had been 2.0 s of a 10.7 s
training step on CPU (bench/profile_step.py, docs/benchmarks.md). Accelerator compilers
pick layouts themselves, so there (`backward="auto"` off CPU, ComputeConfig.matmul_backward)
plain autodiff runs and leaves XLA its fusions.

Every product goes through one `dot_general` (jax.lax.dot_general by default, the backward's
too): the seam where a quantized or fp8 matmul slots in. Inside `matmuls_in("fp8" | "int8")`
(ComputeConfig.matmul_precision; the model enters it around its layers) the products of
`dense` and `gated_mlp` that would use the default one run as that recipe's quantized
product (engine/ops/low_precision.py, qwix) instead, differentiated by the recipe's own
backward (quantized too), not the CPU one below.

Low-precision products accumulate in float32 (preferred_element_type) and round once at the
end. On CPU this is also what lets the hardware's bf16 instructions run: XLA:CPU hands a
bf16 x bf16 -> f32 dot to its YNNPACK kernels (AVX512-BF16 / AMX where the CPU has them),
but a bf16 -> bf16 dot it converts to float32 first and multiplies in f32 (4-15x slower at
the benchmark shape, docs/benchmarks.md).

Weight gradients are produced, and so reduced across the devices that split the batch (the
fsdp/data all-reduce or reduce-scatter XLA's partitioner puts on their products), in float32
by default: the backward's products accumulate as the forward's do. Inside
`weight_grads_in("bfloat16")` (ComputeConfig.weight_grad_dtype; the model's forward enters
it) the dense layers' weight-gradient products come out in the bf16 compute dtype instead, as
MaxText's do, halving the bytes those collectives move; the MXU and XLA:CPU still accumulate
each product in float32 internally, so only its rounding point moves ahead of the reduction.
On CPU a bf16-output product runs XLA's slower f32 lowering (above): the option is for
accelerators. Float32 compute is unaffected either way.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Literal

import jax
import jax.numpy as jnp

from engine.ops import low_precision
from engine.ops.partitioning import constrain, current_platform, stage_aware

Backward = Literal["auto", "cpu", "autodiff"]
DotGeneral = Callable[..., jax.Array]  # jax.lax.dot_general's signature


_BF16_WEIGHT_GRADS: contextvars.ContextVar[bool] = contextvars.ContextVar("bf16_weight_grads", default=False)


@contextlib.contextmanager
def weight_grads_in(dtype: str) -> Iterator[None]:
    """Within: weight gradients of narrower-than-f32 products come out in their compute dtype
    ("bfloat16") or in float32 ("float32", the default). Read when a product is traced, so
    the backward pass (traced later by autodiff) follows the forward's setting."""
    token = _BF16_WEIGHT_GRADS.set(dtype == "bfloat16")
    try:
        yield
    finally:
        _BF16_WEIGHT_GRADS.reset(token)


_RECIPE: contextvars.ContextVar[DotGeneral | None] = contextvars.ContextVar("matmul_recipe", default=None)


@contextlib.contextmanager
def matmuls_in(precision: str) -> Iterator[None]:
    """Within: the default products of `dense` and `gated_mlp` run as `precision`'s recipe
    ("fp8", "int8": engine/ops/low_precision.py) or plainly ("default", also how a product
    inside such a scope opts out, as the MoE router does). Read when a product is traced."""
    token = _RECIPE.set(low_precision.dot_general(precision))
    try:
        yield
    finally:
        _RECIPE.reset(token)


def _recipe(dot_general: DotGeneral) -> DotGeneral | None:
    """The quantized product that replaces `dot_general` here, if one does."""
    recipe = _RECIPE.get()
    return recipe if recipe is not None and dot_general is jax.lax.dot_general else None


def uses_cpu_backward(backward: Backward) -> bool:
    """Whether the hand-written backward runs: `cpu`, or `auto` when compiling for CPU."""
    return backward == "cpu" or (backward == "auto" and current_platform() == "cpu")


def dense(
    x,
    w,
    n_in: int = 1,
    *,
    float32_out: bool = False,
    backward: Backward = "auto",
    dot_general: DotGeneral = jax.lax.dot_general,
):
    """Contract the last `n_in` axes of x with the first `n_in` axes of w. `float32_out`
    returns a narrower product's float32 accumulator unrounded (the LM head's logits, which
    the loss reads in float32 anyway); its gradient is rounded to x's dtype for the backward
    products."""
    if (quantized := _recipe(dot_general)) is not None:  # its product in the operands' dtype, its own backward
        out = _dot(x, w, n_in, quantized, accumulate=None)
        return out.astype(jnp.float32) if float32_out else out
    narrow_grads = _BF16_WEIGHT_GRADS.get()
    if uses_cpu_backward(backward):
        return _dense(x, w, n_in, dot_general, float32_out, narrow_grads)
    if narrow_grads and not float32_out:
        # Autodiff transposes a product with its forward's output dtype: a bf16-output
        # forward gives bf16 weight (and input) gradient products, as MaxText's layers do.
        return _dot(x, w, n_in, dot_general, accumulate=None)
    return _dot(x, w, n_in, dot_general, rounded=not float32_out)


def _product(dot_general, a, b, dimensions, rounded: bool = True, accumulate=jnp.float32):
    """dot_general(a, b), accumulated in float32 when the operands are narrower (and, if
    `rounded`, rounded back to their dtype). `accumulate=None`: the product in the operands'
    dtype (the backend accumulates internally as it will)."""
    dtype = jnp.result_type(a, b)
    if jnp.finfo(dtype).bits >= 32 or accumulate is None:
        return dot_general(a, b, dimensions)
    out = dot_general(a, b, dimensions, preferred_element_type=jnp.float32)
    return out.astype(dtype) if rounded else out


def _dot(x, w, n_in, dot_general, rounded: bool = True, accumulate=jnp.float32):
    x_axes = tuple(range(x.ndim - n_in, x.ndim))
    return _product(dot_general, x, w, ((x_axes, tuple(range(n_in))), ((), ())), rounded, accumulate)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _dense(x, w, n_in, dot_general, float32_out, narrow_grads):
    return _dot(x, w, n_in, dot_general, rounded=not float32_out)


def _dense_fwd(x, w, n_in, dot_general, float32_out, narrow_grads):
    return _dot(x, w, n_in, dot_general, rounded=not float32_out), (x, w)


def _input_grad(dy, w, n_in, dot_general, rounded: bool = True):
    """dy . w^T over the output axes: the gradient of x in x . w."""
    dy_out = tuple(range(dy.ndim - (w.ndim - n_in), dy.ndim))
    return _product(dot_general, dy, w, ((dy_out, tuple(range(n_in, w.ndim))), ((), ())), rounded)


def _weight_grad(x, dy, n_in, dot_general, narrow: bool = False):
    """x^T . dy over the batch axes (in..., out...), the narrower operand put first: XLA:CPU
    transposes the first operand, and the narrow one is the cheap one to transpose. `narrow`:
    the product comes out in the operands' dtype (weight_grads_in("bfloat16"))."""
    n_batch = x.ndim - n_in
    batch = tuple(range(n_batch))
    accumulate = None if narrow else jnp.float32
    if math.prod(x.shape[n_batch:]) <= math.prod(dy.shape[n_batch:]):
        return _product(dot_general, x, dy, ((batch, batch), ((), ())), accumulate=accumulate)
    n_out = dy.ndim - n_batch
    dw_t = _product(dot_general, dy, x, ((batch, batch), ((), ())), accumulate=accumulate)  # (out..., in...)
    return dw_t.transpose(*range(n_out, n_out + n_in), *range(n_out))


def _dense_bwd(n_in, dot_general, float32_out, narrow_grads, residuals, dy):
    x, w = residuals
    dy = dy.astype(jnp.result_type(x, w))  # a float32_out gradient, rounded for the bf16 kernels
    return (
        _input_grad(dy, w, n_in, dot_general).astype(x.dtype),
        _weight_grad(x, dy, n_in, dot_general, narrow_grads).astype(w.dtype),
    )


_dense.defvjp(_dense_fwd, _dense_bwd)


def gated_mlp(
    x,
    w_gate,
    w_up,
    w_down,
    activation,
    hidden_names=None,
    *,
    backward: Backward = "auto",
    dot_general: DotGeneral = jax.lax.dot_general,
):
    """down(activation(x . w_gate) * (x . w_up)): SwiGLU / GeGLU.

    The CPU backward pass keeps only x and the two projections (not the activation, its
    derivative or their product, which autodiff would also save) and recomputes the rest.
    `hidden_names`, logical axis names of the hidden activation, constrain its sharding.
    """
    if (quantized := _recipe(dot_general)) is not None:
        return _gated_fwd(x, w_gate, w_up, w_down, activation, hidden_names, quantized, accumulate=None)[0]
    narrow_grads = _BF16_WEIGHT_GRADS.get()
    if uses_cpu_backward(backward):
        return _gated_mlp(x, w_gate, w_up, w_down, activation, hidden_names, dot_general, narrow_grads)
    accumulate = None if narrow_grads else jnp.float32
    return _gated_fwd(x, w_gate, w_up, w_down, activation, hidden_names, dot_general, accumulate)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _gated_mlp(x, w_gate, w_up, w_down, activation, hidden_names, dot_general, narrow_grads):
    return _gated_fwd(x, w_gate, w_up, w_down, activation, hidden_names, dot_general)[0]


def _hidden(gate, up, activation, hidden_names):
    """activation(gate) * up, computed in float32 and rounded once to gate's dtype."""
    h = (activation(_f32(gate)) * _f32(up)).astype(gate.dtype)
    return h if hidden_names is None else constrain(h, hidden_names)


def _f32(x):
    """x in float32, for elementwise math on narrower inputs: left to itself XLA rounds a
    bf16 expression after every operation (silu's negate, exp, add and divide each), which
    is both less exact and slower on CPU than one conversion in and one rounding out."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _gated_fwd(x, w_gate, w_up, w_down, activation, hidden_names, dot_general, accumulate=jnp.float32):
    """(out, residuals); `accumulate=None` (autodiff's path with bf16 weight gradients): the
    products in the compute dtype, which autodiff's transposes then follow."""
    gate, up = (
        _dot(x, w_gate, 1, dot_general, accumulate=accumulate),
        _dot(x, w_up, 1, dot_general, accumulate=accumulate),
    )
    out = _dot(_hidden(gate, up, activation, hidden_names), w_down, 1, dot_general, accumulate=accumulate)
    return out, (x, gate, up, w_gate, w_up, w_down)


def _gated_mlp_fwd(x, w_gate, w_up, w_down, activation, hidden_names, dot_general, narrow_grads):
    return _gated_fwd(x, w_gate, w_up, w_down, activation, hidden_names, dot_general)


def _gated_bwd(activation, hidden_names, dot_general, narrow_grads, residuals, dy):
    x, gate, up, w_gate, w_up, w_down = residuals
    dtype = gate.dtype
    act, act_vjp = jax.vjp(activation, _f32(gate))
    h = (act * _f32(up)).astype(dtype)
    d_down = _weight_grad(h, dy, 1, dot_general, narrow_grads)
    dh = _input_grad(dy, w_down, 1, dot_general, rounded=False)  # float32: read once, unrounded
    if hidden_names is not None:
        dh = constrain(dh, hidden_names)
    d_up = (dh * act).astype(dtype)
    (d_gate,) = act_vjp(dh * _f32(up))
    d_gate = d_gate.astype(dtype)
    dx = _input_grad(d_gate, w_gate, 1, dot_general) + _input_grad(d_up, w_up, 1, dot_general)
    return (
        dx.astype(x.dtype),
        _weight_grad(x, d_gate, 1, dot_general, narrow_grads).astype(w_gate.dtype),
        _weight_grad(x, d_up, 1, dot_general, narrow_grads).astype(w_up.dtype),
        d_down.astype(w_down.dtype),
    )


_gated_mlp.defvjp(*stage_aware(_gated_mlp_fwd, _gated_bwd))

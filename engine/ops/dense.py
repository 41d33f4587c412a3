"""The model's matmuls: y = x . w over x's trailing and w's leading axes, with a hand-written
backward pass that is cheap on XLA:CPU.

Autodiff computes a weight gradient as a contraction over the batch and sequence axes, the
major axes of both operands. XLA:CPU's matmul kernels want the left operand contracted on
its minor axis, so XLA transposes one operand first; left to itself it often transposes the
wide one (an MLP's 4096 x 1024 activation gradient rather than the 4096 x 384 input) and
fuses the elementwise producer into that transposing copy, which then runs at a fraction of
memory speed. Here the narrower of the two operands is always the one put on the left, so
only it is transposed. At the benchmark shape those copies had been 2.0 s of a 10.7 s
training step on CPU (bench/profile_step.py, docs/benchmarks.md). Accelerator
compilers pick layouts themselves and are unaffected by the operand order.
"""

from __future__ import annotations

import functools
import math

import jax

from engine.ops.partitioning import constrain


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dense(x, w, n_in: int = 1):
    """Contract the last `n_in` axes of x with the first `n_in` axes of w."""
    return _dot(x, w, n_in)


def _dot(x, w, n_in):
    x_axes = tuple(range(x.ndim - n_in, x.ndim))
    return jax.lax.dot_general(x, w, ((x_axes, tuple(range(n_in))), ((), ())))


def _dense_fwd(x, w, n_in):
    return _dot(x, w, n_in), (x, w)


def _input_grad(dy, w, n_in):
    """dy . w^T over the output axes: the gradient of x in x . w."""
    dy_out = tuple(range(dy.ndim - (w.ndim - n_in), dy.ndim))
    return jax.lax.dot_general(dy, w, ((dy_out, tuple(range(n_in, w.ndim))), ((), ())))


def _weight_grad(x, dy, n_in: int = 1):
    """x^T . dy over the batch axes (in..., out...), the narrower operand put first: XLA:CPU
    transposes the first operand, and the narrow one is the cheap one to transpose."""
    n_batch = x.ndim - n_in
    batch = tuple(range(n_batch))
    if math.prod(x.shape[n_batch:]) <= math.prod(dy.shape[n_batch:]):
        return jax.lax.dot_general(x, dy, ((batch, batch), ((), ())))
    n_out = dy.ndim - n_batch
    dw_t = jax.lax.dot_general(dy, x, ((batch, batch), ((), ())))  # (out..., in...)
    return dw_t.transpose(*range(n_out, n_out + n_in), *range(n_out))


def _dense_bwd(n_in, residuals, dy):
    x, w = residuals
    return _input_grad(dy, w, n_in).astype(x.dtype), _weight_grad(x, dy, n_in).astype(w.dtype)


dense.defvjp(_dense_fwd, _dense_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def gated_mlp(x, w_gate, w_up, w_down, activation, hidden_names=None):
    """down(activation(x . w_gate) * (x . w_up)): SwiGLU / GeGLU.

    The backward pass keeps only x and the two projections (not the activation, its
    derivative or their product, which autodiff would also save) and recomputes the rest.
    `hidden_names`, logical axis names of the hidden activation, constrain its sharding.
    """
    return _gated_fwd(x, w_gate, w_up, w_down, activation, hidden_names)[0]


def _hidden(gate, up, activation, hidden_names):
    h = activation(gate) * up
    return h if hidden_names is None else constrain(h, hidden_names)


def _gated_fwd(x, w_gate, w_up, w_down, activation, hidden_names):
    gate, up = _dot(x, w_gate, 1), _dot(x, w_up, 1)
    out = _dot(_hidden(gate, up, activation, hidden_names), w_down, 1)
    return out, (x, gate, up, w_gate, w_up, w_down)


def _gated_bwd(activation, hidden_names, residuals, dy):
    x, gate, up, w_gate, w_up, w_down = residuals
    act, act_vjp = jax.vjp(activation, gate)
    h = act * up
    d_down = _weight_grad(h, dy)
    dh = _input_grad(dy, w_down, 1)
    if hidden_names is not None:
        dh = constrain(dh, hidden_names)
    d_up = dh * act
    (d_gate,) = act_vjp(dh * up)
    dx = _input_grad(d_gate, w_gate, 1) + _input_grad(d_up, w_up, 1)
    return (dx.astype(x.dtype), _weight_grad(x, d_gate).astype(w_gate.dtype),
            _weight_grad(x, d_up).astype(w_up.dtype), d_down.astype(w_down.dtype))


gated_mlp.defvjp(_gated_fwd, _gated_bwd)

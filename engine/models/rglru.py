"""The RG-LRU recurrent block mixer kind (`rglru`): Griffin's and RecurrentGemma's recurrent
layers (arXiv 2402.19427), as transformers 5.25 defines them (RecurrentGemmaRecurrentBlock,
RecurrentGemmaRglru).

Per layer: y = gelu(linear_y(x)); u = conv1d(linear_x(x)), a depthwise causal convolution
with a bias; the Real-Gated Linear Recurrent Unit over u:

    i_t = sigmoid(W_i u_t + b_i),  r_t = sigmoid(W_r u_t + b_r)   (block-diagonal, a block per head)
    log a_t = -8 r_t softplus(Lambda)
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t u_t)                  (at a document's start: h_t = i_t u_t)

and linear_out(h * y). The recurrence is linear in h, so training runs it as an associative
scan over (a_t, b_t) pairs (jax.lax.associative_scan: log-depth, no loop over positions);
decoding carries h (float32) and the convolution's last conv_kernel - 1 inputs, registered in
kv_cache.DECODE_STATES. A document starts where its position is 0 (transformers' reset) or its
segment id changes (packed rows; padding is a segment of its own), so left padding leaves the
state as a row without it. Shapes: b batch, t time, d model width, w the recurrence's width
(lru_width), n heads, k a head's block of w (w / n).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import Build, dtype_of, param
from engine.models.config import ComputeConfig
from engine.models.kv_cache import DECODE_STATES, KVCache
from engine.models.specs import RGLRUSpec
from engine.ops.dense import dense
from engine.ops.linear_mixing import causal_conv1d

MAX_SQRT_GRADIENT = 1000.0
"""sqrt(1 - a^2)'s gradient is clipped at this (transformers' SqrtBoundDerivative: a near 1)."""
GATE_SCALE = 8.0
"""log a = -8 r softplus(Lambda): Griffin's constant c."""


class RGLRUState(NamedTuple):
    """A sequence's decoding state: the convolution's window and the recurrence's h."""

    conv_bkw: jax.Array  # (b, conv_kernel - 1, w) the last inputs of the convolution, compute dtype
    h_bw: jax.Array  # (b, w) float32


def initial_state(spec: RGLRUSpec, compute: ComputeConfig, batch: int) -> RGLRUState:
    """Zeros: a sequence's state before its first token."""
    return RGLRUState(
        jnp.zeros((batch, spec.conv_kernel - 1, spec.width), dtype_of(compute.dtype)),
        jnp.zeros((batch, spec.width), jnp.float32),
    )


DECODE_STATES["rglru"] = initial_state


@jax.custom_vjp
def sqrt_bounded(x):
    """sqrt(x) whose gradient is at most MAX_SQRT_GRADIENT (transformers' SqrtBoundDerivative)."""
    return jnp.sqrt(x)


def _sqrt_forward(x):
    return jnp.sqrt(x), x


def _sqrt_backward(x, g):
    return (g / jnp.sqrt(jnp.maximum(4.0 * x, 1.0 / MAX_SQRT_GRADIENT**2)),)


sqrt_bounded.defvjp(_sqrt_forward, _sqrt_backward)


def linear_scan(a_btw, b_btw, h0_bw=None):
    """h_t = a_t h_{t-1} + b_t over t (h_{-1} = h0, zeros when None), as an associative scan:
    (all h (b, t, w), the last (b, w)). float32 in, float32 out."""
    if h0_bw is not None:
        b_btw = b_btw.at[:, 0].add(a_btw[:, 0] * h0_bw)

    def combine(left, right):
        a_l, b_l = left
        a_r, b_r = right
        return a_l * a_r, a_r * b_l + b_r

    _, h_btw = jax.lax.associative_scan(combine, (a_btw, b_btw), axis=1)
    return h_btw, h_btw[:, -1]


def document_starts(positions_bt, segment_ids_bt, carried: bool):
    """(b, t) bool: where the recurrence restarts: position 0, or a change of segment id (the
    row's first token, unless a carried state continues it)."""
    starts = positions_bt == 0 if positions_bt is not None else jnp.zeros(segment_ids_bt.shape, bool)
    if segment_ids_bt is not None:
        previous = jnp.concatenate([segment_ids_bt[:, :1], segment_ids_bt[:, :-1]], axis=1)
        changed = segment_ids_bt != previous
        if not carried:
            changed = changed.at[:, 0].set(True)
        starts = starts | changed
    return starts


class RecurrentBlock(nnx.Module):
    """The mixer of an `rglru` layer; called as transformer.Attention is (positions mark
    document starts; RoPE ignored), and with a cache reads and writes its layer's state.
    No LoRA on its projections (PEFT's Llama names do not name them)."""

    def __init__(self, spec: RGLRUSpec, build: Build, *, rngs: nnx.Rngs):
        d, w, n, pdt = build.d_model, spec.width, spec.num_heads, build.param_dtype
        k = w // n
        self.w_y_dw = param(rngs, (d, w), build.init_std, ("embed", "mlp"), pdt)
        self.b_y_w = nnx.Param(jnp.zeros((w,), pdt), out_sharding=("mlp",))
        self.w_x_dw = param(rngs, (d, w), build.init_std, ("embed", "mlp"), pdt)
        self.b_x_w = nnx.Param(jnp.zeros((w,), pdt), out_sharding=("mlp",))
        conv_std = math.sqrt(0.01 / spec.conv_kernel)  # transformers' w_init_variance_scale / width
        self.conv_w1k = param(rngs, (w, 1, spec.conv_kernel), conv_std, ("mlp", None, None), pdt)
        self.conv_bias_w = nnx.Param(jnp.zeros((w,), pdt), out_sharding=("mlp",))
        gate_std = math.sqrt(0.01 / k)
        self.w_input_gate_nkk = param(rngs, (n, k, k), gate_std, ("heads", None, None), pdt)
        self.b_input_gate_nk = nnx.Param(jnp.zeros((n, k), pdt), out_sharding=("heads", None))
        self.w_recurrent_gate_nkk = param(rngs, (n, k, k), gate_std, ("heads", None, None), pdt)
        self.b_recurrent_gate_nk = nnx.Param(jnp.zeros((n, k), pdt), out_sharding=("heads", None))
        # Lambda such that a = sigmoid(Lambda)... as transformers draws it: a^2 uniform in [0.81, 0.998]
        a_sq = jax.random.uniform(rngs.params(), (w,), jnp.float32, 0.9**2 + 1e-8, 0.999**2 + 1e-8)
        lam = jnp.log(jnp.exp(-0.5 * jnp.log(a_sq)) - 1.0)
        self.recurrent_param_w = nnx.Param(lam.astype(pdt), out_sharding=("mlp",))
        self.w_out_wd = param(rngs, (w, d), build.out_std, ("mlp", "embed"), pdt)
        self.b_out_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("embed",))
        self.heads, self.dtype = n, build.dtype
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general

    def _dense(self, x, attr: str, bias: str):
        w = getattr(self, attr)[...].astype(self.dtype)
        out = dense(x, w, 1, backward=self.matmul_backward, dot_general=self.dot_general)
        return out + getattr(self, bias)[...].astype(self.dtype)

    def _gate(self, u_btnk, attr: str, bias: str):
        """sigmoid of a head's block times its block-diagonal weight, plus bias: (b, t, n, k)."""
        w, b = getattr(self, attr)[...].astype(self.dtype), getattr(self, bias)[...].astype(self.dtype)
        return jax.nn.sigmoid(jnp.einsum("btnk,nkj->btnj", u_btnk, w) + b)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: RGLRUSpec, cache: KVCache | None = None):
        """(b, t, d); with a cache (decoding) (out, the cache with this layer's state advanced)."""
        dt = self.dtype
        state = None if cache is None else cache.states[cache.layer]
        batch, time, _ = x_btd.shape
        y_btw = jax.nn.gelu(self._dense(x_btd, "w_y_dw", "b_y_w"), approximate=True)
        u_btw, window = causal_conv1d(
            self._dense(x_btd, "w_x_dw", "b_x_w"),
            self.conv_w1k[...][:, 0, :].T.astype(dt),
            self.conv_bias_w[...].astype(dt),
            window_bkc=None if state is None else state.conv_bkw,
            activation=False,
            segment_ids_bt=segment_ids_bt,
        )
        u_btnk = u_btw.reshape(batch, time, self.heads, -1)
        input_gate = self._gate(u_btnk, "w_input_gate_nkk", "b_input_gate_nk").reshape(u_btw.shape)
        recurrent_gate = self._gate(u_btnk, "w_recurrent_gate_nkk", "b_recurrent_gate_nk").reshape(u_btw.shape)
        softplus = jax.nn.softplus(self.recurrent_param_w[...].astype(dt))
        log_a_btw = -GATE_SCALE * recurrent_gate * softplus
        starts_bt1 = document_starts(positions_bt, segment_ids_bt, carried=state is not None)[..., None]
        multiplier = jnp.where(starts_bt1, 1.0, sqrt_bounded(1.0 - jnp.exp(2.0 * log_a_btw)))
        b_btw = (u_btw * input_gate * multiplier.astype(dt)).astype(jnp.float32)
        a_btw = jnp.where(starts_bt1, 0.0, jnp.exp(log_a_btw)).astype(jnp.float32)
        h_btw, h_bw = linear_scan(a_btw, b_btw, None if state is None else state.h_bw)
        out_btd = self._dense(h_btw.astype(dt) * y_btw, "w_out_wd", "b_out_d")
        if cache is None:
            return out_btd
        states = list(cache.states)
        assert state is not None  # a cache holds this layer's state
        states[cache.layer] = RGLRUState(window.astype(state.conv_bkw.dtype), h_bw)
        return out_btd, dataclasses.replace(cache, states=tuple(states))

"""The Mamba (Mamba1) selective-scan mixer (Gu & Dao 2023) as an NNX module: in_proj to x and
the gate z, the depthwise causal convolution, x_proj to dt's low-rank input, B and C (with
Falcon-Mamba's and Jamba's RMSNorms on them), dt_proj, and per inner channel c a state h_c of
state_size, each entry with its own decay:

    h_t = exp(dt_t A) * h_{t-1} + dt_t x_t B_t;   y_t = h_t . C_t + D x_t;   out = out_proj(y * silu(z))

A = -exp(A_log) (inner, state_size), dt = softplus(dt_proj(.) + bias) per channel. The decays
are per (channel, state) pair, so SSD's matmul form (one decay per head, engine/ops/ssd.py)
does not apply: training runs the diagonal linear recurrence as an associative scan within
chunks of `chunk_size` tokens (jax.lax.associative_scan, log-depth) and carries the state from
chunk to chunk in a lax.scan over chunks, whose body is rematerialised, so memory holds one
chunk's (b, L, inner, state) terms and not the sequence's. Decoding takes the recurrent step,
carrying a `Mamba1State` (the convolution's last K-1 inputs and the state).

Follows transformers 5.25's MambaMixer / FalconMambaMixer / JambaMambaMixer (slow path)
operation for operation, padding included (inputs zeroed before in_proj and after the
convolution), with one difference: padding (segment 0) is outside every document, so a
left-padded prompt computes as the unpadded one. transformers convolves the zeroed padding's
in_proj output, which with use_bias is the bias, into the first tokens' window: its left-padded
rows then differ from its unpadded ones (and from these).

Shapes: b batch, t time, d model width, c inner channels, n state size, r dt rank, k kernel
taps, l tokens of a chunk.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import dtype_of, param
from engine.models.config import ComputeConfig
from engine.models.kv_cache import DECODE_STATES, KVCache
from engine.models.lora import MAMBA_WEIGHTS, add_adapters, project
from engine.models.specs import Mamba1Spec
from engine.ops.linear_mixing import causal_conv1d

nnx.use_eager_sharding(False)  # placed by engine/models/params.py, as transformer.py's layers

# transformers' initialisation of dt_proj's bias (MambaMixer.init_mamba_weights): dt drawn
# log-uniformly in [DT_MIN, DT_MAX] (floored), stored through softplus's inverse.
DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


class Mamba1State(NamedTuple):
    """What decoding carries per sequence instead of a KV cache."""

    conv_bkc: jax.Array  # (b, conv_kernel - 1, inner): the convolution's last inputs
    ssm_bcn: jax.Array  # (b, inner, state_size), float32


def decode_state(spec: Mamba1Spec, compute: ComputeConfig, batch: int) -> Mamba1State:
    """A sequence's decoding state before its first token (zeros): the convolution window in
    the compute dtype, the SSM state in float32."""
    return Mamba1State(
        jnp.zeros((batch, spec.conv_kernel - 1, spec.inner), dtype_of(compute.dtype)),
        jnp.zeros((batch, spec.inner, spec.state_size), jnp.float32),
    )


DECODE_STATES["mamba1"] = decode_state


def _combine(left, right):
    """The associative operator of h_t = a_t h_{t-1} + b_t: (a1, b1) then (a2, b2)."""
    a_left, b_left = left
    a_right, b_right = right
    return a_left * a_right, a_right * b_left + b_right


def selective_scan(
    x_btc: jax.Array,
    dt_btc: jax.Array,
    a_cn: jax.Array,
    b_btn: jax.Array,
    c_btn: jax.Array,
    *,
    state_bcn: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t, y_t = h_t . C_t, all float32 (dt already
    softplus'd): (y (b, t, c), the state after the last token). `segment_ids_bt` (packed rows):
    the state restarts from zero where the id changes. The chunked associative-scan form; a
    token with a state takes the same arithmetic (selective_step)."""
    batch, time, channels = x_btc.shape
    size = a_cn.shape[1]
    state = jnp.zeros((batch, channels, size), jnp.float32) if state_bcn is None else state_bcn.astype(jnp.float32)
    keep_bt = jnp.ones((batch, time), bool)
    if segment_ids_bt is not None:
        keep_bt = jnp.concatenate(
            [jnp.ones_like(segment_ids_bt[:, :1], bool), segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]], 1
        )
    length = min(chunk_size, time)
    pad = -time % length
    chunks = (time + pad) // length

    def to_chunks(v, fill=0):  # (b, t, ...) -> (chunks, b, l, ...); padding: dt 0 (decay 1), input 0
        v = jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2), constant_values=fill)
        return jnp.moveaxis(v.reshape(batch, chunks, length, *v.shape[2:]), 1, 0)

    def chunk(h_bcn, inputs):
        x, dt, b, c, keep = inputs  # (b, l, c) twice, (b, l, n) twice, (b, l)
        decay_blcn = jnp.exp(dt[..., None] * a_cn) * keep[..., None, None]  # 0 at a document's start
        input_blcn = (dt * x)[..., None] * b[:, :, None, :]
        decay_blcn, h_blcn = jax.lax.associative_scan(_combine, (decay_blcn, input_blcn), axis=1)
        h_blcn = h_blcn + decay_blcn * h_bcn[:, None]
        return h_blcn[:, -1], jnp.einsum("blcn,bln->blc", h_blcn, c)

    inputs = (
        to_chunks(x_btc.astype(jnp.float32)),
        to_chunks(dt_btc.astype(jnp.float32)),
        to_chunks(b_btn.astype(jnp.float32)),
        to_chunks(c_btn.astype(jnp.float32)),
        to_chunks(keep_bt, True),
    )
    state, y_nblc = jax.lax.scan(jax.checkpoint(chunk, prevent_cse=False), state, inputs)
    y_btc = jnp.moveaxis(y_nblc, 0, 1).reshape(batch, chunks * length, channels)[:, :time]
    return y_btc, state


def selective_step(x_bc, dt_bc, a_cn, b_bn, c_bn, state_bcn) -> tuple[jax.Array, jax.Array]:
    """One decoded token of the recurrence, float32: (y (b, c), next state)."""
    state_bcn = jnp.exp(dt_bc[..., None] * a_cn) * state_bcn + (dt_bc * x_bc)[..., None] * b_bn[:, None, :]
    return jnp.einsum("bcn,bn->bc", state_bcn, c_bn), state_bcn


def _rms(x, eps: float, weight=None):
    """transformers' RMSNorm in float32 (Falcon-Mamba's weightless one: weight None)."""
    x32 = x.astype(jnp.float32)
    out = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return out if weight is None else weight.astype(x.dtype) * out


class Mamba1(nnx.Module):
    """One Mamba1 mixer: x (b, t, d) -> (b, t, d), and the state after x. Its arrays are
    transformers' `mixer.*` tensors, one each (in_proj's columns x then z)."""

    def __init__(self, spec: Mamba1Spec, build, *, rngs: nnx.Rngs):
        """`build`: a common.Build (model width, compute settings, initialisation)."""
        pdt, d = build.param_dtype, build.d_model
        c, n, r, k = spec.inner, spec.state_size, spec.dt_rank, spec.conv_kernel
        # The inner axis is stored split over `mlp` (tensor parallelism splits channels, each
        # independent but for x_proj's sum over them); in_proj's output is x and z side by side,
        # so no even split of it holds matching channels of both: split over `embed` only.
        self.w_in_dp = param(rngs, (d, 2 * c), build.init_std, ("embed", None), pdt)
        if spec.proj_bias:
            self.b_in_p = nnx.Param(jnp.zeros((2 * c,), pdt), out_sharding=(None,))
        bound = 1 / math.sqrt(k)  # torch's Conv1d default: fan-in = the taps
        conv = jax.random.uniform(rngs.params(), (c, 1, k), jnp.float32, -bound, bound)
        self.conv_c1k = nnx.Param(conv.astype(pdt), out_sharding=("mlp", None, None))  # torch's Conv1d layout
        if spec.conv_bias:
            self.conv_bias_c = nnx.Param(jnp.zeros((c,), pdt), out_sharding=("mlp",))
        self.w_x_cq = param(rngs, (c, r + 2 * n), build.init_std, ("mlp", None), pdt)
        dt_std = r**-0.5  # transformers' time_step_scale 1, "random" scheme
        w_dt = jax.random.uniform(rngs.params(), (r, c), jnp.float32, -dt_std, dt_std)
        self.w_dt_rc = nnx.Param(w_dt.astype(pdt), out_sharding=(None, "mlp"))
        log_dt = jax.random.uniform(rngs.params(), (c,), jnp.float32, math.log(DT_MIN), math.log(DT_MAX))
        dt = jnp.maximum(jnp.exp(log_dt), DT_FLOOR)
        self.b_dt_c = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(pdt), out_sharding=("mlp",))
        a_log = jnp.broadcast_to(jnp.log(jnp.arange(1, n + 1, dtype=jnp.float32)), (c, n))
        self.a_log_cn = nnx.Param(a_log.astype(pdt), out_sharding=("mlp", None))
        self.d_c = nnx.Param(jnp.ones((c,), pdt), out_sharding=("mlp",))
        if spec.bcdt_norm == "weighted":  # Jamba's dt_layernorm, b_layernorm, c_layernorm
            self.dt_norm_r = nnx.Param(jnp.ones((r,), pdt), out_sharding=(None,))
            self.b_norm_n = nnx.Param(jnp.ones((n,), pdt), out_sharding=(None,))
            self.c_norm_n = nnx.Param(jnp.ones((n,), pdt), out_sharding=(None,))
        self.w_out_cd = param(rngs, (c, d), build.out_std, ("mlp", "embed"), pdt)
        if spec.proj_bias:
            self.b_out_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("embed",))
        self.dtype = build.dtype
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general
        add_adapters(self, MAMBA_WEIGHTS, build, rngs)  # in_proj, x_proj, dt_proj, out_proj

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: Mamba1Spec, cache: KVCache | None = None):
        """Called as transformer.Attention is (positions ignored): (b, t, d), or with a cache
        (decoding) (out, the cache with this layer's state advanced)."""
        state = None if cache is None else cache.states[cache.layer]
        out_btd, state = self.mix(x_btd, segment_ids_bt, spec, state)
        if cache is None:
            return out_btd
        states = list(cache.states)
        states[cache.layer] = state
        return out_btd, dataclasses.replace(cache, states=tuple(states))

    def _dense(self, x, attr: str, bias=None):
        """x . the weight `attr` (+ its LoRA update, if adapted) (+ bias)."""
        out = project(self, attr, x, 1, self.dtype, backward=self.matmul_backward, dot_general=self.dot_general)
        return out if bias is None else out + bias.astype(self.dtype)

    def mix(
        self, x_btd: jax.Array, segment_ids_bt: jax.Array | None, spec: Mamba1Spec, state: Mamba1State | None = None
    ) -> tuple[jax.Array, Mamba1State]:
        """(out (b, t, d) in the compute dtype, state after x). segment_ids_bt: 0 marks padding,
        whose inputs are zeroed before in_proj and after the convolution (transformers'
        attention-mask handling), and a packed row's documents each start from a zero state and
        convolution window; None: one unpadded sequence per row. `state`: carried from earlier
        tokens (decoding; a token at a time takes the recurrent step), None: a sequence's start."""
        dt, n, r = self.dtype, spec.state_size, spec.dt_rank
        mask_bt = None if segment_ids_bt is None else (segment_ids_bt != 0)[..., None]
        x_btd = x_btd.astype(dt)
        if mask_bt is not None:
            x_btd = x_btd * mask_bt.astype(dt)
        projected = self._dense(x_btd, "w_in_dp", self.b_in_p[...] if spec.proj_bias else None)
        x_btc, gate_btc = projected[..., : spec.inner], projected[..., spec.inner :]
        step = state is not None and x_btd.shape[1] == 1
        x_btc, window = causal_conv1d(
            x_btc,
            self.conv_c1k[...][:, 0, :].T.astype(dt),
            self.conv_bias_c[...].astype(dt) if spec.conv_bias else None,
            window_bkc=None if state is None else state.conv_bkc,
            segment_ids_bt=None if step else segment_ids_bt,
        )
        if mask_bt is not None:
            x_btc = x_btc * mask_bt.astype(dt)
        bcdt = self._dense(x_btc, "w_x_cq")
        dt_in, b_btn, c_btn = bcdt[..., :r], bcdt[..., r : r + n], bcdt[..., r + n :]
        if spec.bcdt_norm != "none":
            weighted = spec.bcdt_norm == "weighted"
            eps = spec.bcdt_norm_eps
            dt_in = _rms(dt_in, eps, self.dt_norm_r[...] if weighted else None)
            b_btn = _rms(b_btn, eps, self.b_norm_n[...] if weighted else None)
            c_btn = _rms(c_btn, eps, self.c_norm_n[...] if weighted else None)
        dt_btc = self._dense(dt_in, "w_dt_rc")
        dt_btc = jax.nn.softplus(dt_btc.astype(jnp.float32) + self.b_dt_c[...].astype(jnp.float32))
        a_cn = -jnp.exp(self.a_log_cn[...].astype(jnp.float32))
        if step:
            y_bc, ssm = selective_step(
                x_btc[:, 0].astype(jnp.float32),
                dt_btc[:, 0],
                a_cn,
                b_btn[:, 0].astype(jnp.float32),
                c_btn[:, 0].astype(jnp.float32),
                state.ssm_bcn,  # type: ignore[union-attr]  # decoding: the cache holds this layer's state
            )
            y_btc = y_bc[:, None]
        else:
            y_btc, ssm = selective_scan(
                x_btc,
                dt_btc,
                a_cn,
                b_btn,
                c_btn,
                state_bcn=None if state is None else state.ssm_bcn,
                segment_ids_bt=segment_ids_bt,
                chunk_size=spec.chunk_size,
            )
        y_btc = y_btc + x_btc.astype(jnp.float32) * self.d_c[...].astype(jnp.float32)
        y_btc = (y_btc * jax.nn.silu(gate_btc.astype(jnp.float32))).astype(dt)
        out_btd = self._dense(y_btc, "w_out_cd", self.b_out_d[...] if spec.proj_bias else None)
        return out_btd, Mamba1State(window, ssm)

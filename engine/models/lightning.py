"""The lightning attention mixer kind (`lightning`): MiniMax-Text-01's linear attention with a
fixed decay per head (arXiv 2501.08313), as transformers 5.25 defines it
(MiniMaxLightningAttention).

Per layer: q, k, v = silu(qkv_proj(x)), each head's three side by side; per head h, with the
decay rate lambda_h = 2^(-8 (h + 1) / heads) * slope_factor (slope_factor falls linearly from 1
at the first layer to ~0 at the last: LightningSpec.slope_factor),

    S_t = exp(-lambda_h) S_{t-1} + k_t^T v_t,    o_t = q_t S_t

then RMSNorm over all heads' outputs, times sigmoid(output_gate(x)), and out_proj.

Training runs the chunked form: within a chunk of C positions the outputs are
(q k^T . D) v with D[i, j] = exp(-lambda (i - j)) for j <= i, plus the carried state read as
exp(-lambda (i + 1)) q_i S; the state then advances by a whole chunk at once. Work is linear in
the sequence, O(C) per position. Decoding carries S (b, heads, head_dim, head_dim), float32,
registered in kv_cache.DECODE_STATES. Padding tokens (segment id 0) contribute nothing (their
q, k, v zeroed, as transformers does); in packed rows the state restarts at each document.
Shapes: b batch, t time, d model width, n heads, h head_dim, c a chunk's positions.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import Build, param
from engine.models.config import ComputeConfig
from engine.models.kv_cache import DECODE_STATES, KVCache
from engine.models.specs import LightningSpec
from engine.ops.dense import dense


def initial_state(spec: LightningSpec, compute: ComputeConfig, batch: int) -> jax.Array:
    """Zeros (b, n, h, h): a sequence's key-value state before its first token."""
    return jnp.zeros((batch, spec.num_heads, spec.head_dim, spec.head_dim), jnp.float32)


DECODE_STATES["lightning"] = initial_state


def decay_rates(spec: LightningSpec) -> jax.Array:
    """(n,) float32: each head's lambda (transformers' slope_rate)."""
    base = 1.0 / (2.0 ** (8.0 / spec.num_heads))
    return (base ** jnp.arange(1, spec.num_heads + 1, dtype=jnp.float32)) * spec.slope_factor


def _chunk(state_bnhh, last_segment_b, q, k, v, segments_bc, rates_n):
    """One chunk of c positions (q, k, v (b, c, n, h) float32) from `state` (that of the
    documents whose last token's segment is last_segment): (out (b, c, n, h), state after,
    its last segment)."""
    c = q.shape[1]
    steps = jnp.arange(c, dtype=jnp.float32)
    same_bcc = segments_bc[:, :, None] == segments_bc[:, None, :]
    distance_cc = steps[:, None] - steps[None, :]
    decay_ncc = jnp.where(distance_cc >= 0, jnp.exp(-rates_n[:, None, None] * jnp.maximum(distance_cc, 0.0)), 0.0)
    scores_bncc = jnp.einsum("bind,bjnd->bnij", q, k) * decay_ncc[None] * same_bcc[:, None]
    out = jnp.einsum("bnij,bjnd->bind", scores_bncc, v)
    carried_bc = segments_bc == last_segment_b[:, None]
    query_decay_cn = jnp.exp(-rates_n[None, :] * (steps[:, None] + 1.0))
    q_read = q * (query_decay_cn[None] * carried_bc[:, :, None])[..., None]
    out = out + jnp.einsum("bind,bnde->bine", q_read, state_bnhh)
    last_bc = segments_bc[:, -1]
    in_last_bc = segments_bc == last_bc[:, None]
    key_decay_cn = jnp.exp(-rates_n[None, :] * (c - 1.0 - steps[:, None]))
    k_write = k * (key_decay_cn[None] * in_last_bc[:, :, None])[..., None]
    keep_b = (last_bc == last_segment_b).astype(jnp.float32)
    chunk_decay_n = jnp.exp(-rates_n * c)
    state = state_bnhh * (keep_b[:, None, None, None] * chunk_decay_n[None, :, None, None])
    state = state + jnp.einsum("bjnd,bjne->bnde", k_write, v)
    return out, state, last_bc


def lightning_chunked(q, k, v, rates_n, *, chunk_size: int, state_bnhh=None, segment_ids_bt=None):
    """The chunked form over t positions (q, k, v (b, t, n, h)): (out (b, t, n, h) float32,
    the state after). The first chunk takes t mod chunk_size positions (or a whole chunk), the
    rest whole chunks in one lax.scan, so no position is padded and the state decays exactly."""
    batch, time, heads, dim = q.shape
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    state = jnp.zeros((batch, heads, dim, dim), jnp.float32) if state_bnhh is None else state_bnhh
    segments = jnp.ones((batch, time), jnp.int32) if segment_ids_bt is None else segment_ids_bt.astype(jnp.int32)
    # a carried state continues the row's first document; a fresh one is empty whatever its segment
    last = segments[:, 0]
    first = time % chunk_size or min(chunk_size, time)
    outs = []
    if first:
        out, state, last = _chunk(state, last, q[:, :first], k[:, :first], v[:, :first], segments[:, :first], rates_n)
        outs.append(out)
    rest = time - first
    if rest:
        n = rest // chunk_size

        def blocks(x):
            return x[:, first:].reshape(batch, n, chunk_size, *x.shape[2:]).swapaxes(0, 1)

        def step(carry, xs):
            state, last = carry
            out, state, last = _chunk(state, last, *xs, rates_n)
            return (state, last), out

        (state, last), out = jax.lax.scan(step, (state, last), (blocks(q), blocks(k), blocks(v), blocks(segments)))
        outs.append(out.swapaxes(0, 1).reshape(batch, rest, heads, dim))
    return jnp.concatenate(outs, axis=1), state


def lightning_step(q, k, v, rates_n, state_bnhh):
    """One token (q, k, v (b, n, h)): (out (b, n, h) float32, the state after)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    state = state_bnhh * jnp.exp(-rates_n)[None, :, None, None] + jnp.einsum("bnd,bne->bnde", k, v)
    return jnp.einsum("bnd,bnde->bne", q, state), state


def lightning_scan(q, k, v, rates_n, state_bnhh=None):
    """lightning_step over every position with lax.scan: the tests' reference."""
    batch, _, heads, dim = q.shape
    state = jnp.zeros((batch, heads, dim, dim), jnp.float32) if state_bnhh is None else state_bnhh

    def step(state, xs):
        out, state = lightning_step(*xs, rates_n, state)
        return state, out

    state, out = jax.lax.scan(step, state, tuple(x.swapaxes(0, 1) for x in (q, k, v)))
    return out.swapaxes(0, 1), state


class LightningAttention(nnx.Module):
    """The mixer of a `lightning` layer; called as transformer.Attention is (positions and
    RoPE ignored), and with a cache reads and writes its layer's state. No LoRA on its
    projections (PEFT's Llama names do not name them)."""

    def __init__(self, spec: LightningSpec, build: Build, *, rngs: nnx.Rngs):
        d, n, h, pdt = build.d_model, spec.num_heads, spec.head_dim, build.param_dtype
        self.w_qkv_dnx = param(rngs, (d, n, 3 * h), build.init_std, ("embed", "heads", None), pdt)
        self.w_gate_dnh = param(rngs, (d, n, h), build.init_std, ("embed", "heads", "head_dim"), pdt)
        self.norm_f = nnx.Param(jnp.ones((n * h,), pdt), out_sharding=("mlp",))
        self.w_out_nhd = param(rngs, (n, h, d), build.out_std, ("heads", "head_dim", "embed"), pdt)
        self.dtype = build.dtype
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general

    def _dense(self, x, attr: str, n_in: int = 1):
        w = getattr(self, attr)[...].astype(self.dtype)
        return dense(x, w, n_in, backward=self.matmul_backward, dot_general=self.dot_general)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: LightningSpec, cache: KVCache | None = None):
        """(b, t, d); with a cache (decoding) (out, the cache with this layer's state advanced)."""
        dt, h = self.dtype, spec.head_dim
        qkv_btnx = jax.nn.silu(self._dense(x_btd, "w_qkv_dnx"))
        if segment_ids_bt is not None:  # padding contributes nothing (transformers zeroes its q, k, v)
            qkv_btnx = qkv_btnx * (segment_ids_bt != 0)[..., None, None].astype(dt)
        q, k, v = qkv_btnx[..., :h], qkv_btnx[..., h : 2 * h], qkv_btnx[..., 2 * h :]
        rates_n = decay_rates(spec)
        state = None if cache is None else cache.states[cache.layer]
        if state is not None and x_btd.shape[1] == 1:  # one decoded token: the recurrence itself
            out, state = lightning_step(q[:, 0], k[:, 0], v[:, 0], rates_n, state)
            out_btnh = out[:, None]
        else:
            out_btnh, state = lightning_chunked(
                q, k, v, rates_n, chunk_size=spec.chunk_size, state_bnhh=state, segment_ids_bt=segment_ids_bt
            )
        batch, time = x_btd.shape[:2]
        flat = out_btnh.astype(dt).reshape(batch, time, -1).astype(jnp.float32)
        normed = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + spec.norm_eps)
        normed = self.norm_f[...].astype(dt) * normed.astype(dt)
        gate = jax.nn.sigmoid(self._dense(x_btd, "w_gate_dnh").reshape(batch, time, -1))
        out_btd = self._dense((gate * normed).reshape(out_btnh.shape), "w_out_nhd", 2)
        if cache is None:
            return out_btd
        states = list(cache.states)
        states[cache.layer] = state
        return out_btd, dataclasses.replace(cache, states=tuple(states))

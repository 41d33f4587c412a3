"""The Kimi Delta Attention mixer kind (`kimi_delta`): Kimi Linear's linear-attention layers, as
transformers 5.25 defines them (KimiLinearDeltaAttention, KimiLinearForgetGate).

Per layer: x -> q, k, v (each h heads of key_head_dim) through one short causal convolution and
SiLU; the forget gate g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias), one log decay per head and
key channel; beta = sigmoid(b_proj(x)) -> the delta rule with channel-wise decay
(engine/ops/kimi_delta.py: chunked in training, one recurrent step a decoded token) ->
RMSNorm(out) * sigmoid(g_b(g_a(x))) per head -> o_proj. Sizes are ModelConfig.gated_delta's
(num_key_heads = num_value_heads, key_head_dim = value_head_dim).

Decoding carries the convolution window and the recurrent state per sequence
(kv_cache.DECODE_STATES) instead of keys and values. Padding tokens (segment id 0) are zeroed on
input, as transformers does; packed rows restart the convolution and the state at each document.
Shapes: b batch, t time, d d_model, h heads, k key head dim, c channels (q, k, v side by side).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import Build, dtype_of, param
from engine.models.config import ComputeConfig
from engine.models.kv_cache import DECODE_STATES, KVCache
from engine.models.specs import KimiDeltaSpec
from engine.ops.dense import dense
from engine.ops.gated_delta import GatedDeltaState
from engine.ops.kimi_delta import kimi_delta_chunked, kimi_delta_step
from engine.ops.linear_mixing import causal_conv1d

CHUNK = 64
"""Tokens per chunk of the chunked form (transformers' and FLA's)."""


def initial_state(spec: KimiDeltaSpec, compute: ComputeConfig, batch: int) -> GatedDeltaState:
    """A sequence's decoding state before its first token: zeros (the window in the compute dtype)."""
    heads, dim = spec.num_heads, spec.head_dim
    return GatedDeltaState(
        jnp.zeros((batch, spec.conv_kernel - 1, 3 * heads * dim), dtype_of(compute.dtype)),
        jnp.zeros((batch, heads, dim, dim), jnp.float32),
    )


DECODE_STATES["kimi_delta"] = initial_state


class KimiDeltaAttention(nnx.Module):
    """The mixer of a `kimi_delta` layer; called as transformer.Attention is (positions, window
    and RoPE flags ignored), and with a cache reads and writes its layer's state."""

    def __init__(self, spec: KimiDeltaSpec, build: Build, *, rngs: nnx.Rngs):
        s = spec  # no LoRA on its projections
        d, h, k = build.d_model, s.num_heads, s.head_dim
        pdt, std = build.param_dtype, build.init_std
        names = ("embed", "heads", "head_dim")
        self.wq_dhk = param(rngs, (d, h, k), std, names, pdt)
        self.wk_dhk = param(rngs, (d, h, k), std, names, pdt)
        self.wv_dhk = param(rngs, (d, h, k), std, names, pdt)
        bound = 1.0 / math.sqrt(s.conv_kernel)  # torch's Conv1d default, HF's (c, 1, K) layout, one each

        def conv() -> nnx.Param:
            taps = jax.random.uniform(rngs.params(), (h * k, 1, s.conv_kernel), jnp.float32, -bound, bound)
            return nnx.Param(taps.astype(pdt), out_sharding=(None, None, None))

        self.conv_q_c1k, self.conv_k_c1k, self.conv_v_c1k = conv(), conv(), conv()
        if s.full_rank_gates:  # Ling 3: each gate one projection (f_proj, g_proj)
            self.w_f_dhk = param(rngs, (d, h, k), std, names, pdt)
            self.w_g_dhk = param(rngs, (d, h, k), std, names, pdt)
        else:
            self.w_fa_dk = param(rngs, (d, k), std, ("embed", None), pdt)  # the forget gate's low-rank pair
            self.w_fb_khk = param(rngs, (k, h, k), std, (None, "heads", "head_dim"), pdt)
        dt = jnp.exp(jax.random.uniform(rngs.params(), (h * k,), jnp.float32, math.log(1e-3), math.log(0.1)))
        dt = jnp.maximum(dt, 1e-4)
        self.dt_bias_x = nnx.Param((dt + jnp.log(-jnp.expm1(-dt))).astype(pdt), out_sharding=(None,))
        a = jax.random.uniform(rngs.params(), (1, 1, h, 1), jnp.float32, 1.0, 16.0)  # HF's A_log shape
        self.a_log_11h1 = nnx.Param(jnp.log(a).astype(pdt), out_sharding=(None, None, None, None))
        self.w_b_dh = param(rngs, (d, h), std, ("embed", "heads"), pdt)
        if not s.full_rank_gates:
            self.w_ga_dk = param(rngs, (d, k), std, ("embed", None), pdt)  # the output gate's low-rank pair
            self.w_gb_khk = param(rngs, (k, h, k), std, (None, "heads", "head_dim"), pdt)
        self.norm_k = nnx.Param(jnp.ones((k,), pdt), out_sharding=("norm",))
        self.wo_hkd = param(rngs, (h, k, d), build.out_std, ("heads", "head_dim", "embed"), pdt)
        self.heads, self.head_dim, self.norm_eps = h, k, s.norm_eps
        self.dtype = build.dtype
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general

    def _dense(self, x, attr: str, n_in: int = 1):
        w = getattr(self, attr)[...].astype(self.dtype)
        return dense(x, w, n_in, backward=self.matmul_backward, dot_general=self.dot_general)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: KimiDeltaSpec, cache: KVCache | None = None):
        """(b, t, d); with a cache (decoding) (out, the cache with this layer's state advanced)."""
        h, k = self.heads, self.head_dim
        if segment_ids_bt is not None:  # padding tokens contribute nothing (transformers zeroes them)
            x_btd = x_btd * (segment_ids_bt != 0)[..., None].astype(x_btd.dtype)
        batch, time, _ = x_btd.shape
        mixed_btc = jnp.concatenate(
            [self._dense(x_btd, w).reshape(batch, time, h * k) for w in ("wq_dhk", "wk_dhk", "wv_dhk")], axis=-1
        )
        state = None if cache is None else cache.states[cache.layer]
        convs = (self.conv_q_c1k, self.conv_k_c1k, self.conv_v_c1k)  # one convolution over q | k | v
        conv_kc = jnp.concatenate([c[...][:, 0, :] for c in convs]).T.astype(self.dtype)
        mixed_btc, window_bkc = causal_conv1d(
            mixed_btc, conv_kc, window_bkc=None if state is None else state.conv_bkc, segment_ids_bt=segment_ids_bt
        )
        q, kk, v = (mixed_btc[..., i * h * k : (i + 1) * h * k].reshape(batch, time, h, k) for i in range(3))
        if spec.full_rank_gates:
            raw_bthk = self._dense(x_btd, "w_f_dhk")
        else:
            raw_bthk = self._dense(self._dense(x_btd, "w_fa_dk"), "w_fb_khk")
        raw_bthk = raw_bthk.astype(jnp.float32) + self.dt_bias_x[...].astype(jnp.float32).reshape(h, k)
        decay_h = jnp.exp(self.a_log_11h1[...].astype(jnp.float32).reshape(h))
        if spec.gate_lower_bound is not None:  # Ling 3's safe gate: bounded below, in (bound, 0)
            g_bthk = spec.gate_lower_bound * jax.nn.sigmoid(decay_h[:, None] * raw_bthk)
        else:
            g_bthk = -decay_h[:, None] * jax.nn.softplus(raw_bthk)  # (b, t, h, k), <= 0
        beta_bth = jax.nn.sigmoid(self._dense(x_btd, "w_b_dh"))  # in the compute dtype, as transformers
        recurrent = None if state is None else state.recurrent_bhkv
        if time == 1 and recurrent is not None:  # one decoded token: the recurrence itself
            out, recurrent = kimi_delta_step(q[:, 0], kk[:, 0], v[:, 0], g_bthk[:, 0], beta_bth[:, 0], recurrent)
            out_bthk = out[:, None]
        else:
            out_bthk, recurrent = kimi_delta_chunked(
                q, kk, v, g_bthk, beta_bth, chunk_size=CHUNK, state_bhkv=recurrent, segment_ids_bt=segment_ids_bt
            )
        if spec.full_rank_gates:
            gate_bthk = self._dense(x_btd, "w_g_dhk")
        else:
            gate_bthk = self._dense(self._dense(x_btd, "w_ga_dk"), "w_gb_khk")
        out32 = out_bthk.astype(jnp.float32)  # RMSNorm over each head, float32 throughout, then the gate
        out32 = out32 * jax.lax.rsqrt(jnp.mean(out32 * out32, axis=-1, keepdims=True) + self.norm_eps)
        out32 = out32 * self.norm_k[...].astype(jnp.float32) * jax.nn.sigmoid(gate_bthk.astype(jnp.float32))
        out_btd = self._dense(out32.astype(self.dtype), "wo_hkd", 2)
        if cache is None:
            return out_btd
        assert state is not None
        states = list(cache.states)
        states[cache.layer] = GatedDeltaState(window_bkc.astype(state.conv_bkc.dtype), recurrent)
        return out_btd, dataclasses.replace(cache, states=tuple(states))

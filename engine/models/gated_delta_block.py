"""The Gated DeltaNet mixer kind (`gated_delta`): Qwen3-Next's and Qwen3.5's linear-attention
layers, as transformers 5.25 defines them (Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet).

A block kind is this module: the mixer's parameters, its call in training (the chunked gated
delta rule, engine/ops/gated_delta.py: work linear in the sequence) and in decoding (one token
through the recurrence), and its per-sequence decoding state, registered in
kv_cache.DECODE_STATES, which the KV cache carries in place of this layer's keys and values.
transformer.MIXERS names it; ModelConfig.mixer_pattern puts it in layers, which form a stack
of their own (`gated_delta_blocks`).

Per layer: x -> projections (q, k, v through a short causal convolution and SiLU; z the output
gate; b, a the step size and decay) -> the gated delta rule -> RMSNorm(out) * silu(z) -> out_proj.
Padding tokens (segment id 0) are zeroed on input, as transformers does, so left padding
leaves the state as it was; in packed rows the convolution and the state restart at each
document (segment ids), as attention's mask does. Shapes: b batch, t time, d d_model, k key heads, v value heads,
c convolution channels (q, k and v side by side).
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
from engine.models.specs import GatedDeltaSpec
from engine.ops.dense import dense
from engine.ops.gated_delta import (
    GatedDeltaState,
    decay_and_beta,
    gated_delta_chunked,
    gated_delta_step,
)
from engine.ops.linear_mixing import causal_conv1d, gated_rms_norm

CHUNK = 64
"""Tokens per chunk of the chunked form (transformers' and FLA's chunk size)."""


def initial_state(gd: GatedDeltaSpec, compute: ComputeConfig, batch: int) -> GatedDeltaState:
    """A sequence's decoding state before its first token: the convolution's window (its last
    conv_kernel - 1 inputs, in the compute dtype) and the recurrent state (float32), zeros."""
    channels = 2 * gd.num_key_heads * gd.key_head_dim + gd.num_value_heads * gd.value_head_dim
    return GatedDeltaState(
        jnp.zeros((batch, gd.conv_kernel - 1, channels), dtype_of(compute.dtype)),
        jnp.zeros((batch, gd.num_value_heads, gd.key_head_dim, gd.value_head_dim), jnp.float32),
    )


DECODE_STATES["gated_delta"] = initial_state


class GatedDeltaNet(nnx.Module):
    """The mixer of a `gated_delta` layer; called as transformer.Attention is (positions,
    window and RoPE flags ignored), and with a cache reads and writes its layer's state."""

    def __init__(self, spec: GatedDeltaSpec, build: Build, *, rngs: nnx.Rngs):
        gd = spec  # no LoRA on its projections
        d, hk, hv, dk, dv = build.d_model, gd.num_key_heads, gd.num_value_heads, gd.key_head_dim, gd.value_head_dim
        pdt, std = build.param_dtype, build.init_std
        group = hv // hk
        if gd.fused_projections:  # Qwen3-Next: [q k v z] and [b a] of each key head, side by side
            self.w_qkvz_dkx = param(rngs, (d, hk, 2 * dk + 2 * group * dv), std, ("embed", "heads", None), pdt)
            self.w_ba_dkx = param(rngs, (d, hk, 2 * group), std, ("embed", "heads", None), pdt)
        else:  # Qwen3.5: q, k, v of every head, then z, b, a apart
            self.w_qkv_dc = param(rngs, (d, 2 * hk * dk + hv * dv), std, ("embed", "mlp"), pdt)
            self.w_z_dvh = param(rngs, (d, hv, dv), std, ("embed", "heads", "head_dim"), pdt)
            self.w_b_dv = param(rngs, (d, hv), std, ("embed", "heads"), pdt)
            self.w_a_dv = param(rngs, (d, hv), std, ("embed", "heads"), pdt)
        channels = 2 * hk * dk + hv * dv
        # torch's Conv1d default (kaiming uniform over the kernel's fan-in), in HF's (c, 1, K) layout
        bound = 1.0 / math.sqrt(gd.conv_kernel)
        conv = jax.random.uniform(rngs.params(), (channels, 1, gd.conv_kernel), jnp.float32, -bound, bound)
        self.conv_c1k = nnx.Param(conv.astype(pdt), out_sharding=("mlp", None, None))
        # Decay rates A in [1, 16] as transformers draws them (0.01 there: 1 keeps log A away from 0)
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)
        self.a_log_v = nnx.Param(jnp.log(a).astype(pdt), out_sharding=("heads",))
        self.dt_bias_v = nnx.Param(jnp.ones((hv,), pdt), out_sharding=("heads",))
        self.norm_h = nnx.Param(jnp.ones((dv,), pdt), out_sharding=("norm",))
        self.w_out_vhd = param(rngs, (hv, dv, d), build.out_std, ("heads", "head_dim", "embed"), pdt)
        self.fused, self.sizes = gd.fused_projections, (hk, hv, dk, dv)
        self.norm_eps = gd.norm_eps
        self.dtype = build.dtype
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general

    def _dense(self, x, attr: str, n_in: int = 1):
        w = getattr(self, attr)[...].astype(self.dtype)
        return dense(x, w, n_in, backward=self.matmul_backward, dot_general=self.dot_general)

    def _projections(self, x_btd):
        """(mixed q|k|v (b, t, c) before the convolution, z (b, t, v, dv), b (b, t, v), a (b, t, v))."""
        hk, hv, dk, dv = self.sizes
        batch, time, _ = x_btd.shape
        if not self.fused:
            z = self._dense(x_btd, "w_z_dvh")
            return self._dense(x_btd, "w_qkv_dc"), z, self._dense(x_btd, "w_b_dv"), self._dense(x_btd, "w_a_dv")
        group = hv // hk
        qkvz = self._dense(x_btd, "w_qkvz_dkx")  # (b, t, key heads, [q k v z])
        ba = self._dense(x_btd, "w_ba_dkx")  # (b, t, key heads, [b a])
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v, z = qkvz[..., 2 * dk : 2 * dk + group * dv], qkvz[..., 2 * dk + group * dv :]
        mixed = jnp.concatenate(
            [q.reshape(batch, time, hk * dk), k.reshape(batch, time, hk * dk), v.reshape(batch, time, hv * dv)], -1
        )
        flat = (batch, time, hv)
        return mixed, z.reshape(*flat, dv), ba[..., :group].reshape(flat), ba[..., group:].reshape(flat)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: GatedDeltaSpec, cache: KVCache | None = None):
        """(b, t, d); with a cache (decoding) (out, the cache with this layer's state advanced)."""
        hk, hv, dk, dv = self.sizes
        if segment_ids_bt is not None:  # padding tokens contribute nothing (transformers zeroes them)
            x_btd = x_btd * (segment_ids_bt != 0)[..., None].astype(x_btd.dtype)
        batch, time, _ = x_btd.shape
        mixed_btc, z_btvh, b_btv, a_btv = self._projections(x_btd)
        state = None if cache is None else cache.states[cache.layer]
        conv_kc = self.conv_c1k[...][:, 0, :].T.astype(self.dtype)
        mixed_btc, window_bkc = causal_conv1d(
            mixed_btc, conv_kc, window_bkc=None if state is None else state.conv_bkc, segment_ids_bt=segment_ids_bt
        )
        q = mixed_btc[..., : hk * dk].reshape(batch, time, hk, dk)
        k = mixed_btc[..., hk * dk : 2 * hk * dk].reshape(batch, time, hk, dk)
        v = mixed_btc[..., 2 * hk * dk :].reshape(batch, time, hv, dv)
        g_btv, beta_btv = decay_and_beta(a_btv, b_btv, self.a_log_v[...], self.dt_bias_v[...].astype(jnp.float32))
        beta_btv = beta_btv.astype(self.dtype)  # sigmoid(b) in the model's dtype, as transformers
        if spec.beta_scale != 1.0:  # OLMo Hybrid: 2 sigmoid(b), eigenvalues of the update down to -1
            beta_btv = beta_btv * jnp.asarray(spec.beta_scale, self.dtype)
        recurrent = None if state is None else state.recurrent_bhkv
        if time == 1 and recurrent is not None:  # one decoded token: the recurrence itself
            out, recurrent = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g_btv[:, 0], beta_btv[:, 0], recurrent)
            out_btvh = out[:, None]
        else:
            out_btvh, recurrent = gated_delta_chunked(
                q, k, v, g_btv, beta_btv, chunk_size=CHUNK, state_bhkv=recurrent, segment_ids_bt=segment_ids_bt
            )
        out_btvh = gated_rms_norm(
            out_btvh, z_btvh, self.norm_h[...].astype(self.dtype), eps=self.norm_eps, norm_before_gate=True
        )
        out_btd = self._dense(out_btvh, "w_out_vhd", 2)
        if cache is None:
            return out_btd
        assert state is not None
        states = list(cache.states)
        states[cache.layer] = GatedDeltaState(window_bkc.astype(state.conv_bkc.dtype), recurrent)
        return out_btd, dataclasses.replace(cache, states=tuple(states))

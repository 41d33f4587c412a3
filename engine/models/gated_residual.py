"""Gated-residual hyper-connections (Qwen4-Exp; transformers' Qwen4ExpTextGatedResidual): the
residual stream is n parallel streams, each sublayer reads a gated mean of them and adds its
output to each with a gate of its own.

Per sublayer (attention or linear attention, feed-forward) and token, from the n streams
x (n, d), each RMS-normed on its own with a zero-centred scale per channel of all n d
(the sublayer's pre-norm: the layer has no other), h = norm(x):

    mix  = sigmoid(W_up silu(W_down h / n))     (n d,)  a gate per stream and channel
    pre  = mean_k (mix_k * h_k)                 (d,)    the sublayer's input
    post = 2 sigmoid(W_inject h / n)            (n,)    its output's share per stream

    y = f(pre);  x'_k = x_k + post_k * y

W_down is (n d -> rank), low rank. The model starts with n copies of the embedding and ends
with one more connection's `pre` alone (GatedResidualHead), which the LM head reads: there is
no final norm. The decoder carries the streams as one (b, t, n * d) array, as DeepSeek-V4's
manifold hyper-connections (hyper_connection.py, whose `expand` writes the output back here
too: no stream mix) do. Shapes: x = n * d, r the rank, n streams.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import param
from engine.models.hyper_connection import expand, feed_forward
from engine.models.specs import GatedResidualSpec


class GatedResidual(nnx.Module):
    """One sublayer's connection (hc_norm, input_mix_weight_down / _up, block_inject_weight);
    `inject` False: the model's final mix, which reads only (hyper_connection_mixer)."""

    def __init__(self, spec: GatedResidualSpec, d: int, build, *, rngs: nnx.Rngs, inject: bool = True):
        n, pdt, std = spec.streams, build.param_dtype, build.init_std
        self.norm_x = nnx.Param(jnp.zeros((n * d,), pdt), out_sharding=("norm",))
        self.w_down_xr = param(rngs, (n * d, spec.rank), std, ("embed", None), pdt)
        self.w_up_rx = param(rngs, (spec.rank, n * d), std, (None, "embed"), pdt)
        if inject:
            self.w_inject_xn = param(rngs, (n * d, n), std, ("embed", None), pdt)
        self.streams, self.eps, self.dtype = n, spec.norm_eps, build.dtype

    def _normed(self, x_btx):
        """Each stream RMS-normed on its own, times (1 + scale), in float32 then x's dtype."""
        b, t, _ = x_btx.shape
        x_btnd = x_btx.astype(jnp.float32).reshape(b, t, self.streams, -1)
        unit = x_btnd * jax.lax.rsqrt(jnp.mean(jnp.square(x_btnd), axis=-1, keepdims=True) + self.eps)
        return (unit.reshape(b, t, -1) * (1.0 + self.norm_x[...].astype(jnp.float32))).astype(x_btx.dtype)

    def read(self, x_btx):
        """(the sublayer's input (b, t, d), post (b, t, n) or None without `inject`)."""
        dt = self.dtype
        h_btx = self._normed(x_btx).astype(dt)
        n = jnp.asarray(self.streams, dt)
        low_btr = jax.nn.silu((h_btx @ self.w_down_xr[...].astype(dt)) / n)
        mix_btx = jax.nn.sigmoid(low_btr @ self.w_up_rx[...].astype(dt))
        b, t, _ = h_btx.shape
        pre_btd = jnp.mean((mix_btx * h_btx).reshape(b, t, self.streams, -1), axis=2)
        if not hasattr(self, "w_inject_xn"):
            return pre_btd, None
        post_btn = 2 * jax.nn.sigmoid((h_btx @ self.w_inject_xn[...].astype(dt)) / n)
        return pre_btd, post_btn


def gated_residual_layer(block, x_btx, positions_bt, segment_ids_bt, spec, cache=None, rotary=None):
    """A transformer.Block's layer over n streams (b, t, n d): each sublayer reads its
    connection's gated mean of the streams and is added back to each; as Block.forward
    returns, (streams, cache, router stats or None)."""
    ngram_state = None
    if spec.ngram_embedding is not None:  # the hashed n-gram embedding first (ngram_embedding.py)
        if cache is not None:  # its state beside the mixer's
            ngram_state, mixer_state = cache.states[cache.layer]
            cache = _with_state(cache, mixer_state)
        added, ngram_state = block.ple(x_btx, segment_ids_bt, ngram_state)
        x_btx = x_btx + added
    attn_in, post = block.attn_gr.read(x_btx)
    extra = {"rotary": rotary, "shared_kv": None, "store_kv": False, "index_state": None}
    branch, cache, _ = block._mix(attn_in, positions_bt, segment_ids_bt, spec, cache, extra)
    if ngram_state is not None:
        cache = _with_state(cache, (ngram_state, cache.states[cache.layer]))
    x_btx = expand(x_btx, branch, post, None)
    mlp_in, post = block.ffn_gr.read(x_btx)
    mlp_out, stats = feed_forward(block, mlp_in, segment_ids_bt, spec)
    return expand(x_btx, mlp_out, post, None), cache, stats


def _with_state(cache, state):
    """The cache with this layer's decoding state replaced."""
    states = list(cache.states)
    states[cache.layer] = state
    return cache.replace(states=tuple(states))

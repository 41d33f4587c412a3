"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4, arXiv 2512.24880): the residual
stream is n parallel streams instead of one, and each sublayer reads a learned mix of them
and writes its output back into each with a learned weight.

Per sublayer (attention, feed-forward) and token, from the n streams x (n, d), RMS-normed
together and projected (transformers' DeepseekV4HyperConnection):

    pre  = sigmoid(s0 * W_pre x + b_pre) + eps            (n,)   the sublayer's input mix
    post = 2 * sigmoid(s1 * W_post x + b_post)            (n,)   its output's share per stream
    comb = sinkhorn(softmax(s2 * W_comb x + b_comb) + eps) (n, n) doubly stochastic

    y = f(sum_j pre_j x_j);  x'_k = post_k * y + sum_j comb[j, k] x_j

`sinkhorn` alternates column and row normalisation (`iterations` times in all), so mixing
the streams never grows their norm. The model starts with n copies of the embedding and ends
with one mix of the streams (HyperHead: `pre` alone). The decoder carries the streams as one
(b, t, n * d) array, so the layer scan and the activation sharding see the usual rank.

HY-V4's independent hyper-connections (HyperConnectionSpec.independent) have no `comb`: each
stream keeps itself, x'_k = post_k * y + x_k, with post = magnitude * sigmoid(.) + eps; their
projection yields `pre` and `post` only, under two scales.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import param
from engine.models.specs import HyperConnectionSpec


def _unit_rms(x, eps: float):
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class HyperConnection(nnx.Module):
    """One sublayer's weights (transformers' attn_hc / ffn_hc): fn (stored (n d, (2 + n) n)),
    base and the three scales, in float32 as transformers keeps them."""

    def __init__(self, spec: HyperConnectionSpec, d: int, std: float, *, rngs: nnx.Rngs):
        n = spec.streams
        mixes = 2 * n if spec.independent else (2 + n) * n
        self.w_mix_xm = param(rngs, (n * d, mixes), std, (None, None), jnp.float32)
        self.b_mix_m = nnx.Param(jnp.zeros((mixes,), jnp.float32), out_sharding=(None,))
        if spec.independent:  # HY-V4: pre's and post's scales
            self.scale_2 = nnx.Param(jnp.ones((2,), jnp.float32), out_sharding=(None,))
        else:
            self.scale_3 = nnx.Param(jnp.ones((3,), jnp.float32), out_sharding=(None,))

    def weights(self, x_btx, spec: HyperConnectionSpec):
        """(pre (b, t, n), post (b, t, n), comb (b, t, n, n); None independent) in float32 of
        the streams x (b, t, n d)."""
        n = spec.streams
        mixes_btm = _unit_rms(x_btx.astype(jnp.float32), spec.norm_eps) @ self.w_mix_xm[...].astype(jnp.float32)
        scale = (self.scale_2 if spec.independent else self.scale_3)[...].astype(jnp.float32)
        base_m = self.b_mix_m[...].astype(jnp.float32)
        pre = jax.nn.sigmoid(mixes_btm[..., :n] * scale[0] + base_m[:n]) + spec.eps
        post = spec.magnitude * jax.nn.sigmoid(mixes_btm[..., n : 2 * n] * scale[1] + base_m[n : 2 * n])
        if spec.independent:  # no stream mix; post floored as pre is
            return pre, post + spec.eps, None
        comb_logits = mixes_btm[..., 2 * n :] * scale[2] + base_m[2 * n :]
        comb = jax.nn.softmax(comb_logits.reshape(*comb_logits.shape[:-1], n, n), axis=-1) + spec.eps
        comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + spec.eps)
        for _ in range(spec.iterations - 1):  # a handful of tiny (n, n) steps: unrolled
            comb = comb / (jnp.sum(comb, axis=-1, keepdims=True) + spec.eps)
            comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + spec.eps)
        return pre, post, comb


def collapse(x_btx, pre_btn):
    """sum_j pre_j x_j: (b, t, d) in x's dtype."""
    b, t, _ = x_btx.shape
    n = pre_btn.shape[-1]
    x_btnd = x_btx.reshape(b, t, n, -1)
    return jnp.sum(pre_btn[..., None] * x_btnd.astype(jnp.float32), axis=2).astype(x_btx.dtype)


def expand(x_btx, y_btd, post_btn, comb_btnn):
    """x'_k = post_k * y + sum_j comb[j, k] x_j, as (b, t, n d) in x's dtype (transformers mixes
    in the activations' dtype); comb None: x'_k = post_k * y + x_k (independent)."""
    b, t, _ = x_btx.shape
    n = post_btn.shape[-1]
    dt = x_btx.dtype
    x_btnd = x_btx.reshape(b, t, n, -1)
    if comb_btnn is None:
        mixed_btnd = x_btnd
    else:
        mixed_btnd = jnp.einsum("btjk,btjd->btkd", comb_btnn.astype(dt), x_btnd)
    out_btnd = post_btn.astype(dt)[..., None] * y_btd[:, :, None, :].astype(dt) + mixed_btnd
    return out_btnd.reshape(b, t, -1)


def streams_of(x_btd, n: int):
    """The embedding as n identical streams (b, t, n d)."""
    return jnp.tile(x_btd, (1, 1, n))


class HyperHead(nnx.Module):
    """The streams' final mix before the model's norm (transformers' hc_head): `pre` alone."""

    def __init__(self, spec: HyperConnectionSpec, d: int, std: float, *, rngs: nnx.Rngs):
        n = spec.streams
        self.spec = spec
        self.w_mix_xn = param(rngs, (n * d, n), std, (None, None), jnp.float32)
        self.b_mix_n = nnx.Param(jnp.zeros((n,), jnp.float32), out_sharding=(None,))
        self.scale_1 = nnx.Param(jnp.ones((1,), jnp.float32), out_sharding=(None,))

    def __call__(self, x_btx):
        mixes_btn = _unit_rms(x_btx.astype(jnp.float32), self.spec.norm_eps) @ self.w_mix_xn[...].astype(jnp.float32)
        pre_btn = jax.nn.sigmoid(mixes_btn * self.scale_1[...][0] + self.b_mix_n[...]) + self.spec.eps
        return collapse(x_btx, pre_btn)


def hyper_layer(block, x_btx, positions_bt, segment_ids_bt, spec, cache=None, rotary=None, index_state=None):
    """A transformer.Block's layer over n streams (b, t, n d): each sublayer reads its
    connection's mix of the streams through its pre-norm and is written back by it; as
    Block.forward returns, (streams, cache, router stats or None); with an `index_state`
    (shared indexer layers, HY-V4) the streams are (streams, the state passed on)."""
    hyper = spec.hyper
    pre, post, comb = block.attn_hc.weights(x_btx, hyper)
    attn_in = block.attn_norm(collapse(x_btx, pre))
    extra = {"rotary": rotary, "shared_kv": None, "store_kv": False, "index_state": index_state}
    branch, cache, _ = block._mix(attn_in, positions_bt, segment_ids_bt, spec, cache, extra)
    if index_state is not None:
        branch, index_state = branch
    x_btx = expand(x_btx, branch, post, comb)
    pre, post, comb = block.ffn_hc.weights(x_btx, hyper)
    mlp_in = block.mlp_norm(collapse(x_btx, pre))
    mlp_out, stats = feed_forward(block, mlp_in, segment_ids_bt, spec)
    x_btx = expand(x_btx, mlp_out, post, comb)
    return (x_btx if index_state is None else (x_btx, index_state)), cache, stats


def feed_forward(block, mlp_in_btd, segment_ids_bt, spec):
    """(the block's feed-forward output on its input, router stats or None): a mixture of
    experts is told which tokens are padding (segment id 0), left out of its statistics."""
    if not spec.is_moe:
        return block.mlp(mlp_in_btd), None
    valid_bt = None if segment_ids_bt is None else segment_ids_bt != 0
    return block.mlp(mlp_in_btd, valid_bt)

"""Hashed n-gram per-layer embeddings (Qwen4-Exp's PLE; transformers' Qwen4ExpTextPLELayer and
Qwen4ExpTextNGramEmbedding): some layers add to every residual stream a gated value read from
hashed n-gram tables, before the layer runs.

For each token and each n = 2 .. order, the n-gram ending at it (the token and the n - 1
before it, each replaced by eos where the document ended between: an eos token, padding, a
packed document's start) is hashed by (heads_per_order) heads:

    id = (xor_p  token[t - p] * m_p) mod P_head + offset_head      (64-bit products, p < n)

with odd multipliers m_p and a prime vocabulary P per head (specs.ngram_multipliers,
ngram_primes), each head's rows after the earlier heads' in one table. The heads' embeddings,
concatenated (e, `dim` wide), make one value v = W_v e (d) and a key per stream
k = norm(W_k e) (n, d); each stream's RMS-normed activations q gate it,

    g = sign(s) sqrt(max(|s|, 1e-6)),  s = q_k . k_k / sqrt(d);   u_k = sigmoid(g_k) v

and the layer's streams get u + silu(conv(norm(u))), a depthwise causal convolution of
`conv_kernel` taps `order` positions apart over all n d channels. The products run in four
16-bit limbs of 32-bit integers and the modulus a nibble at a time (XLA without 64-bit
integers): each prime must stay below 2**28.

Training computes every position at once (shifts of the token row, the convolution's taps
masked at document starts); decoding keeps the last order - 1 tokens (eos at the start) and
the convolution's last (conv_kernel - 1) * order inputs as the layer's state beside its
mixer's (KVCache.states[layer] = (this state, the mixer's)). Shapes: x = n * d, e = dim,
h the heads, r the table's rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models import hash_routing
from engine.models.common import param
from engine.models.specs import NGramEmbeddingSpec

_LIMB = 0xFFFF


class NGramState(NamedTuple):
    """A layer's decoding state: the last order - 1 tokens (b, order - 1) and the
    convolution's last inputs (b, (conv_kernel - 1) * order, x)."""

    tokens: jax.Array
    conv: jax.Array


def initial_state(spec: NGramEmbeddingSpec, streams: int, d: int, batch: int, dtype) -> NGramState:
    context = jnp.full((batch, spec.order - 1), spec.eos_token_id, jnp.int32)
    return NGramState(context, jnp.zeros((batch, (spec.conv_kernel - 1) * spec.order, streams * d), dtype))


def _times(tokens, multiplier: int) -> list:
    """tokens (uint32, below 2**32) * multiplier as four 16-bit limbs, least significant first."""
    halves = (tokens & _LIMB, tokens >> 16)
    parts = [(multiplier >> (16 * j)) & _LIMB for j in range(4)]
    columns = [jnp.zeros_like(tokens) for _ in range(6)]
    for i, half in enumerate(halves):
        for j, part in enumerate(parts):
            product = half * jnp.uint32(part)  # below 2**32
            columns[i + j] = columns[i + j] + (product & _LIMB)
            columns[i + j + 1] = columns[i + j + 1] + (product >> 16)
    limbs, carry = [], jnp.zeros_like(tokens)
    for column in columns[:4]:  # the product is below 2**63: no limb past the fourth
        total = column + carry
        limbs.append(total & _LIMB)
        carry = total >> 16
    return limbs


def _modulo(limbs: list, primes_h):
    """(limbs' 64-bit value) mod each prime: (..., h) uint32, a nibble at a time from the top."""
    r = jnp.zeros((*limbs[0].shape, primes_h.shape[0]), jnp.uint32)
    for limb in reversed(limbs):
        for shift in (12, 8, 4, 0):
            r = (r * 16 + ((limb >> shift) & 0xF)[..., None]) % primes_h
    return r


def hashed_ids(spec: NGramEmbeddingSpec, history_bh, ends_bh, t: int):
    """(b, t, heads) int32 table rows of the last t positions of the token `history_bh`
    (padding as eos), `ends_bh` marking the tokens that end a document (eos, a document's last)."""
    eos = jnp.int32(spec.eos_token_id)
    shifted = [history_bh]
    blocked_bh = jnp.zeros(history_bh.shape, bool)
    for s in range(1, spec.order):  # the token s back, unless a document ended since
        pad = ((0, 0), (s, 0))
        blocked_bh = blocked_bh | jnp.pad(ends_bh, pad, constant_values=True)[:, : history_bh.shape[1]]
        back_bh = jnp.pad(history_bh, pad, constant_values=spec.eos_token_id)[:, : history_bh.shape[1]]
        shifted.append(jnp.where(blocked_bh, eos, back_bh))
    products = [_times(x[:, -t:].astype(jnp.uint32), m) for x, m in zip(shifted, spec.multipliers, strict=True)]
    offsets, ids = [0], []
    for prime in spec.primes:
        offsets.append(offsets[-1] + prime)
    for n in range(2, spec.order + 1):
        mixed = products[0]
        for p in range(1, n):
            mixed = [a ^ b for a, b in zip(mixed, products[p], strict=True)]
        heads = slice((n - 2) * spec.heads_per_order, (n - 1) * spec.heads_per_order)
        primes_h = jnp.asarray(spec.primes[heads], jnp.uint32)
        ids.append(_modulo(mixed, primes_h).astype(jnp.int32) + jnp.asarray(offsets[heads], jnp.int32))
    return jnp.concatenate(ids, axis=-1)


def _stream_norm(x_btx, scale_x, streams: int, eps: float):
    """Each stream RMS-normed on its own, times (1 + scale), in float32."""
    b, t, _ = x_btx.shape
    x = x_btx.astype(jnp.float32).reshape(b, t, streams, -1)
    unit = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)
    return unit.reshape(b, t, -1) * (1.0 + scale_x.astype(jnp.float32))


class NGramEmbedding(nnx.Module):
    """One layer's (ple.*): the table, the key and value projections, three norms, the convolution."""

    def __init__(self, spec: NGramEmbeddingSpec, streams: int, build, *, rngs: nnx.Rngs):
        d, pdt, std = build.d_model, build.param_dtype, build.init_std
        x = streams * d
        self.table_ri = param(rngs, (spec.rows, spec.dim // spec.heads), std, ("vocab", None), pdt)
        self.w_key_ex = param(rngs, (spec.dim, x), std, (None, "embed"), pdt)
        self.w_value_ed = param(rngs, (spec.dim, d), std, (None, "embed"), pdt)
        self.norm_key_x, self.norm_query_x, self.norm_conv_x = (
            nnx.Param(jnp.zeros((x,), pdt), out_sharding=("norm",)) for _ in range(3)
        )
        # transformers starts the convolution at zero: the embedding enters through u alone
        self.conv_x1k = nnx.Param(jnp.zeros((x, 1, spec.conv_kernel), pdt), out_sharding=(None, None, None))
        self.spec, self.streams, self.dtype = spec, streams, build.dtype

    def __call__(self, x_btx, segment_ids_bt, state: NGramState | None):
        """(what the streams (b, t, x) add, the new state or None without one)."""
        spec, dt, n = self.spec, self.dtype, self.streams
        tokens_bt = hash_routing.running_tokens()
        b, t = tokens_bt.shape
        valid_bt = jnp.ones((b, t), bool) if segment_ids_bt is None else segment_ids_bt != 0
        tokens_bt = jnp.where(valid_bt, tokens_bt.astype(jnp.int32), spec.eos_token_id)
        ends_bt = tokens_bt == spec.eos_token_id
        if state is None:  # a document's last token ends it too (packed rows)
            if segment_ids_bt is not None:
                ends_bt = ends_bt | jnp.pad(segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1], ((0, 0), (0, 1)))
            context = jnp.full((b, spec.order - 1), spec.eos_token_id, jnp.int32)
        else:
            context = state.tokens
        history_bh = jnp.concatenate([context, tokens_bt], axis=1)
        ends_bh = jnp.concatenate([context == spec.eos_token_id, ends_bt], axis=1)
        ids_bth = hashed_ids(spec, history_bh, ends_bh, t)
        e_bte = self.table_ri[...].astype(dt)[ids_bth].reshape(b, t, -1)
        d = x_btx.shape[-1] // n
        key = _stream_norm(e_bte @ self.w_key_ex[...].astype(dt), self.norm_key_x[...], n, spec.norm_eps)
        query = _stream_norm(x_btx, self.norm_query_x[...], n, spec.norm_eps)
        value_btd = (e_bte @ self.w_value_ed[...].astype(dt)).astype(jnp.float32)
        s_btn = jnp.sum((key * query).reshape(b, t, n, d), axis=-1) / math.sqrt(d)
        g_btn = jnp.sqrt(jnp.maximum(jnp.abs(s_btn), 1e-6)) * jnp.sign(s_btn)
        u_btx = (jax.nn.sigmoid(g_btn)[..., None] * value_btd[:, :, None, :]).reshape(b, t, -1).astype(dt)
        conv_in = _stream_norm(u_btx, self.norm_conv_x[...], n, spec.norm_eps).astype(dt)
        u_btx = jnp.where(valid_bt[..., None], u_btx, 0)
        conv_in = jnp.where(valid_bt[..., None], conv_in, 0)
        width = (spec.conv_kernel - 1) * spec.order
        past = jnp.zeros((b, width, conv_in.shape[-1]), dt) if state is None else state.conv.astype(dt)
        window = jnp.concatenate([past, conv_in], axis=1)
        w_xk = self.conv_x1k[...].astype(jnp.float32)[:, 0]
        conv = jnp.zeros(u_btx.shape, jnp.float32)
        for k in range(spec.conv_kernel):  # tap k reads the input (conv_kernel - 1 - k) * order back
            back = (spec.conv_kernel - 1 - k) * spec.order
            tap = window[:, width - back : width - back + t].astype(jnp.float32)
            if state is None and segment_ids_bt is not None and back:  # not across a packed document's start
                same = jnp.pad(segment_ids_bt[:, :-back] == segment_ids_bt[:, back:], ((0, 0), (back, 0)))
                tap = jnp.where(same[..., :t, None], tap, 0)
            conv = conv + tap * w_xk[:, k]
        out = u_btx.astype(jnp.float32) + jax.nn.silu(conv)
        new_state = None
        if state is not None:
            kept = window[:, window.shape[1] - width :].astype(state.conv.dtype)
            new_state = NGramState(history_bh[:, history_bh.shape[1] - (spec.order - 1) :], kept)
        return out.astype(x_btx.dtype), new_state

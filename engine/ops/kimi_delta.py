"""Kimi Delta Attention (KDA; Kimi Linear, arXiv 2510.26692): the gated delta rule with a decay
per key channel instead of one per head, as transformers 5.25 defines it (modeling_kimi_linear:
`chunk_kimi_delta_attention`, `recurrent_kimi_delta_attention`).

Per head the state S (key_dim x value_dim) evolves token by token as

    S <- diag(exp(g_t)) S;   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = q_t^T S

with q, k L2-normalised, q scaled by key_dim^-1/2, g_t (key_dim,) <= 0 the log decay of each
key channel and beta_t the step size. Three forms, as engine/ops/gated_delta.py's:

- `kimi_delta_chunked`, for training: chunks of C tokens, a lax.scan over them carrying the
  state; inside a chunk the delta updates are condensed by the UT transform (the inverse of
  one unit-lower-triangular C x C matrix, gated_delta._unit_lower_inverse). With a decay per
  channel the C x C products weigh each channel by exp(G_i - G_j) (G the in-chunk cumulative
  log decay), exact at any decay (no exp(-G) factor that could overflow); that (C, C,
  key_dim) weight exists for one chunk at a time. Work is linear in t; padding uses g = 0,
  beta = 0, k = 0, which leaves the state untouched.
- `kimi_delta_step`, for decoding: one token, carrying S.
- `kimi_delta_scan`, the per-token lax.scan of that step: the tests' reference.

Shapes: b batch, t time, h heads, k key head dim, v value head dim, n chunks, c chunk positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.ops.gated_delta import _document_starts, _unit_lower_inverse
from engine.ops.linear_mixing import l2_normalize


def _prepare(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth):
    """Float32, q and k L2-normalised (as the FLA kernels: after the cast), q scaled."""
    q, k = l2_normalize(q_bthk.astype(jnp.float32)), l2_normalize(k_bthk.astype(jnp.float32))
    q = q * q.shape[-1] ** -0.5
    return q, k, v_bthv.astype(jnp.float32), g_bthk.astype(jnp.float32), beta_bth.astype(jnp.float32)


def _step(state_bhkv, token):
    """One token of the rule on prepared inputs: decay each key channel, write the correction, read."""
    q_bhk, k_bhk, v_bhv, g_bhk, beta_bh = token
    state_bhkv = state_bhkv * jnp.exp(g_bhk)[..., None]
    predicted_bhv = jnp.einsum("bhk,bhkv->bhv", k_bhk, state_bhkv)
    delta_bhv = (v_bhv - predicted_bhv) * beta_bh[..., None]
    state_bhkv = state_bhkv + k_bhk[..., :, None] * delta_bhv[..., None, :]
    return state_bhkv, jnp.einsum("bhk,bhkv->bhv", q_bhk, state_bhkv)


def kimi_delta_step(q_bhk, k_bhk, v_bhv, g_bhk, beta_bh, state_bhkv) -> tuple[jax.Array, jax.Array]:
    """One decoded token: (output (b, h, v) in q's dtype, the next state, float32)."""
    q, k, v, g, beta = _prepare(q_bhk, k_bhk, v_bhv, g_bhk, beta_bh)
    state_bhkv, out_bhv = _step(state_bhkv.astype(jnp.float32), (q, k, v, g, beta))
    return out_bhv.astype(q_bhk.dtype), state_bhkv


def kimi_delta_scan(
    q_bthk, k_bthk, v_bthv, g_bthk, beta_bth, *, state_bhkv=None, segment_ids_bt=None
) -> tuple[jax.Array, jax.Array]:
    """The per-token recurrence (a lax.scan over t): (output (b, t, h, v), final state).
    `segment_ids_bt` (packed rows): the state restarts at zero where the document changes."""
    q, k, v, g, beta = _prepare(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth)
    if segment_ids_bt is not None:  # a new document: decay exp(-inf) = 0 forgets the state
        g = jnp.where(_document_starts(segment_ids_bt)[..., None, None], -jnp.inf, g)
    batch, _, heads, key_dim = q.shape
    state = jnp.zeros((batch, heads, key_dim, v.shape[-1]), jnp.float32) if state_bhkv is None else state_bhkv
    time_major = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out_tbhv = jax.lax.scan(_step, state.astype(jnp.float32), time_major)
    return jnp.moveaxis(out_tbhv, 0, 1).astype(q_bthk.dtype), state


def kimi_delta_chunked(
    q_bthk: jax.Array,
    k_bthk: jax.Array,
    v_bthv: jax.Array,
    g_bthk: jax.Array,
    beta_bth: jax.Array,
    *,
    chunk_size: int = 64,
    state_bhkv: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunked form (training, prefill): `kimi_delta_scan`'s result. `segment_ids_bt`
    (packed rows): no token reads another document's writes (gated_delta_chunked's masks, per
    channel)."""
    q, k, v, g, beta = _prepare(q_bthk, k_bthk, v_bthv, g_bthk, beta_bth)
    batch, time, heads, key_dim = q.shape
    state = jnp.zeros((batch, heads, key_dim, v.shape[-1]), jnp.float32) if state_bhkv is None else state_bhkv
    pad = -time % chunk_size
    chunks = (time + pad) // chunk_size

    def to_chunks(x):  # (b, t, h, ...) -> (n, b, h, C, ...), zero-padded
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, chunks, chunk_size, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))  # q, g: (n, b, h, C, k); beta (n, b, h, C)
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    same = jnp.ones((chunks, batch, 1, chunk_size, chunk_size), bool)
    continues = last_doc = jnp.ones((chunks, batch, 1, chunk_size), bool)
    if segment_ids_bt is not None:  # (n, b, 1, C): the padding continues the last document
        segments = jnp.pad(segment_ids_bt, [(0, 0), (0, pad)], mode="edge").reshape(batch, chunks, 1, chunk_size)
        segments = jnp.moveaxis(segments, 1, 0)
        before = jnp.concatenate([segments[:1, ..., :1], segments[:-1, ..., -1:]])  # the token before each chunk
        same = segments[..., :, None] == segments[..., None, :]
        continues = segments == before  # no document starts between the chunk's start and the token
        last_doc = segments == segments[..., -1:]

    def chunk_step(state_bhkv, chunk):
        q, k, v, g, beta, same, continues, last_doc = chunk  # one chunk: (b, h, C, ...)
        cum = jnp.cumsum(g, axis=-2)  # (b, h, C, k), <= 0 and decreasing
        visible = lower & same  # (b, 1|h, C, C): j <= i within one document
        # exp(G_i - G_j) per channel for j <= i (exponent <= 0), 0 elsewhere
        decay_cck = jnp.exp(jnp.where(visible[..., None], cum[..., :, None, :] - cum[..., None, :, :], -jnp.inf))
        k_beta = k * beta[..., None]
        ut_system = jnp.einsum("bhik,bhjk,bhijk->bhij", k_beta, k, decay_cck)
        from_start = jnp.where(continues[..., None], jnp.exp(cum), 0.0)  # (b, h, C, k)
        rhs = jnp.concatenate([v * beta[..., None], k_beta * from_start], axis=-1)
        solved = _unit_lower_inverse(ut_system) @ rhs
        new_v, k_cum = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
        intra = jnp.einsum("bhik,bhjk,bhijk->bhij", q, k, decay_cck)
        v_corrected = new_v - k_cum @ state_bhkv  # what the state does not already predict
        out = (q * from_start) @ state_bhkv + intra @ v_corrected
        total = cum[..., -1:, :]  # (b, h, 1, k): the chunk's whole decay
        to_end = jnp.where(last_doc[..., None], jnp.exp(total - cum), 0.0)
        carried = jnp.where(continues[..., -1:, None], jnp.exp(total), 0.0)  # (b, h, 1, k)
        state_bhkv = state_bhkv * jnp.swapaxes(carried, -1, -2) + jnp.swapaxes(k * to_end, -1, -2) @ v_corrected
        return state_bhkv, out

    state, out_nbhcv = jax.lax.scan(
        chunk_step, state.astype(jnp.float32), (q, k, v, g, beta, same, continues, last_doc)
    )
    out_bthv = jnp.moveaxis(jnp.moveaxis(out_nbhcv, 0, 1), 3, 2).reshape(batch, chunks * chunk_size, heads, -1)
    return out_bthv[:, :time].astype(q_bthk.dtype), state

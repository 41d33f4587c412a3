"""Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024), the linear-attention mixer of Qwen3-Next and
Qwen3.5, as transformers 5.25 defines it (modeling_qwen3_next: `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `Qwen3NextGatedDeltaNet.forward`).

Per value head the state S (key_dim x value_dim) evolves token by token as

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - k_t^T S))^T;   o_t = q_t^T S

with q, k L2-normalised and q scaled by key_dim^-1/2, g_t = -exp(A_log) softplus(a_t + dt_bias)
<= 0 the log decay and beta_t = sigmoid(b_t) the delta rule's step size. Three forms compute it:

- `gated_delta_chunked`, for training: chunks of C tokens; inside a chunk the delta updates are
  condensed with the UT transform (the inverse of one unit-lower-triangular C x C matrix per
  chunk, built from matmuls), so the work is batched matmuls of C x C and C x key_dim, and
  only the state passes from chunk to chunk (a lax.scan over t / C steps). Work is linear in
  t; padding to a multiple of C uses g = 0, beta = 0, k = 0, which leaves the state untouched,
  so the final state is exact. C must be a power of two.
- `gated_delta_step`, for decoding: one token, carrying S.
- `gated_delta_scan`, the per-token lax.scan of that step: the tests' reference.

`gated_deltanet` is the whole mixer (projections, short convolution, the rule, gated RMSNorm,
output projection) on a plain parameter dict, decoding included through `GatedDeltaState`.
Shapes: b batch, t time, h heads, k key head dim, v value head dim, d model width, c channels.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from engine.ops.linear_mixing import causal_conv1d, gated_rms_norm, l2_normalize, repeat_heads

Params = dict[str, jax.Array]


class GatedDeltaDims(NamedTuple):
    """A Gated DeltaNet layer's sizes (Qwen3NextConfig's linear_* fields)."""

    num_key_heads: int
    num_value_heads: int  # a multiple of num_key_heads: each key head serves a group of value heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    norm_eps: float = 1e-6

    @property
    def conv_channels(self) -> int:
        """Channels of the short convolution: q, k and v side by side."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


class GatedDeltaState(NamedTuple):
    """What decoding carries per sequence instead of a KV cache."""

    conv_bkc: jax.Array  # (b, conv_kernel - 1, conv_channels): the convolution's last inputs
    recurrent_bhkv: jax.Array  # (b, value heads, key dim, value dim), float32


def initial_state(batch: int, dims: GatedDeltaDims, dtype: jnp.dtype = jnp.float32) -> GatedDeltaState:
    """The state before the first token: zeros."""
    return GatedDeltaState(
        jnp.zeros((batch, dims.conv_kernel - 1, dims.conv_channels), dtype),
        jnp.zeros((batch, dims.num_value_heads, dims.key_head_dim, dims.value_head_dim), jnp.float32),
    )


def decay_and_beta(
    a_bth: jax.Array, b_bth: jax.Array, a_log_h: jax.Array, dt_bias_h: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(g, beta): the log decay -exp(A_log) softplus(a + dt_bias) (<= 0) and sigmoid(b), float32."""
    g_bth = -jnp.exp(a_log_h.astype(jnp.float32)) * jax.nn.softplus(a_bth.astype(jnp.float32) + dt_bias_h)
    return g_bth, jax.nn.sigmoid(b_bth)


def _prepare(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, qk_l2norm: bool):
    """Float32, key heads repeated to the value heads, q and k normalised, q scaled."""
    num_value_heads = v_bthv.shape[2]
    q_bthk, k_bthk = (repeat_heads(x.astype(jnp.float32), num_value_heads) for x in (q_bthk, k_bthk))
    if qk_l2norm:
        q_bthk, k_bthk = l2_normalize(q_bthk), l2_normalize(k_bthk)
    q_bthk = q_bthk * q_bthk.shape[-1] ** -0.5
    return q_bthk, k_bthk, v_bthv.astype(jnp.float32), g_bth.astype(jnp.float32), beta_bth.astype(jnp.float32)


def _zero_state(q_bthk: jax.Array, v_bthv: jax.Array) -> jax.Array:
    return jnp.zeros((q_bthk.shape[0], v_bthv.shape[2], q_bthk.shape[3], v_bthv.shape[3]), jnp.float32)


def _delta_step(state_bhkv, token):
    """One token of the rule on prepared inputs: decay, write the correction, read."""
    q_bhk, k_bhk, v_bhv, g_bh, beta_bh = token
    state_bhkv = state_bhkv * jnp.exp(g_bh)[..., None, None]
    predicted_bhv = jnp.einsum("bhk,bhkv->bhv", k_bhk, state_bhkv)
    delta_bhv = (v_bhv - predicted_bhv) * beta_bh[..., None]
    state_bhkv = state_bhkv + k_bhk[..., :, None] * delta_bhv[..., None, :]
    return state_bhkv, jnp.einsum("bhk,bhkv->bhv", q_bhk, state_bhkv)


def gated_delta_step(
    q_bhk: jax.Array,
    k_bhk: jax.Array,
    v_bhv: jax.Array,
    g_bh: jax.Array,
    beta_bh: jax.Array,
    state_bhkv: jax.Array,
    *,
    qk_l2norm: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """One decoded token: (output (b, h, v) in q's dtype, the next state)."""
    q, k, v, g, beta = _prepare(
        q_bhk[:, None], k_bhk[:, None], v_bhv[:, None], g_bh[:, None], beta_bh[:, None], qk_l2norm
    )
    state_bhkv, out_bhv = _delta_step(state_bhkv.astype(jnp.float32), (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]))
    return out_bhv.astype(q_bhk.dtype), state_bhkv


def gated_delta_scan(
    q_bthk: jax.Array,
    k_bthk: jax.Array,
    v_bthv: jax.Array,
    g_bth: jax.Array,
    beta_bth: jax.Array,
    *,
    state_bhkv: jax.Array | None = None,
    qk_l2norm: bool = True,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The per-token recurrence (a lax.scan over t): (output (b, t, h, v), final state).
    `segment_ids_bt` (packed rows): the state restarts at zero where the document changes
    (the start state counts as the first token's document)."""
    q, k, v, g, beta = _prepare(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, qk_l2norm)
    if segment_ids_bt is not None:  # a new document: decay exp(-inf) = 0 forgets the state
        g = jnp.where(_document_starts(segment_ids_bt)[..., None], -jnp.inf, g)
    state = _zero_state(q, v) if state_bhkv is None else state_bhkv.astype(jnp.float32)
    time_major = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    state, out_tbhv = jax.lax.scan(_delta_step, state, time_major)
    return jnp.moveaxis(out_tbhv, 0, 1).astype(q_bthk.dtype), state


def _document_starts(segment_ids_bt: jax.Array) -> jax.Array:
    """(b, t) bool: the token's document differs from the previous token's (never the first)."""
    return jnp.concatenate(
        [jnp.zeros_like(segment_ids_bt[:, :1], bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1
    )


def _unit_lower_inverse(m_cc: jax.Array) -> jax.Array:
    """(I + strictly_lower(m))^-1 for a power-of-two size C (m's diagonal is not read).

    Block by block, bottom up: the inverse of [[A, 0], [B, D]] is [[A^-1, 0], [-D^-1 B A^-1,
    D^-1]], so log2(C) rounds of batched matmuls build it from the 1 x 1 blocks (each 1). XLA:CPU
    expands a batched `triangular_solve` into a slow loop (at C = 64 it took most of the chunked
    step's time, bench/linear_mixers.py); this is matmuls on every backend, as substitution is
    sequential and a Neumann series cancels badly in float32.
    """
    size = m_cc.shape[-1]
    assert size & (size - 1) == 0, f"chunk size {size} must be a power of two"
    lead = m_cc.shape[:-2]
    inverse = jnp.ones((*lead, size, 1, 1), m_cc.dtype)  # the 1 x 1 diagonal blocks
    block = 1
    while block < size:
        pairs = size // (2 * block)
        tiles = m_cc.reshape(*lead, pairs, 2 * block, pairs, 2 * block)
        diagonal = jnp.moveaxis(jnp.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)  # (..., pairs, 2s, 2s)
        below = diagonal[..., block:, :block]
        halves = inverse.reshape(*lead, pairs, 2, block, block)
        upper_inv, lower_inv = halves[..., 0, :, :], halves[..., 1, :, :]
        corner = -(lower_inv @ below @ upper_inv)
        inverse = jnp.concatenate(
            [
                jnp.concatenate([upper_inv, jnp.zeros_like(upper_inv)], axis=-1),
                jnp.concatenate([corner, lower_inv], axis=-1),
            ],
            axis=-2,
        )
        block *= 2
    return inverse[..., 0, :, :]


def gated_delta_chunked(
    q_bthk: jax.Array,
    k_bthk: jax.Array,
    v_bthv: jax.Array,
    g_bth: jax.Array,
    beta_bth: jax.Array,
    *,
    chunk_size: int = 64,
    state_bhkv: jax.Array | None = None,
    qk_l2norm: bool = True,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The chunked parallel form (training, prefill): same result as `gated_delta_scan`.

    `segment_ids_bt` (packed rows): no token reads another document's writes. Within a chunk
    the decays between tokens of different documents are zero; a token reads the state
    carried into its chunk only if no document starts between the chunk's start and it, and
    the state leaves the chunk decayed only if none starts in the chunk, plus the writes of
    the chunk's last document."""
    q, k, v, g, beta = _prepare(q_bthk, k_bthk, v_bthv, g_bth, beta_bth, qk_l2norm)
    batch, time, heads, _ = q.shape
    state = _zero_state(q, v) if state_bhkv is None else state_bhkv.astype(jnp.float32)
    pad = -time % chunk_size
    chunks = (time + pad) // chunk_size

    def to_chunks(x):  # (b, t, h, ...) -> (n, b, h, C, ...), zero-padded: g=0, beta=0, k=0 keep the state
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, chunks, chunk_size, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

    q, k, v, g, beta = (to_chunks(x) for x in (q, k, v, g, beta))  # q: (n, b, h, C, k), g: (n, b, h, C)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    # decay_ij = prod of exp(g) over (j, i] for j <= i, else 0: exponents are <= 0, nothing overflows.
    cum_decay = jnp.cumsum(g, axis=-1)
    lower = jnp.tril(jnp.ones((chunk_size, chunk_size), bool))
    decay_from_start, decay_to_end = jnp.exp(cum_decay), jnp.exp(cum_decay[..., -1:] - cum_decay)
    chunk_decay = jnp.exp(cum_decay[..., -1])
    if segment_ids_bt is not None:  # (n, b, 1, C): the padding continues the last document
        segments = jnp.pad(segment_ids_bt, [(0, 0), (0, pad)], mode="edge").reshape(batch, chunks, 1, chunk_size)
        segments = jnp.moveaxis(segments, 1, 0)
        before = jnp.concatenate([segments[:1, ..., :1], segments[:-1, ..., -1:]])  # the token before each chunk
        lower = lower & (segments[..., :, None] == segments[..., None, :])
        continues = segments == before  # no document starts between the chunk's start and the token
        decay_from_start = jnp.where(continues, decay_from_start, 0.0)
        decay_to_end = jnp.where(segments == segments[..., -1:], decay_to_end, 0.0)  # the chunk's last document
        chunk_decay = jnp.where(continues[..., -1], chunk_decay, 0.0)
    decay_cc = jnp.exp(jnp.where(lower, cum_decay[..., :, None] - cum_decay[..., None, :], -jnp.inf))

    # UT transform: (I + strictly_lower(beta k k^T * decay)) [u, w] = [beta v, beta k exp(cum)].
    ut_system = jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay_cc
    rhs = jnp.concatenate([v_beta, k_beta * decay_from_start[..., None]], axis=-1)
    solved = _unit_lower_inverse(ut_system) @ rhs
    new_values, k_cumdecay = solved[..., : v.shape[-1]], solved[..., v.shape[-1] :]
    intra_cc = jnp.einsum("...ik,...jk->...ij", q, k) * decay_cc
    q_decayed = q * decay_from_start[..., None]
    k_to_end = k * decay_to_end[..., None]
    chunk_decay = chunk_decay[..., None, None]  # (n, b, h, 1, 1)

    def chunk_step(state_bhkv, chunk):
        new_v, k_cum, q_dec, intra, k_end, decay = chunk
        v_corrected = new_v - k_cum @ state_bhkv  # what the state does not already predict
        out = q_dec @ state_bhkv + intra @ v_corrected
        state_bhkv = state_bhkv * decay + jnp.swapaxes(k_end, -1, -2) @ v_corrected
        return state_bhkv, out

    state, out_nbhcv = jax.lax.scan(
        chunk_step, state, (new_values, k_cumdecay, q_decayed, intra_cc, k_to_end, chunk_decay)
    )
    out_bthv = jnp.moveaxis(jnp.moveaxis(out_nbhcv, 0, 1), 3, 2).reshape(batch, chunks * chunk_size, heads, -1)
    return out_bthv[:, :time].astype(q_bthk.dtype), state


def gated_deltanet(
    params: Params,
    x_btd: jax.Array,
    dims: GatedDeltaDims,
    *,
    state: GatedDeltaState | None = None,
    mask_bt: jax.Array | None = None,
    form: Literal["chunked", "scan"] = "chunked",
    chunk_size: int = 64,
) -> tuple[jax.Array, GatedDeltaState]:
    """The Gated DeltaNet mixer: (output (b, t, d), state after x).

    params (Qwen3.5's projection layout; `split_qwen3_next_projections` turns Qwen3-Next's
    fused, per-key-head interleaved ones into it):
      w_qkv (d, 2 hk k + hv v), w_z (d, hv v), w_b (d, hv), w_a (d, hv), conv_kc (K, c),
      a_log (hv,), dt_bias (hv,), norm (v,), w_out (hv v, d).
    `mask_bt` (1 = token, 0 = padding) zeroes padded inputs as transformers does. With t = 1
    and a state the token goes through the single-step form.
    """
    if mask_bt is not None:
        x_btd = x_btd * mask_bt[..., None].astype(x_btd.dtype)
    batch, time, _ = x_btd.shape
    hk, hv, dk, dv = dims.num_key_heads, dims.num_value_heads, dims.key_head_dim, dims.value_head_dim
    qkv_btc, conv_window = causal_conv1d(
        x_btd @ params["w_qkv"], params["conv_kc"], window_bkc=None if state is None else state.conv_bkc
    )
    q = qkv_btc[..., : hk * dk].reshape(batch, time, hk, dk)
    k = qkv_btc[..., hk * dk : 2 * hk * dk].reshape(batch, time, hk, dk)
    v = qkv_btc[..., 2 * hk * dk :].reshape(batch, time, hv, dv)
    g, beta = decay_and_beta(x_btd @ params["w_a"], x_btd @ params["w_b"], params["a_log"], params["dt_bias"])
    recurrent = None if state is None else state.recurrent_bhkv
    if time == 1 and recurrent is not None:
        out, recurrent = gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent)
        out_bthv = out[:, None]
    elif form == "scan":
        out_bthv, recurrent = gated_delta_scan(q, k, v, g, beta, state_bhkv=recurrent)
    else:
        out_bthv, recurrent = gated_delta_chunked(q, k, v, g, beta, state_bhkv=recurrent, chunk_size=chunk_size)
    z_bthv = (x_btd @ params["w_z"]).reshape(batch, time, hv, dv)
    out_bthv = gated_rms_norm(out_bthv, z_bthv, params["norm"], eps=dims.norm_eps, norm_before_gate=True)
    return out_bthv.reshape(batch, time, hv * dv) @ params["w_out"], GatedDeltaState(conv_window, recurrent)


def split_qwen3_next_projections(w_qkvz_dp: jax.Array, w_ba_dp: jax.Array, dims: GatedDeltaDims) -> Params:
    """Qwen3-Next's in_proj_qkvz / in_proj_ba (transposed to (d, out)), whose outputs are
    grouped per key head ([q k v z] of each, [b a] of each), as Qwen3.5's separate w_qkv, w_z,
    w_b, w_a."""
    hk, hv, dk, dv = dims.num_key_heads, dims.num_value_heads, dims.key_head_dim, dims.value_head_dim
    group = hv // hk
    d = w_qkvz_dp.shape[0]
    qkvz = w_qkvz_dp.reshape(d, hk, 2 * dk + 2 * group * dv)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v, z = qkvz[..., 2 * dk : 2 * dk + group * dv], qkvz[..., 2 * dk + group * dv :]
    ba = w_ba_dp.reshape(d, hk, 2 * group)
    flat = [x.reshape(d, -1) for x in (q, k, v, z, ba[..., :group], ba[..., group:])]
    return {
        "w_qkv": jnp.concatenate(flat[:3], axis=-1),
        "w_z": flat[3],
        "w_b": flat[4],
        "w_a": flat[5],
    }

"""Mamba2's selective state space layer and its SSD ("state space duality", Dao & Gu 2024)
chunked scan, as transformers 5.25 defines them (modeling_mamba2: `mamba2_chunk_scan`,
`mamba2_selective_state_update`, `Mamba2Mixer.forward`; Nemotron-H's and Granite 4's Mamba2
layers are the same code).

Per head the state S (head_dim x state_size) evolves token by token as

    S <- exp(dt_t A) S + dt_t x_t B_t^T;   y_t = S C_t + D x_t

with A = -exp(A_log) < 0, dt_t = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max), and B, C
shared by the heads of a group. Three forms compute it:

- `ssd_chunked`, for training: inside each chunk of C tokens the output is a masked
  "attention" (C B^T weighted by the decays) plus the contribution of the chunk's start state;
  the start states come from a lax.scan over chunks. Work is linear in t; padding uses x = 0
  and dt A = 0, which leaves the state untouched.
- `ssd_step`, for decoding: one token, carrying S.
- `ssd_scan`, the per-token lax.scan of that step: the tests' reference.

`mamba2_mixer` is the whole layer (in_proj, causal conv1d, the scan, gated RMSNorm, out_proj)
on a plain parameter dict, decoding included through `Mamba2State`. One deliberate difference:
transformers' single-token decode skips time_step_limit's clamp; here every form clamps, so
decoding equals the full forward. The default limits, (0, inf) in Mamba2Config, NemotronHConfig,
GraniteMoeHybridConfig and FalconH1Config, make the clamp a no-op; only a checkpoint that sets
narrower ones decodes differently in transformers.
Shapes: b batch, t time, h heads, p head dim, g groups, n state size, d model width.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from engine.ops.linear_mixing import causal_conv1d, gated_rms_norm, repeat_heads

Params = dict[str, jax.Array]


class Mamba2Dims(NamedTuple):
    """A Mamba2 layer's sizes (Mamba2Config's fields)."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    norm_eps: float = 1e-6
    dt_min: float = 0.0  # time_step_limit
    dt_max: float = float("inf")
    norm_before_gate: bool = False  # the gated norm's order (Falcon-H1's mamba_norm_before_gate)

    @property
    def inner(self) -> int:
        """The SSM's width: heads x head_dim (transformers' intermediate_size)."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: x, B and C side by side."""
        return self.inner + 2 * self.n_groups * self.state_size


class Mamba2State(NamedTuple):
    """What decoding carries per sequence instead of a KV cache."""

    conv_bkc: jax.Array  # (b, conv_kernel - 1, conv_channels)
    ssm_bhpn: jax.Array  # (b, heads, head_dim, state_size), float32


def initial_state(batch: int, dims: Mamba2Dims, dtype: jnp.dtype = jnp.float32) -> Mamba2State:
    """The state before the first token: zeros."""
    return Mamba2State(
        jnp.zeros((batch, dims.conv_kernel - 1, dims.conv_channels), dtype),
        jnp.zeros((batch, dims.num_heads, dims.head_dim, dims.state_size), jnp.float32),
    )


def discretize_dt(
    dt_bth: jax.Array, dt_bias_h: jax.Array, dt_min: float = 0.0, dt_max: float = float("inf")
) -> jax.Array:
    """The step size: clamp(softplus(dt + dt_bias), dt_min, dt_max), float32."""
    return jnp.clip(jax.nn.softplus(dt_bth.astype(jnp.float32) + dt_bias_h), dt_min, dt_max)


def _segment_sum(x_lc: jax.Array) -> jax.Array:
    """out[..., i, j] = sum of x[..., j+1 : i+1] for j <= i, -inf above the diagonal; summed
    by a masked cumsum rather than a difference of cumsums, as transformers does, for accuracy."""
    size = x_lc.shape[-1]
    repeated = jnp.broadcast_to(x_lc[..., :, None], (*x_lc.shape, size))  # [..., i, j] = x[i]
    repeated = jnp.where(jnp.tril(jnp.ones((size, size), bool), -1), repeated, 0.0)
    summed = jnp.cumsum(repeated, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((size, size), bool)), summed, -jnp.inf)


def _ssd_step(state_bhpn, token):
    """One token on prepared inputs: x (b,h,p), dt (b,h), A (h,), B, C (b,h,n), D (h,)."""
    x_bhp, dt_bh, a_h, b_bhn, c_bhn, d_h = token
    state_bhpn = state_bhpn * jnp.exp(dt_bh * a_h)[..., None, None]
    state_bhpn = state_bhpn + (dt_bh[..., None] * x_bhp)[..., None] * b_bhn[:, :, None, :]
    y_bhp = jnp.einsum("bhpn,bhn->bhp", state_bhpn, c_bhn) + x_bhp * d_h[:, None]
    return state_bhpn, y_bhp


def _prepare(x_bthp, b_btgn, c_btgn):
    heads = x_bthp.shape[2]
    return (
        x_bthp.astype(jnp.float32),
        repeat_heads(b_btgn.astype(jnp.float32), heads),
        repeat_heads(c_btgn.astype(jnp.float32), heads),
    )


def _zeros_like_state(x_bthp, b_bthn):
    return jnp.zeros((x_bthp.shape[0], x_bthp.shape[2], x_bthp.shape[3], b_bthn.shape[3]), jnp.float32)


def ssd_step(
    x_bhp: jax.Array,
    dt_bh: jax.Array,
    a_h: jax.Array,
    b_bgn: jax.Array,
    c_bgn: jax.Array,
    state_bhpn: jax.Array,
    *,
    d_h: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """One decoded token (dt already discretized): (output (b, h, p) in x's dtype, next state)."""
    x, b, c = _prepare(x_bhp[:, None], b_bgn[:, None], c_bgn[:, None])
    d_h = jnp.zeros(x.shape[2], jnp.float32) if d_h is None else d_h
    state, y_bhp = _ssd_step(state_bhpn.astype(jnp.float32), (x[:, 0], dt_bh, a_h, b[:, 0], c[:, 0], d_h))
    return y_bhp.astype(x_bhp.dtype), state


def ssd_scan(
    x_bthp: jax.Array,
    dt_bth: jax.Array,
    a_h: jax.Array,
    b_btgn: jax.Array,
    c_btgn: jax.Array,
    *,
    d_h: jax.Array | None = None,
    state_bhpn: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The per-token recurrence (a lax.scan over t): (output (b, t, h, p), final state).
    `segment_ids_bt` (packed rows): the state restarts from zero where the id changes."""
    x, b, c = _prepare(x_bthp, b_btgn, c_btgn)
    state = _zeros_like_state(x, b) if state_bhpn is None else state_bhpn.astype(jnp.float32)
    d_h = jnp.zeros(x.shape[2], jnp.float32) if d_h is None else d_h
    if segment_ids_bt is None:
        segment_ids_bt = jnp.zeros(x.shape[:2], jnp.int32)
    keep_bt = jnp.concatenate(
        [jnp.ones_like(segment_ids_bt[:, :1], bool), segment_ids_bt[:, 1:] == segment_ids_bt[:, :-1]], 1
    )

    def step(state, token):
        x_bhp, dt_bh, b_bhn, c_bhn, keep_b = token
        state = jnp.where(keep_b[:, None, None, None], state, 0.0)
        return _ssd_step(state, (x_bhp, dt_bh, a_h, b_bhn, c_bhn, d_h))

    time_major = tuple(jnp.moveaxis(v, 1, 0) for v in (x, dt_bth.astype(jnp.float32), b, c, keep_bt))
    state, y_tbhp = jax.lax.scan(step, state, time_major)
    return jnp.moveaxis(y_tbhp, 0, 1).astype(x_bthp.dtype), state


def ssd_chunked(
    x_bthp: jax.Array,
    dt_bth: jax.Array,
    a_h: jax.Array,
    b_btgn: jax.Array,
    c_btgn: jax.Array,
    *,
    chunk_size: int = 256,
    d_h: jax.Array | None = None,
    state_bhpn: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The SSD chunked form (training, prefill): same result as `ssd_scan`. With
    `segment_ids_bt` (packed rows) no state crosses a change of id: the terms between
    positions of different documents are masked out (a mask, not an infinite decay, whose
    cumulative sums would lose the small decays' precision)."""
    x, b, c = _prepare(x_bthp, b_btgn, c_btgn)
    batch, time, heads, head_dim = x.shape
    state = _zeros_like_state(x, b) if state_bhpn is None else state_bhpn.astype(jnp.float32)
    dt = dt_bth.astype(jnp.float32)
    skip = 0.0 if d_h is None else x * d_h[:, None]
    x_dt, a_dt = x * dt[..., None], a_h * dt  # discretized input and log decay (<= 0)
    pad = -time % chunk_size
    chunks = (time + pad) // chunk_size

    def to_chunks(v):  # (b, t, ...) -> (b, n, C, ...), zero-padded
        v = jnp.pad(v, [(0, 0), (0, pad)] + [(0, 0)] * (v.ndim - 2))
        return v.reshape(batch, chunks, chunk_size, *v.shape[2:])

    x_dt, b, c = to_chunks(x_dt), to_chunks(b), to_chunks(c)  # (b, n, C, h, p|n)
    a_bhnc = jnp.moveaxis(to_chunks(a_dt), 3, 1)  # (b, h, n, C)
    a_cum = jnp.cumsum(a_bhnc, axis=-1)

    # 1. Within a chunk: y_l = sum_{s <= l} (C_l . B_s) exp(sum a over (s, l]) x_s dt_s.
    decay_bhnls = jnp.exp(_segment_sum(a_bhnc))
    decay_to_end = jnp.exp(a_cum[..., -1:] - a_cum)  # (b, h, n, C)
    chunk_decay_bhn, start_decay_bhnc = jnp.exp(a_cum[..., -1]), jnp.exp(a_cum)
    if segment_ids_bt is not None:  # padded with the last id, which the padding's x = 0 leaves inert
        seg_bnc = jnp.pad(segment_ids_bt, [(0, 0), (0, pad)], mode="edge").reshape(batch, chunks, chunk_size)
        last_bn = seg_bnc[..., -1]
        before_bn = jnp.concatenate([seg_bnc[:, :1, 0], last_bn[:, :-1]], axis=1)  # the id before each chunk
        decay_bhnls = decay_bhnls * (seg_bnc[..., :, None] == seg_bnc[..., None, :])[:, None]
        decay_to_end = decay_to_end * (seg_bnc == last_bn[..., None])[:, None]
        chunk_decay_bhn = chunk_decay_bhn * (last_bn == before_bn)[:, None]
        start_decay_bhnc = start_decay_bhnc * (seg_bnc == before_bn[..., None])[:, None]
    scores = jnp.einsum("bclhn,bcshn->bhcls", c, b) * decay_bhnls
    y_diag = jnp.einsum("bhcls,bcshp->bclhp", scores, x_dt)

    # 2. Each chunk's own contribution to the state at its end.
    chunk_states = jnp.einsum("bclhn,bhcl,bclhp->cbhpn", b, decay_to_end, x_dt)

    # 3. The state at each chunk's start: a scan over chunks (linear in their number).
    def carry(state_bhpn, chunk):
        contribution, decay_bh = chunk
        return state_bhpn * decay_bh[..., None, None] + contribution, state_bhpn

    state, start_states = jax.lax.scan(carry, state, (chunk_states, jnp.moveaxis(chunk_decay_bhn, 2, 0)))

    # 4. The start state read out through C, decayed to each position.
    y_off = jnp.einsum("bclhn,cbhpn,bhcl->bclhp", c, start_states, start_decay_bhnc)
    y = (y_diag + y_off).reshape(batch, chunks * chunk_size, heads, head_dim)[:, :time] + skip
    return y.astype(x_bthp.dtype), state


def mamba2_mixer(
    params: Params,
    x_btd: jax.Array,
    dims: Mamba2Dims,
    *,
    state: Mamba2State | None = None,
    mask_bt: jax.Array | None = None,
    form: Literal["chunked", "scan"] = "chunked",
    chunk_size: int = 256,
) -> tuple[jax.Array, Mamba2State]:
    """The Mamba2 mixer: (output (b, t, d), state after x).

    params: w_in (d, inner + conv_channels + heads) = transformers' in_proj.weight.T (columns:
    gate z, then x B C, then dt), b_in (optional), conv_kc (K, conv_channels), conv_bias
    (optional), dt_bias, a_log, d (heads,), norm (inner,), w_out (inner, d), b_out (optional).
    `mask_bt` (1 = token, 0 = padding) zeroes padded positions before in_proj and after the
    convolution, as transformers does. With t = 1 and a state the token takes the step form.
    """
    if mask_bt is not None:
        x_btd = x_btd * mask_bt[..., None].astype(x_btd.dtype)
    projected = x_btd @ params["w_in"]
    if "b_in" in params:
        projected = projected + params["b_in"]
    y_btf, state = mamba2_inner(params, projected, dims, state=state, mask_bt=mask_bt, form=form, chunk_size=chunk_size)
    out = y_btf @ params["w_out"]
    if "b_out" in params:
        out = out + params["b_out"]
    return out, state


def mamba2_inner(
    params: Params,
    projected_btp: jax.Array,
    dims: Mamba2Dims,
    *,
    state: Mamba2State | None = None,
    mask_bt: jax.Array | None = None,
    form: Literal["chunked", "scan"] = "chunked",
    chunk_size: int = 256,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, Mamba2State]:
    """The mixer between its two projections: in_proj's output (b, t, inner + conv_channels +
    heads) -> the gated-normed scan output (b, t, inner), and the state after it. Uses params'
    conv_kc, conv_bias (optional), dt_bias, a_log, d and norm (optional: without it y * silu(z)).
    `segment_ids_bt`: packed rows, each document's convolution and state starting afresh (ssd_chunked)."""
    groups, size = dims.n_groups, dims.state_size
    gate = projected_btp[..., : dims.inner]
    xbc_btc, conv_window = causal_conv1d(
        projected_btp[..., dims.inner : dims.inner + dims.conv_channels],
        params["conv_kc"],
        params.get("conv_bias"),
        window_bkc=None if state is None else state.conv_bkc,
        segment_ids_bt=segment_ids_bt,
    )
    if mask_bt is not None:
        xbc_btc = xbc_btc * mask_bt[..., None].astype(xbc_btc.dtype)
    state_width = groups * size
    y_btf, ssm = mamba2_scan(
        params,
        gate,
        xbc_btc[..., : dims.inner],
        xbc_btc[..., dims.inner : dims.inner + state_width],
        xbc_btc[..., dims.inner + state_width :],
        projected_btp[..., dims.inner + dims.conv_channels :],
        dims,
        ssm_bhpn=None if state is None else state.ssm_bhpn,
        form=form,
        chunk_size=chunk_size,
        segment_ids_bt=segment_ids_bt,
    )
    return y_btf, Mamba2State(conv_window, ssm)


def mamba2_scan(
    params: Params,
    gate_btf: jax.Array,
    x_btf: jax.Array,
    b_bts: jax.Array,
    c_bts: jax.Array,
    dt_bth: jax.Array,
    dims: Mamba2Dims,
    *,
    ssm_bhpn: jax.Array | None = None,
    form: Literal["chunked", "scan"] = "chunked",
    chunk_size: int = 256,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The mixer after its convolution: x (b, t, inner), B and C (b, t, groups x state_size) as
    the convolution left them, in_proj's gate z (b, t, inner) and raw dt (b, t, heads) -> (the
    gated-normed scan output (b, t, inner), the SSM state after it). Each head reads only its own
    slices of x, z, dt and its group's B and C, which is what lets a tensor axis split heads
    (engine/models/mamba2.py)."""
    batch, time, _ = x_btf.shape
    heads, head_dim, groups, size = dims.num_heads, dims.head_dim, dims.n_groups, dims.state_size
    x = x_btf.reshape(batch, time, heads, head_dim)
    b = b_bts.reshape(batch, time, groups, size)
    c = c_bts.reshape(batch, time, groups, size)
    dt = discretize_dt(dt_bth, params["dt_bias"], dims.dt_min, dims.dt_max)
    a_h = -jnp.exp(params["a_log"].astype(jnp.float32))
    d_h = params["d"].astype(jnp.float32)
    ssm = ssm_bhpn
    if time == 1 and ssm is not None:
        y, ssm = ssd_step(x[:, 0], dt[:, 0], a_h, b[:, 0], c[:, 0], ssm, d_h=d_h)
        y_bthp = y[:, None]
    elif form == "scan":
        y_bthp, ssm = ssd_scan(x, dt, a_h, b, c, d_h=d_h, state_bhpn=ssm, segment_ids_bt=segment_ids_bt)
    else:
        y_bthp, ssm = ssd_chunked(
            x, dt, a_h, b, c, d_h=d_h, state_bhpn=ssm, chunk_size=chunk_size, segment_ids_bt=segment_ids_bt
        )
    y_btf = y_bthp.reshape(batch, time, dims.inner)
    if "norm" not in params:  # no gated norm (Falcon-H1's mamba_rms_norm false): y * silu(z)
        y_btf = (y_btf.astype(jnp.float32) * jax.nn.silu(gate_btf.astype(jnp.float32))).astype(y_btf.dtype)
        return y_btf, ssm
    y_btf = gated_rms_norm(
        y_btf,
        gate_btf,
        params["norm"],
        eps=dims.norm_eps,
        norm_before_gate=dims.norm_before_gate,
        group_size=dims.inner // groups,
    )
    return y_btf, ssm

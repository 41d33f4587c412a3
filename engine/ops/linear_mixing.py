"""Pieces shared by the linear-time sequence mixers (Gated DeltaNet in gated_delta.py, Mamba2's
SSD in ssd.py): the short causal depthwise convolution with its decoding window, the gated
RMSNorm of the mixer output, and the L2 normalisation of queries and keys.

Each follows the torch code of transformers 5.25 (qwen3_next, mamba2) operation for operation,
casts included, so that a float32 forward matches it to rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv1d(
    x_btc: jax.Array,
    weight_kc: jax.Array,
    bias_c: jax.Array | None = None,
    *,
    window_bkc: jax.Array | None = None,
    activation: bool = True,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution over time, then SiLU: y[t] = sum_j w[j] x[t - (K-1) + j].

    `window_bkc` holds the K-1 inputs before x (zeros at the start of a sequence); the result's
    second item is the window after x, so a prompt's forward followed by one call per decoded
    token (t = 1) gives the same outputs as one forward over everything. `weight_kc` is the
    transpose of torch's depthwise Conv1d weight[:, 0, :] (kernel tap first, channel last).
    `segment_ids_bt` (packed rows): a tap reads only inputs of its output's own document (the
    window counts as the first token's).
    """
    taps = weight_kc.shape[0]
    batch, time, channels = x_btc.shape
    if window_bkc is None:
        window_bkc = jnp.zeros((batch, taps - 1, channels), x_btc.dtype)
    padded = jnp.concatenate([window_bkc.astype(x_btc.dtype), x_btc], axis=1)  # (b, K-1+t, c)
    if segment_ids_bt is not None:
        segments = jnp.concatenate([jnp.repeat(segment_ids_bt[:, :1], taps - 1, axis=1), segment_ids_bt], axis=1)

    def tap(j):
        x_j = padded[:, j : j + time]
        if segment_ids_bt is not None:
            x_j = jnp.where((segments[:, j : j + time] == segment_ids_bt)[..., None], x_j, 0)
        return x_j * weight_kc[j]

    y_btc = tap(0)
    for j in range(1, taps):
        y_btc = y_btc + tap(j)
    if bias_c is not None:
        y_btc = y_btc + bias_c
    if activation:
        y_btc = jax.nn.silu(y_btc)
    return y_btc.astype(x_btc.dtype), padded[:, padded.shape[1] - (taps - 1) :]


def gated_rms_norm(
    x: jax.Array,
    gate: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    norm_before_gate: bool,
    group_size: int | None = None,
) -> jax.Array:
    """RMSNorm of x gated by SiLU(gate), over groups of `group_size` trailing features (all of
    them when None). `norm_before_gate`: Qwen3-Next's weight * norm(x) * silu(gate); otherwise
    Mamba2's weight * norm(x * silu(gate)), whose group count is its n_groups."""
    input_dtype = x.dtype
    hidden = x.astype(jnp.float32)
    if not norm_before_gate:
        hidden = hidden * jax.nn.silu(gate.astype(jnp.float32))
    features = hidden.shape[-1]
    group_size = group_size or features
    grouped = hidden.reshape(*hidden.shape[:-1], features // group_size, group_size)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    hidden = weight * grouped.reshape(hidden.shape).astype(input_dtype)
    if norm_before_gate:
        hidden = hidden * jax.nn.silu(gate.astype(jnp.float32))
    return hidden.astype(input_dtype)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(|x|^2 + eps) over the last axis, as the FLA kernels (and transformers) do."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def repeat_heads(x_bthd: jax.Array, num_heads: int) -> jax.Array:
    """Grouped heads: head i of the result is head i // (num_heads // h) of x (repeat_interleave)."""
    return jnp.repeat(x_bthd, num_heads // x_bthd.shape[2], axis=2)

"""Rotary position embeddings: the rotation frequencies (plain, Llama 3, linear, YaRN and
LongRoPE scaling) and their application to queries and keys, shared by grouped-query attention
(transformer.py) and multi-head latent attention (mla.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from engine.models.config import RopeScaling
from engine.models.specs import RotarySpec


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None, positions_bt: jax.Array | None = None
) -> jax.Array:
    """Per-pair rotation frequencies; Llama-3 scaling stretches the low frequencies. LongRoPE's
    depend on the sequence's length, read from `positions_bt` (None: the short ones)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "longrope":
        return _longrope_inverse_frequencies(inv_freq, scaling, positions_bt)
    if scaling.kind == "dynamic":
        return _dynamic_inverse_frequencies(inv_freq, head_dim, theta, scaling, positions_bt)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    if scaling.kind == "proportional":  # the fastest pairs rotate, the rest (frequency 0) do not
        rotated = int(scaling.rotated_fraction * head_dim // 2)
        return jnp.where(jnp.arange(head_dim // 2) < rotated, inv_freq, 0.0) / scaling.factor
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(medium, (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq, scaled)


def _yarn_inverse_frequencies(inv_freq, head_dim: int, theta: float, scaling: RopeScaling):
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    divided by `factor` (interpolated), those turning more than beta_fast times kept, and a
    linear ramp over the dimensions between (transformers' _compute_yarn_parameters)."""

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return head_dim * math.log(scaling.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return inv_freq / scaling.factor * (1 - keep) + inv_freq * keep


def _longrope_inverse_frequencies(inv_freq, scaling: RopeScaling, positions_bt):
    """LongRoPE (transformers' _compute_longrope_parameters and longrope_frequency_update): each
    frequency divided by its short factor, or by its long factor once the sequence is longer
    than original_max_position. As transformers, the length is the largest position in the
    call plus one, one choice for the whole batch (a traced choice, so no recompile)."""
    assert scaling.short_factor is not None and scaling.long_factor is not None
    assert len(scaling.short_factor) == inv_freq.shape[0], "one short and long factor per rotated pair"
    short = inv_freq / jnp.asarray(scaling.short_factor, jnp.float32)
    if positions_bt is None:
        return short
    long = inv_freq / jnp.asarray(scaling.long_factor, jnp.float32)
    return jnp.where(jnp.max(positions_bt) + 1 > scaling.original_max_position, long, short)


def _dynamic_inverse_frequencies(inv_freq, head_dim: int, theta: float, scaling: RopeScaling, positions_bt):
    """Dynamic NTK (transformers' _compute_dynamic_ntk_parameters, in float32 as it computes
    them): past original_max_position the base grows with the sequence's length, the largest
    position in the call plus one, one choice for the whole batch (traced, so no recompile).
    transformers keeps the longest length it has seen until a call within the original context
    resets it; here each call's own length counts (the same whenever lengths only grow, as in
    one generation, or a call is within the original context)."""
    if positions_bt is None:
        return inv_freq
    original = scaling.original_max_position
    length = jnp.maximum(jnp.max(positions_bt).astype(jnp.int32) + 1, original).astype(jnp.float32)
    stretch = (scaling.factor * length / original - (scaling.factor - 1)) ** (head_dim / (head_dim - 2))
    base = theta * stretch
    return 1.0 / (base ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def rope_cos_sin(positions_bt, inv_freq_h2, scale: float = 1.0, max_position: int | None = None):
    """(cos, sin), each (b, t, 1, head_dim / 2), of the rotation at `positions_bt`, times
    `scale` (YaRN's attention factor).

    `max_position` (static): every position is below it (the models pass the row's length t,
    or while decoding the KV cache's length; a position at or past it gets NaN), and cos
    and sin are looked up in a (max_position, head_dim / 2) table, the same numbers. XLA
    fuses the cos and sin of the direct form (max_position None) into each rotation,
    computing them again for every head of q and k in every layer, forward and backward: in
    a bf16 GRPO rollout on CPU the table cut the decode loop's busy time to ~0.78x, and in
    the bf16 training step at the benchmark shape it took 24 fusions of ~7-10 ms each out of
    the step (bench/profile_sample.py, bench/profile_step.py, docs/benchmarks.md)."""
    if max_position is not None:
        angles_ph2 = jnp.arange(max_position, dtype=jnp.float32)[:, None] * inv_freq_h2
        cos = jnp.take(jnp.cos(angles_ph2), positions_bt, axis=0)[:, :, None, :]
        sin = jnp.take(jnp.sin(angles_ph2), positions_bt, axis=0)[:, :, None, :]
    else:
        angles_bth2 = positions_bt[..., None].astype(jnp.float32) * inv_freq_h2
        cos = jnp.cos(angles_bth2)[:, :, None, :]
        sin = jnp.sin(angles_bth2)[:, :, None, :]
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def rotate(x_btnh, cos_bt1h2, sin_bt1h2):
    """Rotate (first half, second half) pairs, the convention of HF Llama checkpoints."""
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos_bt1h2 - x2 * sin_bt1h2, x2 * cos_bt1h2 + x1 * sin_bt1h2], axis=-1)
    return rotated.astype(x_btnh.dtype)


def apply_rope(x_btnh, positions_bt, inv_freq_h2, scale: float = 1.0, max_position: int | None = None):
    """`x` rotated at `positions_bt` (rope_cos_sin, then rotate)."""
    return rotate(x_btnh, *rope_cos_sin(positions_bt, inv_freq_h2, scale, max_position))


def layer_rotary(positions_bt, rope: RotarySpec, head_dim: int, max_position: int | None = None):
    """(cos, sin) at `positions_bt` for a layer rotating as its RotarySpec says (its rotary part
    of head_dim; YaRN's and LongRoPE's attention factor on both)."""
    inv_freq = rope_inverse_frequencies(rope.rotary_dim or head_dim, rope.theta, rope.scaling, positions_bt)
    factor = 1.0 if rope.scaling is None else rope.scaling.yarn_attention_factor()
    return rope_cos_sin(positions_bt, inv_freq, factor, max_position)


def rotate_heads(x_btnh, rope: RotarySpec, rotary):
    """RoPE on the first rotary_dim dimensions of each head, the rest passed through. With
    interleave the pairs are (x0, x1), (x2, x3), ...: the half-split rotation of the evens then
    the odds, a reordering of head_dim that queries and keys share (mla.py)."""
    h = x_btnh.shape[-1]
    r = rope.rotary_dim or h
    if rope.interleave:
        x_btnh = jnp.concatenate([x_btnh[..., 0:r:2], x_btnh[..., 1:r:2], x_btnh[..., r:]], axis=-1)
    if r == h:
        return rotate(x_btnh, *rotary)
    return jnp.concatenate([rotate(x_btnh[..., :r], *rotary), x_btnh[..., r:]], axis=-1)

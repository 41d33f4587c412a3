"""Falcon-H1's parallel hybrid mixer (transformers' FalconH1DecoderLayer): attention and a
Mamba2 mixer read the same normed input side by side, each scaled by its muP multipliers, and
their outputs are summed into one residual update:

    out = ssm_out * mamba2(ssm_in * x) + attention_out * attention(attention_in * x)

The layer kind is `attention_mamba2` (ModelConfig.mixer_pattern). Decoding keeps both the
attention's keys and values and the Mamba2 state for the layer (kv_cache.KEYS_AND_STATE); the
two sub-mixers read and write the same layer's slots of the cache.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from engine.models.kv_cache import KVCache
from engine.models.mamba2 import Mamba2
from engine.models.specs import ParallelHybridSpec


class AttentionMamba2(nnx.Module):
    """Called as transformer.Attention is: (b, t, d) -> (b, t, d), or with a cache (out, cache).
    `attention` is the layer's transformer.Attention (RoPE, its key multiplier), `mamba` its
    Mamba2; both are built by transformer.MIXERS, so this module imports neither's builder."""

    def __init__(self, spec: ParallelHybridSpec, attention: nnx.Module, mamba: Mamba2):
        self.attention, self.mamba = attention, mamba

    def __call__(
        self, x_btd, positions_bt, segment_ids_bt, spec: ParallelHybridSpec, cache: KVCache | None = None, rotary=None
    ):
        dt = x_btd.dtype
        ssm = self.mamba(x_btd * jnp.asarray(spec.ssm_in, dt), positions_bt, segment_ids_bt, spec.mamba2, cache)
        if cache is not None:  # the Mamba2 state advanced, then the attention's keys and values written
            ssm, cache = ssm
        attention = self.attention(
            x_btd * jnp.asarray(spec.attention_in, dt),
            positions_bt,
            segment_ids_bt,
            spec.attention,
            cache,
            rotary=rotary,
        )
        if cache is not None:
            attention, cache = attention
        out_btd = ssm * jnp.asarray(spec.ssm_out, ssm.dtype) + attention * jnp.asarray(spec.attention_out, dt)
        return out_btd if cache is None else (out_btd, cache)

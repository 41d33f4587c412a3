"""Attention in training and prefill: one entry point, `attention`, and an implementation per
platform behind it (`ComputeConfig.attention_impl`).

    reference   the masked softmax over all (t, t) scores (attention_reference.py): the tests' yardstick
    blocked     block-causal with a recomputing backward, laid out for XLA:CPU (attention_blocked.py)
    cudnn       cuDNN flash attention via jax.nn.dot_product_attention, NVIDIA GPUs (attention_cudnn.py)
    splash      the Pallas TPU splash-attention kernel (attention_splash.py)

All compute the same function: causal grouped-query attention over packed documents
(segment ids, 0 = padding), an optional sliding window on local layers and an optional logit
soft-cap and optional attention sinks (GPT-OSS: a learned logit per head that joins the
softmax's denominator). Outputs at padding positions are not specified (nothing reads them).

`auto` picks by the platform being compiled for (partitioning.current_platform): cpu ->
blocked, gpu -> cudnn, tpu -> splash. Where that kernel cannot take the case (cuDNN: a
soft-cap, float32, head_dim, attention sinks; splash: a sequence length that is not a
multiple of 128) auto runs `blocked` instead and warns once per process, naming the reason.
An implementation asked for by name is never swapped: if it cannot run the case, or `cudnn`
is asked for off a GPU, that is a ConfigError. `splash` by name off TPU runs in the Pallas
interpreter (exact, slow: for tests), with a warning.

Decoding with a KV cache attends over the cache through the reference and its explicit mask
(engine/models/kv_cache.py).
"""

from __future__ import annotations

import warnings
from typing import Literal

import jax
import numpy as np

from engine.config import ConfigError
from engine.ops import attention_cudnn, attention_splash
from engine.ops.attention_blocked import blocked_attention
from engine.ops.attention_cudnn import cudnn_attention
from engine.ops.attention_reference import reference_attention
from engine.ops.attention_splash import splash_attention
from engine.ops.partitioning import current_mesh, current_platform

Impl = Literal["auto", "reference", "blocked", "cudnn", "splash"]
AUTO = {"cpu": "blocked", "gpu": "cudnn", "tpu": "splash"}
"""What `auto` picks on each platform (anything else: blocked)."""
FALLBACK = "blocked"

_told: set[str] = set()


def _tell_once(message: str) -> None:
    """Warn about `message` the first time this process meets it."""
    if message not in _told:
        _told.add(message)
        warnings.warn(message, stacklevel=4)


def _device():
    mesh = current_mesh()
    return mesh.devices.flat[0] if mesh is not None else jax.devices()[0]


def _unsupported(impl: str, *, dtype, head_dim: int, seq_len: int, softcap, segmented: bool,
                 sinks: bool = False) -> str | None:
    if sinks and impl == "cudnn":  # jax.nn.dot_product_attention has no sinks argument
        return "cuDNN attention here takes no attention sinks (attention_sinks)"
    if impl == "cudnn":
        return attention_cudnn.unsupported(dtype=dtype, head_dim=head_dim, seq_len=seq_len, softcap=softcap,
                                           segmented=segmented, device=_device())
    if impl == "splash":
        return attention_splash.unsupported(seq_len=seq_len)
    return None


def choose_implementation(impl: Impl, *, platform: str, dtype, head_dim: int, seq_len: int,
                          softcap: float | None = None, segmented: bool = True, sinks: bool = False) -> str:
    """The implementation that runs `impl` on `platform` for this case (see the module docstring)."""
    case = dict(dtype=dtype, head_dim=head_dim, seq_len=seq_len, softcap=softcap, segmented=segmented, sinks=sinks)
    if impl == "auto":
        wanted = AUTO.get(platform, FALLBACK)
        reason = _unsupported(wanted, **case)
        if reason is None:
            return wanted
        _tell_once(f"attention: auto uses {FALLBACK}, not {wanted}, on {platform}: {reason}")
        return FALLBACK
    if impl == "cudnn" and platform != "gpu":
        raise ConfigError(f"compute.attention_impl: cudnn runs on NVIDIA GPUs, and this run compiles for {platform}; "
                          f"use auto ({AUTO.get(platform, FALLBACK)} here) or blocked")
    reason = _unsupported(impl, **case)
    if reason is not None:
        raise ConfigError(f"compute.attention_impl: {impl} cannot run this model: {reason}; "
                          f"use auto (which falls back to {FALLBACK}) or {FALLBACK}")
    if impl == "splash" and platform != "tpu":
        _tell_once(f"attention: splash on {platform} runs in the Pallas interpreter (exact but slow; meant for tests)")
    return impl


def attention(q_btnh, k_bskh, v_bskh, segment_ids_bt=None, *, impl: Impl = "auto", scale: float,
              softcap: float | None = None, window: int | None = None, local: bool = False, block: int = 128,
              sinks_n=None):
    """Causal grouped-query self-attention over packed sequences: (b, t, n, h) in q's dtype.

    q (b, t, n, h); k, v (b, t, k, h) with n a multiple of k; segment_ids_bt (b, t), None for one
    unpadded document per row. A `local` layer sees only the `window` most recent positions,
    its own included. `local`, `window`, `softcap` and `block` (the query block of `blocked`)
    are static. `sinks_n` (n,): attention sinks, a logit per query head in each softmax's
    denominator (GPT-OSS; every implementation but cudnn takes them).
    """
    assert isinstance(local, (bool, np.bool_)), "local must be static (a Python bool)"
    window = window if local else None
    platform = current_platform()
    name = choose_implementation(impl, platform=platform, dtype=q_btnh.dtype, head_dim=q_btnh.shape[3],
                                 seq_len=q_btnh.shape[1], softcap=softcap, segmented=segment_ids_bt is not None,
                                 sinks=sinks_n is not None)
    args = (q_btnh, k_bskh, v_bskh, segment_ids_bt)
    if name == "reference":
        return reference_attention(*args, scale=scale, softcap=softcap, window=window, sinks_n=sinks_n)
    if name == "blocked":
        return blocked_attention(*args, scale=scale, softcap=softcap, window=window, block=block, sinks_n=sinks_n)
    if name == "cudnn":
        return cudnn_attention(*args, scale=scale, window=window)
    return splash_attention(*args, scale=scale, softcap=softcap, window=window, interpret=platform != "tpu",
                            sinks_n=sinks_n)

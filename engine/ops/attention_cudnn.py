"""cuDNN flash attention on NVIDIA GPUs (`cudnn`), through `jax.nn.dot_product_attention`.

cuDNN computes causal and sliding-window attention without the masked blocks and takes
grouped-query heads as they are. What it cannot take (`unsupported` says why, and auto
attention then falls back to `blocked`): a logit soft-cap, float32 inputs, a head_dim that
is not a multiple of 8 up to 128 (256 from Hopper on). Packed segments go in as a boolean
(b, 1, t, t) mask, which cuDNN applies as an additive bias: t * t per row of memory, where
unpacked rows (segment_ids None) need none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)


def max_head_dim(device) -> int:
    """cuDNN's largest head_dim on `device`: 256 from Hopper (compute capability 9.0) on."""
    capability = getattr(device, "compute_capability", None) or "0"
    return 256 if float(capability) >= 9.0 else 128


def unsupported(*, dtype, head_dim: int, seq_len: int, softcap, segmented: bool, device) -> str | None:
    """Why cuDNN cannot take this case (None if it can)."""
    if softcap is not None:
        return "cuDNN attention has no logit soft-cap (attn_logit_softcap)"
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in CUDNN_DTYPES]:
        return f"cuDNN flash attention takes bfloat16 or float16, not {jnp.dtype(dtype).name} (compute.dtype)"
    limit = max_head_dim(device)
    if head_dim % 8 or head_dim > limit:
        return f"cuDNN needs head_dim a multiple of 8 up to {limit} on this GPU, not {head_dim}"
    if segmented and seq_len % 2:
        return f"cuDNN with a mask (packed segments) needs an even sequence length, not {seq_len}"
    return None


def cudnn_attention(
    q_btnh,
    k_bskh,
    v_bskh,
    segment_ids_bt=None,
    *,
    scale: float,
    window: int | None = None,
    implementation: str = "cudnn",
):
    """Causal grouped-query attention with cuDNN; (b, t, n, h) in the dtype of q.

    `implementation="xla"` runs the same call through XLA: the tests check on CPU that the
    arguments given to cuDNN mean what the other implementations compute.
    """
    mask_b1ts = None
    if segment_ids_bt is not None:
        # Padding (segment 0) sees padding, so no row is fully masked; real tokens never see it.
        mask_b1ts = (segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :])[:, None]
    return jax.nn.dot_product_attention(
        q_btnh,
        k_bskh,
        v_bskh,
        mask=mask_b1ts,
        scale=scale,
        is_causal=True,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation,
    )

"""Attention as the textbook says: a masked softmax over every score. The reference the other
implementations are tested against, and what decoding with a KV cache uses.

Shapes: b batch, t query positions, s key positions, n query heads, k kv heads, g query
heads per kv head, h head_dim. Segment id 0 marks padding.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite: a fully masked row (padding) stays finite (uniform), never NaN


def attention_mask(segment_q_bt, segment_k_bs, *, window: int | None = None):
    """(b, t, s): query i sees key j iff j <= i, both carry the same segment id, the key is not
    padding (segment 0) and, with a sliding `window`, i - j < window.

    Causality is by row index (queries are the last t of the s keys), which equals position
    order inside each packed segment.
    """
    t, s = segment_q_bt.shape[1], segment_k_bs.shape[1]
    distance_ts = jnp.arange(t)[:, None] + (s - t) - jnp.arange(s)[None, :]
    visible_ts = distance_ts >= 0
    if window is not None:
        visible_ts = visible_ts & (distance_ts < window)
    same_bts = segment_q_bt[:, :, None] == segment_k_bs[:, None, :]
    valid_bs = (segment_k_bs != 0)[:, None, :]
    return visible_ts[None] & same_bts & valid_bs


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's slope per head (arXiv 2108.12409, as BLOOM and MPT compute them): for n a power
    of two, 2^(-8 i / n), i = 1..n; otherwise those of the largest power of two p below n,
    then every other slope of 2p's, 2^(-4 (2 i - 1) / p), i = 1..n - p."""
    p = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]
    return slopes + [2.0 ** (-4.0 * (2 * i - 1) / p) for i in range(1, num_heads - p + 1)]


def alibi_bias(slopes_n, distance_xs):
    """ALiBi's score bias -slope * distance, (..., k, g, s) for a query head layout (k, g) and
    distances (..., s) query position minus key position: `slopes_n` a sequence or array."""
    slopes = jnp.asarray(slopes_n, jnp.float32)
    return -slopes.reshape(-1)[:, None] * distance_xs[..., None, :].astype(jnp.float32)


def softmax_with_sinks(scores, sinks):
    """softmax over the last axis, with `sinks` (broadcast to scores[..., :1]) as one more
    logit each in the denominator (GPT-OSS's attention sinks); None: the plain softmax."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    sinks = jnp.broadcast_to(sinks.astype(scores.dtype), scores[..., :1].shape)
    return jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]


def dot_product_attention(
    q_btnh, k_bskh, v_bskh, mask_bts, *, scale=None, softcap=None, sinks_n=None, shared=None, alibi=None
):
    """Grouped-query attention over an explicit mask; softmax in float32. Scores are q.k * scale
    (default head_dim**-0.5), optionally soft-capped to (-softcap, softcap) before masking;
    `sinks_n` (per query head) join the softmax's denominator. A decode step (t = 1) may
    also attend to a prefix `shared` by groups of rows (KVCache.shared_prefix), before its
    own keys. `alibi`: (slopes (n,), distances (b or 1, t, s) query minus key position, and
    the shared prefix's (p or 1, prefix) or None): ALiBi's -slope * distance added to the
    scores."""
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    sinks_kg = None if sinks_n is None else sinks_n.astype(jnp.float32).reshape(k, n // k)
    if t == 1:  # a decode step
        return _one_query_attention(
            q_btkgh,
            k_bskh,
            v_bskh,
            mask_bts,
            scale=h**-0.5 if scale is None else scale,
            softcap=softcap,
            sinks_kg=sinks_kg,
            shared=shared,
            alibi=alibi,
        ).reshape(b, t, n, h)
    assert shared is None, "a shared prefix is for decode steps (one query per row)"
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    if alibi is not None:  # (b, t, k, g, s) -> (b, k, g, t, s)
        bias = alibi_bias(alibi[0], alibi[1]).reshape(-1, t, k, n // k, scores.shape[-1])
        scores = scores + bias.transpose(0, 2, 3, 1, 4)
    scores = jnp.where(mask_bts[:, None, None], scores, NEG_INF)
    sinks = None if sinks_kg is None else sinks_kg[None, :, :, None, None]
    probs = softmax_with_sinks(scores, sinks).astype(v_bskh.dtype)
    out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh, preferred_element_type=jnp.float32)
    return out_btkgh.astype(v_bskh.dtype).reshape(b, t, n, h)  # f32 accumulation (engine/ops/dense.py)


def _one_query_attention(
    q_btkgh, k_bskh, v_bskh, mask_bts, *, scale: float, softcap: float | None, sinks_kg=None, shared=None, alibi=None
):
    """One query per row (decoding): two products batched over (b, kv_heads), (g x head_dim) .
    (head_dim x s) and (g x s) . (s x head_dim), in the cache's dtype with f32 accumulation.
    The KV cache (engine/models/kv_cache.py) stores keys head_dim-major and values slot-major,
    so both read their cache operand where it lies: at 256 rows x 96 slots on XLA:CPU
    they took half the time of broadcast products and sums (f32; a third in bf16, where
    those converted every cache element), and a third of what they take on a slot-major
    key cache (bench/profile_sample.py)."""
    f32 = jnp.float32
    q_bkgh = q_btkgh[:, 0].astype(k_bskh.dtype)
    scores_bkgs = jnp.einsum("bkgh,bskh->bkgs", q_bkgh, k_bskh, preferred_element_type=f32)
    mask_bs = mask_bts[:, 0]
    if shared is not None:  # the group's prefix first: one softmax over prefix and own slots
        k_pkhp, v_pkph, mask_pp, group = shared
        to_groups, to_rows = _group_layout(q_bkgh.shape, group)
        shared_bkgp = to_rows(jnp.einsum("pkqh,pkhs->pkqs", to_groups(q_bkgh), k_pkhp, preferred_element_type=f32))
        scores_bkgs = jnp.concatenate([shared_bkgp, scores_bkgs], axis=-1)
        mask_bs = jnp.concatenate([jnp.repeat(mask_pp, group, axis=0), mask_bs], axis=-1)
    scores_bkgs = scores_bkgs * scale
    if softcap is not None:
        scores_bkgs = softcap * jnp.tanh(scores_bkgs / softcap)
    if alibi is not None:
        distance_bs = alibi[1][:, 0]
        if shared is not None:  # the prefix's distances first, as its scores
            prefix_ps = jnp.broadcast_to(alibi[2], (mask_pp.shape[0], alibi[2].shape[-1]))
            own_bs = jnp.broadcast_to(distance_bs, (mask_bts.shape[0], distance_bs.shape[-1]))
            distance_bs = jnp.concatenate([jnp.repeat(prefix_ps, group, axis=0), own_bs], axis=-1)
        k, g = scores_bkgs.shape[1:3]
        scores_bkgs = scores_bkgs + alibi_bias(alibi[0], distance_bs).reshape(-1, k, g, scores_bkgs.shape[-1])
    scores_bkgs = jnp.where(mask_bs[:, None, None], scores_bkgs, NEG_INF)
    probs_bkgs = softmax_with_sinks(scores_bkgs, None if sinks_kg is None else sinks_kg[None, :, :, None])
    probs_bkgs = probs_bkgs.astype(v_bskh.dtype)
    if shared is not None:
        prefix = k_pkhp.shape[-1]
        shared_out_bkgh = to_rows(
            jnp.einsum("pkqs,pksh->pkqh", to_groups(probs_bkgs[..., :prefix]), v_pkph, preferred_element_type=f32)
        )
        probs_bkgs = probs_bkgs[..., prefix:]
    out_bkgh = jnp.einsum("bkgs,bskh->bkgh", probs_bkgs, v_bskh, preferred_element_type=f32)
    if shared is not None:
        out_bkgh = out_bkgh + shared_out_bkgh
    return out_bkgh.astype(v_bskh.dtype)


def _group_layout(shape_bkgx, group: int):
    """(to_groups, to_rows): (b, k, g, x) <-> (b / group, k, group * g, x), the query heads of
    a group's rows side by side, so a prefix the group shares is one product per (prompt,
    kv head), (group * g x head_dim) . (head_dim x p), instead of `group` products of g rows."""
    b, k, g, _ = shape_bkgx

    def to_groups(x_bkgx):
        return x_bkgx.reshape(b // group, group, k, g, -1).swapaxes(1, 2).reshape(b // group, k, group * g, -1)

    def to_rows(x_pkqx):
        return x_pkqx.reshape(b // group, k, group, g, -1).swapaxes(1, 2).reshape(b, k, g, -1)

    return to_groups, to_rows


def reference_attention(
    q_btnh,
    k_bskh,
    v_bskh,
    segment_ids_bt,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    sinks_n=None,
    alibi_slopes=None,
):
    """Causal self-attention over a packed sequence through the full (b, t, t) mask;
    `alibi_slopes` (n,): ALiBi's bias by row distance (within a packed document, the
    position distance)."""
    if segment_ids_bt is None:
        segment_ids_bt = jnp.ones(q_btnh.shape[:2], jnp.int32)
    mask_bts = attention_mask(segment_ids_bt, segment_ids_bt, window=window)
    alibi = None
    if alibi_slopes is not None:
        t = q_btnh.shape[1]
        alibi = (alibi_slopes, (jnp.arange(t)[:, None] - jnp.arange(t)[None, :])[None], None)
    return dot_product_attention(
        q_btnh, k_bskh, v_bskh, mask_bts, scale=scale, softcap=softcap, sinks_n=sinks_n, alibi=alibi
    )

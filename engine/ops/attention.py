"""Attention: block-causal for training and prefill, and the plain reference over a mask.

`causal_attention` (training, prefill) is block-causal, memory-efficient and exact;
`dot_product_attention` over an explicit mask is the reference it is tested against and
what decoding with a KV cache uses.

The sequence is cut into query blocks; block i attends only to keys [0, end of block i),
so the upper triangle of the score matrix is never computed (at 4 blocks, 62% of the
full matmul work; at 8 blocks, 56%). Each block's softmax sees all of its keys at once,
so no online rescaling is needed. The backward pass is written out (jax.custom_vjp) in
the FlashAttention manner: it keeps only the output and the row log-sum-exp and recomputes
probabilities block by block, so no (b, heads, t, s) tensor is saved for the backward pass.

Operands are put head-major once, and every weight-gradient matmul is ordered so that its
contracted (sequence) dimension is the major one of the right-hand operand: XLA:CPU then
transposes only the narrow (h-wide) operand, never a score-sized one.

Shapes: b batch, t query positions, s key positions, k kv heads, g query heads per kv head,
h head_dim. Query i sees key j iff j <= i, both carry the same non-zero segment id, and, on
a sliding-window (`local`) layer, i - j < window. A query that sees no key (padding) gets
a uniform average over its block's keys, like the reference softmax over masked scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite: a fully masked row (padding) stays finite (uniform), never NaN


def query_blocks(t: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of each query block (the last may be shorter); one block if block is 0."""
    if block <= 0 or t <= block:
        return [(0, t)]
    return [(i, min(i + block, t)) for i in range(0, t, block)]


def _mask(segment_bt, q0: int, q1: int, window, local):
    """(b, q1 - q0, q1) visibility of keys [0, q1) from queries [q0, q1)."""
    distance_ts = jnp.arange(q0, q1)[:, None] - jnp.arange(q1)[None, :]
    visible_ts = distance_ts >= 0
    if window is not None:
        visible_ts = visible_ts & ((distance_ts < window) | jnp.logical_not(local))
    seg_q, seg_k = segment_bt[:, q0:q1], segment_bt[:, :q1]
    return visible_ts[None] & (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k != 0)[:, None, :]


def _scores(q_bktgh, k_bksh, mask_bts, scale, softcap):
    """Masked scores (b, k, t, g, s) in float32, and tanh(raw / softcap) when capped."""
    raw = jnp.einsum("bkrh,bksh->bkrs", _rows(q_bktgh), k_bksh, preferred_element_type=jnp.float32)
    raw = raw.reshape(*q_bktgh.shape[:-1], k_bksh.shape[2]) * scale
    capped = None
    if softcap is not None:
        capped = jnp.tanh(raw / softcap)
        raw = softcap * capped
    return jnp.where(mask_bts[:, None, :, None, :], raw, NEG_INF), capped


def _rows(x):
    """(b, k, t, g, last) -> (b, k, t * g, last): one row per query head and position (free)."""
    b, k, t, g, last = x.shape
    return x.reshape(b, k, t * g, last)


def _to_heads(q_btnh, k_bskh, v_bskh):
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q = q_btnh.reshape(b, t, kv, n // kv, h).transpose(0, 2, 1, 3, 4)  # (b, k, t, g, h)
    return q, k_bskh.transpose(0, 2, 1, 3), v_bskh.transpose(0, 2, 1, 3)  # (b, k, s, h)


def _forward(q, k, v, segment_bt, local, scale, softcap, window, block):
    """Head-major output (b, k, t, g, h) and row log-sum-exp (b, k, t, g)."""
    outs, lses = [], []
    for q0, q1 in query_blocks(q.shape[2], block):
        mask = _mask(segment_bt, q0, q1, window, local)
        scores, _ = _scores(q[:, :, q0:q1], k[:, :, :q1], mask, scale, softcap)
        m = jnp.max(scores, axis=-1, keepdims=True)
        p = jnp.exp(scores - m)
        denom = jnp.sum(p, axis=-1)
        o = jnp.einsum("bkrs,bksh->bkrh", _rows(p.astype(v.dtype)), v[:, :, :q1], preferred_element_type=jnp.float32)
        o = o.reshape(*p.shape[:-1], v.shape[-1])
        outs.append((o / denom[..., None]).astype(q.dtype))
        lses.append(m[..., 0] + jnp.log(denom))
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention(q, k, v, segment_bt, local, scale, softcap, window, block):
    return _forward(q, k, v, segment_bt, local, scale, softcap, window, block)[0]


def _attention_fwd(q, k, v, segment_bt, local, scale, softcap, window, block):
    o, lse = _forward(q, k, v, segment_bt, local, scale, softcap, window, block)
    return o, (q, k, v, segment_bt, local, o, lse)


def _attention_bwd(scale, softcap, window, block, residuals, do):
    q, k, v, segment_bt, local, o, lse = residuals
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # (b, k, t, g)
    dq_blocks = []
    dk_t = jnp.zeros((*k.shape[:2], k.shape[3], k.shape[2]), jnp.float32)  # (b, k, h, s)
    dv_t = jnp.zeros_like(dk_t)
    for q0, q1 in query_blocks(q.shape[2], block):
        q_b, do_b = q[:, :, q0:q1], do[:, :, q0:q1]
        scores, capped = _scores(q_b, k[:, :, :q1], _mask(segment_bt, q0, q1, window, local), scale, softcap)
        p = jnp.exp(scores - lse[:, :, q0:q1, :, None])
        dv_t = dv_t.at[..., :q1].add(
            jnp.einsum("bkrh,bkrs->bkhs", _rows(do_b), _rows(p.astype(do.dtype)), preferred_element_type=jnp.float32))
        dp = jnp.einsum("bkrh,bksh->bkrs", _rows(do_b), v[:, :, :q1], preferred_element_type=jnp.float32)
        dp = dp.reshape(p.shape)
        ds = p * (dp - delta[:, :, q0:q1, :, None])
        if capped is not None:
            ds = ds * (1.0 - jnp.square(capped))
        ds = (ds * scale).astype(q.dtype)
        dq = jnp.einsum("bkrs,bksh->bkrh", _rows(ds), k[:, :, :q1], preferred_element_type=jnp.float32)
        dq_blocks.append(dq.reshape(q_b.shape))
        dk_t = dk_t.at[..., :q1].add(
            jnp.einsum("bkrh,bkrs->bkhs", _rows(q_b), _rows(ds), preferred_element_type=jnp.float32))
    dq = jnp.concatenate(dq_blocks, axis=2).astype(q.dtype)
    dk = dk_t.swapaxes(2, 3).astype(k.dtype)
    dv = dv_t.swapaxes(2, 3).astype(v.dtype)
    return dq, dk, dv, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(q_btnh, k_bskh, v_bskh, segment_bt, *, scale: float, softcap: float | None = None,
                     window: int | None = None, local=False, block: int = 128):
    """Causal, segment-aware grouped-query attention over one packed sequence (t == s).

    Returns (b, t, n, h) in the dtype of q. `local` may be traced (a per-layer flag under
    scan); `window` and `block` are static.
    """
    b, t, n, h = q_btnh.shape
    q, k, v = _to_heads(q_btnh, k_bskh, v_bskh)
    out = _attention(q, k, v, segment_bt, jnp.asarray(local), float(scale),
                     None if softcap is None else float(softcap), window, int(block))
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)


# --------------------------------------------------------------------------- reference (and decoding)


def attention_mask(segment_q_bt, segment_k_bs, positions_q_bt=None, positions_k_bs=None, *, window=None, local=True):
    """Causal within a packed document: query i sees key j iff j <= i and same segment.

    Segment id 0 marks padding. Causality is by row index, which equals position order
    inside each packed segment. With a sliding `window`, a `local` query (a bool, possibly
    traced) also needs i - j < window.
    """
    t, s = segment_q_bt.shape[1], segment_k_bs.shape[1]
    distance_ts = jnp.arange(t)[:, None] + (s - t) - jnp.arange(s)[None, :]
    causal_ts = distance_ts >= 0
    if window is not None:
        causal_ts = causal_ts & ((distance_ts < window) | jnp.logical_not(local))
    same_bts = segment_q_bt[:, :, None] == segment_k_bs[:, None, :]
    valid_bs = (segment_k_bs != 0)[:, None, :]
    return causal_ts[None] & same_bts & valid_bs


def dot_product_attention(q_btnh, k_bskh, v_bskh, mask_bts, *, scale=None, softcap=None):
    """Grouped-query attention; softmax in float32. Scores are q.k * scale (default
    head_dim**-0.5), optionally soft-capped to (-softcap, softcap) before masking."""
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    scores = scores * (h**-0.5 if scale is None else scale)
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask_bts[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)
    return out_btkgh.reshape(b, t, n, h)

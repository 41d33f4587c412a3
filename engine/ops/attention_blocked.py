"""Block-causal attention: exact, memory-efficient, written for XLA:CPU (`blocked`).

The sequence is cut into query blocks; block [q0, q1) attends only to keys [k0, q1), where
k0 is 0 on a global layer and q0 - window + 1 on a sliding-window one: the masked upper
triangle (at 4 blocks, 62% of the full matmul work; at 8 blocks, 56%) and, on local layers,
every key block left of the window are never computed, forward or backward. Each block's
softmax sees all of its keys at once, so no online rescaling is needed. The backward pass is
written out (jax.custom_vjp) in the FlashAttention manner: it keeps only the output and the
row log-sum-exp and recomputes probabilities block by block, so no (b, heads, t, s) tensor
is saved for the backward pass.

Each block's keys come in two parts (key_parts): those left of the block, which every query
of the block sees on a global layer without segments, so their scores go unmasked, and the
diagonal square, the only part the causal mask cuts. At 512 positions in blocks of 128 that
leaves the select on 4 of the 10 score tiles.

Operands are put head-major once, and every weight-gradient matmul is ordered so that its
contracted (sequence) dimension is the major one of the right-hand operand: XLA:CPU then
transposes only the narrow (h-wide) operand, never a score-sized one. In bf16 every product
must also keep bf16 operands to run on the CPU's bf16 kernels (YNNPACK): XLA:CPU multiplies
in float32 (converting score-sized operands) when an operand's contraction is not on its
minor axis or when it is a bare transpose of a whole array, so dK and dV take q and dO
transposed once, and each product takes a slice (the two key parts are always slices).

A context shard's queries (engine/ops/attention.py) sit at a traced `shift` into a longer key
sequence: then each block takes every key, or on a sliding-window layer a window's worth
from a traced start (a dynamic slice), and the mask covers the rest.

Shapes: b batch, t query positions, s key positions, k kv heads, g query heads per kv head,
h head_dim. Query i sees key j iff j <= i, both carry the same non-zero segment id, and,
with a `window`, i - j < window. A query that sees no key (padding) gets a uniform average
over the keys its block computes, like the reference softmax over masked scores.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from engine.ops.attention_reference import NEG_INF


def query_blocks(t: int, block: int) -> list[tuple[int, int]]:
    """[start, end) of each query block (the last may be shorter); one block if block is 0."""
    if block <= 0 or t <= block:
        return [(0, t)]
    return [(i, min(i + block, t)) for i in range(0, t, block)]


def key_start(q0: int, window: int | None) -> int:
    """The first key any query of a block starting at q0 can see."""
    return 0 if window is None else max(0, q0 - window + 1)


def key_parts(q0: int, q1: int, k0: int) -> list[tuple[int, int]]:
    """The keys [k0, q1) of query block [q0, q1) in two parts: [k0, q0) left of the block,
    which every query sees unless a window or segments say otherwise, and the diagonal
    [q0, q1), which the causal mask cuts (empty parts left out)."""
    return [(a, e) for a, e in ((k0, q0), (q0, q1)) if e > a]


def _mask(segment_bt, q0: int, q1: int, k0, keys: int, window, offset=0, key_segment_bt=None):
    """(b or 1, q1 - q0, keys) visibility of the keys [k0, k0 + keys) from the queries [q0,
    q1), which sit at positions `offset` + [q0, q1) of the keys' sequence (a context shard's
    queries: `offset` and `k0` traced); None where every query sees every key (then no select
    is spent on them). `segment_bt` holds the queries' segments, `key_segment_bt`
    the keys' (default: the same)."""
    if isinstance(offset, int) and isinstance(k0, int):
        causal = k0 + keys - 1 <= q0 + offset  # even the block's first query sees the last key
        in_window = window is None or q1 + offset - 1 - k0 < window  # even the last query sees the first key
        if segment_bt is None and causal and in_window:
            return None
    distance_ts = (jnp.arange(q0, q1) + offset)[:, None] - (k0 + jnp.arange(keys))[None, :]
    visible_ts = distance_ts >= 0
    if window is not None:
        visible_ts = visible_ts & (distance_ts < window)
    if segment_bt is None:
        return visible_ts[None]
    seg_q = segment_bt[:, q0:q1]
    seg_k = _slice(segment_bt if key_segment_bt is None else key_segment_bt, k0, keys, axis=1)
    return visible_ts[None] & (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k != 0)[:, None, :]


def _slice(x, start, length: int, axis: int):
    """`length` entries of x along `axis` from `start` (static or traced)."""
    if isinstance(start, int):
        return jax.lax.slice_in_dim(x, start, start + length, axis=axis)
    return jax.lax.dynamic_slice_in_dim(x, start, length, axis=axis)


def _add(acc, start, value, axis: int):
    """acc with `value` added at `start` (static or traced) along `axis`."""
    if isinstance(start, int):
        index = (slice(None),) * axis + (slice(start, start + value.shape[axis]),)
        return acc.at[index].add(value)
    return jax.lax.dynamic_update_slice_in_dim(
        acc, jax.lax.dynamic_slice_in_dim(acc, start, value.shape[axis], axis) + value, start, axis
    )


def _alibi(slopes_kg, q0: int, q1: int, start, keys: int, offset):
    """ALiBi's bias -slope * (i - j), (1, k, t, g, s), of the queries [q0, q1) (at positions
    `offset` + those) and the keys [start, start + keys); None without slopes."""
    if slopes_kg is None:
        return None
    distance_ts = (jnp.arange(q0, q1) + offset)[:, None] - (start + jnp.arange(keys))[None, :]
    slopes = jnp.asarray(slopes_kg, jnp.float32)[None, :, None, :, None]
    return -slopes * distance_ts.astype(jnp.float32)[None, None, :, None, :]


def _scores(q_bktgh, k_bksh, mask_bts, scale, softcap, bias=None):
    """Scores (b, k, t, g, s) in float32, masked where mask_bts (None: all visible) says, and
    tanh(raw / softcap) when capped; `bias` (ALiBi's) added before the mask."""
    raw = jnp.einsum("bkrh,bksh->bkrs", _rows(q_bktgh), k_bksh, preferred_element_type=jnp.float32)
    raw = raw.reshape(*q_bktgh.shape[:-1], k_bksh.shape[2]) * scale
    capped = None
    if softcap is not None:
        capped = jnp.tanh(raw / softcap)
        raw = softcap * capped
    if bias is not None:
        raw = raw + bias
    if mask_bts is None:
        return raw, capped
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


def _per_group(slopes_n, kv_heads: int) -> tuple[tuple[float, ...], ...]:
    """n static slopes as (k, g) nested tuples (a hashable static argument)."""
    slopes = [float(x) for x in slopes_n]
    g = len(slopes) // kv_heads
    return tuple(tuple(slopes[i * g : (i + 1) * g]) for i in range(kv_heads))


def _sinks(sinks_kg):
    """Attention sinks (k, g) broadcast against scores (b, k, t, g, s)."""
    return sinks_kg[None, :, None, :, None]


def _blocks(q, s: int, window, block, shift):
    """Each query block's [q0, q1) and the key parts it attends to, (start, length) each:
    without a `shift`, only the keys a causal or sliding-window mask leaves (the diagonal
    apart); with one (a traced int: the queries at positions shift + [0, t) of the keys'
    sequence), every key, or on a sliding-window layer the block's window of keys from a
    traced start."""
    for q0, q1 in query_blocks(q.shape[2], block):
        if shift is None:
            yield q0, q1, [(a, e - a) for a, e in key_parts(q0, q1, key_start(q0, window))]
        elif window is None or q1 - q0 + window - 1 >= s:
            yield q0, q1, [(0, s)]
        else:
            length = q1 - q0 + window - 1
            yield q0, q1, [(jnp.clip(shift + q0 - window + 1, 0, s - length), length)]


def _forward(q, k, v, segments, shift, sinks_kg, scale, softcap, window, block, alibi=None):
    """Head-major output (b, k, t, g, h) and row log-sum-exp (b, k, t, g), the sinks' terms
    (GPT-OSS: one more logit per head in each denominator) included. The probabilities are
    rounded to v's dtype once, and the denominator sums what the product then uses."""
    outs, lses = [], []
    seg_q, seg_k = segments or (None, None)
    at = 0 if shift is None else shift
    for q0, q1, parts in _blocks(q, k.shape[2], window, block, shift):
        scores = [
            _scores(
                q[:, :, q0:q1],
                _slice(k, a, n, 2),
                _mask(seg_q, q0, q1, a, n, window, at, seg_k),
                scale,
                softcap,
                _alibi(alibi, q0, q1, a, n, at),
            )[0]
            for a, n in parts
        ]
        m = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in scores])
        if sinks_kg is not None:
            m = jnp.maximum(m, _sinks(sinks_kg))
        ps = [jnp.exp(s - m).astype(v.dtype) for s in scores]
        denom = sum(jnp.sum(p, axis=-1, dtype=jnp.float32) for p in ps)
        if sinks_kg is not None:
            denom = denom + jnp.exp(_sinks(sinks_kg) - m)[..., 0]
        o = sum(
            jnp.einsum("bkrs,bksh->bkrh", _rows(p), _slice(v, a, n, 2), preferred_element_type=jnp.float32)
            for p, (a, n) in zip(ps, parts)
        )
        o = o.reshape(*ps[0].shape[:-1], v.shape[-1])
        outs.append((o / denom[..., None]).astype(q.dtype))
        lses.append(m[..., 0] + jnp.log(denom))
    return jnp.concatenate(outs, axis=2), jnp.concatenate(lses, axis=2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _attention(q, k, v, segments, shift, sinks_kg, scale, softcap, window, block, alibi):
    return _forward(q, k, v, segments, shift, sinks_kg, scale, softcap, window, block, alibi)[0]


def _attention_fwd(q, k, v, segments, shift, sinks_kg, scale, softcap, window, block, alibi):
    o, lse = _forward(q, k, v, segments, shift, sinks_kg, scale, softcap, window, block, alibi)
    return o, (q, k, v, segments, shift, sinks_kg, o, lse)


def _attention_bwd(scale, softcap, window, block, alibi, residuals, do):
    q, k, v, segments, shift, sinks_kg, o, lse = residuals
    seg_q, seg_k = segments or (None, None)
    at = 0 if shift is None else shift
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # (b, k, t, g)
    # A sink's probability exp(sink - lse) takes no value, so d(out)/d(sink) = -p_sink * out.
    dsinks = None if sinks_kg is None else -jnp.sum(jnp.exp(sinks_kg[None, :, None] - lse) * delta, axis=(0, 2))
    dq_blocks = []
    dk_t = jnp.zeros((*k.shape[:2], k.shape[3], k.shape[2]), jnp.float32)  # (b, k, h, s)
    dv_t = jnp.zeros_like(dk_t)
    g = q.shape[3]
    # q and do with their rows minor, (b, k, h, t * g): the left operands of dK and dV as
    # XLA:CPU's bf16 kernels take them (contracted on the minor axis), transposed once here.
    q_t, do_t = _rows(q).swapaxes(2, 3), _rows(do).swapaxes(2, 3)
    for q0, q1, parts in _blocks(q, k.shape[2], window, block, shift):
        q_b, do_b, lse_b, delta_b = (
            q[:, :, q0:q1],
            do[:, :, q0:q1],
            lse[:, :, q0:q1, :, None],
            delta[:, :, q0:q1, :, None],
        )
        q_bt, do_bt = q_t[..., q0 * g : q1 * g], do_t[..., q0 * g : q1 * g]
        dq = 0.0
        for a, n in parts:
            k_b, v_b = _slice(k, a, n, 2), _slice(v, a, n, 2)
            mask = _mask(seg_q, q0, q1, a, n, window, at, seg_k)
            scores, capped = _scores(q_b, k_b, mask, scale, softcap, _alibi(alibi, q0, q1, a, n, at))
            p = jnp.exp(scores - lse_b).astype(do.dtype)  # rounded once: dV's operand and ds's factor
            dv_t = _add(dv_t, a, jnp.einsum("bkhr,bkrs->bkhs", do_bt, _rows(p), preferred_element_type=jnp.float32), 3)
            dp = jnp.einsum("bkrh,bksh->bkrs", _rows(do_b), v_b, preferred_element_type=jnp.float32)
            ds = p * (dp.reshape(p.shape) - delta_b)
            if capped is not None:
                ds = ds * (1.0 - jnp.square(capped))
            ds = (ds * scale).astype(q.dtype)
            dq = dq + jnp.einsum("bkrs,bksh->bkrh", _rows(ds), k_b, preferred_element_type=jnp.float32)
            dk_t = _add(dk_t, a, jnp.einsum("bkhr,bkrs->bkhs", q_bt, _rows(ds), preferred_element_type=jnp.float32), 3)
        dq_blocks.append(dq.reshape(q_b.shape))
    dq = jnp.concatenate(dq_blocks, axis=2).astype(q.dtype)
    dk = dk_t.swapaxes(2, 3).astype(k.dtype)
    dv = dv_t.swapaxes(2, 3).astype(v.dtype)
    return dq, dk, dv, None if segments is None else (None, None), None, dsinks


_attention.defvjp(_attention_fwd, _attention_bwd)


def blocked_attention(
    q_btnh,
    k_bskh,
    v_bskh,
    segment_ids_bt=None,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    block: int = 128,
    sinks_n=None,
    shift=None,
    key_segment_ids_bs=None,
    alibi_slopes=None,
):
    """Causal, segment-aware grouped-query attention over one packed sequence.

    Returns (b, t, n, h) in the dtype of q. `window` (None: global) and `block` are static;
    segment_ids_bt None means one unpadded document per row; `sinks_n` (n,), if given, are
    attention sinks. The queries are the keys' positions [0, t), or, with `shift` (a traced
    int: a context shard's queries, engine/ops/attention.py), positions shift + [0, t) of the
    s keys; then every query block takes every key (on a sliding-window layer its window's
    worth, from a traced start). `key_segment_ids_bs` (b, s): the keys' segments where they are
    not the queries' (s != t). `alibi_slopes` (n floats, static): ALiBi's -slope * (i - j) on
    the scores (by row distance: within a packed document, the position distance).
    """
    b, t, n, h = q_btnh.shape
    assert shift is not None or k_bskh.shape[1] == t, "keys beyond the queries need the queries' shift"
    assert segment_ids_bt is None or key_segment_ids_bs is not None or k_bskh.shape[1] == t, (
        "keys beyond the queries need their own segment ids"
    )
    assert key_segment_ids_bs is None or segment_ids_bt is not None, "key segment ids need the queries' too"
    q, k, v = _to_heads(q_btnh, k_bskh, v_bskh)
    sinks_kg = None if sinks_n is None else sinks_n.astype(jnp.float32).reshape(k.shape[1], n // k.shape[1])
    segments = None
    if segment_ids_bt is not None:
        segments = (segment_ids_bt, segment_ids_bt if key_segment_ids_bs is None else key_segment_ids_bs)
    shift = None if shift is None else jnp.asarray(shift, jnp.int32)
    out = _attention(
        q,
        k,
        v,
        segments,
        shift,
        sinks_kg,
        float(scale),
        None if softcap is None else float(softcap),
        window,
        int(block),
        None if alibi_slopes is None else _per_group(alibi_slopes, k.shape[1]),
    )
    return out.transpose(0, 2, 1, 3, 4).reshape(b, t, n, h)

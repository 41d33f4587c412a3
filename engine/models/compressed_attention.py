"""DeepSeek-V4's attention (arXiv 2512.24880 section 2.3; transformers' DeepseekV4Attention):
one shared key-value head attended through a sliding window, beside, per layer, compressed
entries of the whole past.

- Queries from a low-rank, normed latent (q_a, q_a_norm, q_b), each head RMS-normed without a
  scale; one key per position that is also its value (kv_proj, kv_norm); RoPE on the last
  rope_head_dim dimensions of each (adjacent pairs), and its inverse (the conjugate rotation at
  the query's position) on the output, whose values carried it; a learned sink per head in
  the softmax; a grouped low-rank output projection (o_a per group of heads, then o_b).
- A compressed layer (compress_ratio m > 0) also attends to entries that each pool a window of
  m positions: per channel, a softmax over the window of gate logits (gate_proj plus a learned
  bias per slot) weighting the window's projections (kv_proj), RMS-normed and rotated at the
  window's first position. A query sees the windows it has read to the end. HCA (heavily
  compressed, m = 128): windows side by side. CSA (compressed sparse, m = 4, `sparse`): each
  entry pools 2m positions, the window's second series of projections and the previous
  window's first; and a lightning indexer (as DeepSeek-V3.2's, dsa.py, over its own compressed
  keys) picks the index_topk entries each query attends to.

Training computes it over the sequence at once: the sliding window by blocks of `window`
queries over their block and the one before, the compressed entries a gather of each window's
slots and a softmax over it (no scan); one softmax over both and the sink. Packed rows keep
documents apart as the engine's other mixers do: the sliding window masks other segments, and
a window is the positions [k m, (k + 1) m) of one document (positions restart at each
document's start, so windows do; one a boundary or padding cuts is never pooled), its entry
seen by its own document's queries only, its overlap reading only its document's previous
window. Decoding caches each position's key and its compressor's projections (KVCache keys
and values, `cache_shapes`) and recomputes the pooled entries of the written positions every
step (a left-padded row's slots shifted back to its positions: the windows a full forward
pools), which gives the full forward's numbers (transformers keeps the pooled entries and a
buffer of the open window instead; its compressors pool a padded row's windows by slot,
padding included). The indexer's tie order (torch_cpu) takes the row of the query's document
(and the padding after it) when training, the longest row's entries when decoding.

Shapes: b batch, t queries, s keys (slots), d d_model, q q_lora_rank, n heads, h head_dim,
w compressed entries, c the compressor's width per position (h, or 2h with overlap), g the
indexer's heads, i its head width, x the grouped output's width (groups * out_rank).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import param
from engine.models.dsa import NEG_INF, top_k_indices
from engine.models.rope import rope_inverse_frequencies
from engine.models.specs import CompressedAttentionSpec, RotarySpec
from engine.ops.dense import dense
from engine.ops.partitioning import constrain


def _unit_rms(x, eps: float):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


def rotate_tail(x, positions, inv_freq, rope_dim: int, inverse: bool = False):
    """RoPE on the last `rope_dim` dimensions of x (..., h), adjacent pairs, at `positions`
    (x's leading axes, or all but its head axis: broadcast); `inverse`: the conjugate rotation."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    while freqs.ndim < x.ndim:  # a heads axis between the positions and the dimensions
        freqs = freqs[..., None, :]
    cos, sin = jnp.cos(freqs).astype(x.dtype), jnp.sin(freqs).astype(x.dtype)
    if inverse:
        sin = -sin
    rot = x[..., -rope_dim:].astype(jnp.float32)
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(rot.shape)
    return jnp.concatenate([x[..., :-rope_dim], rotated.astype(x.dtype)], axis=-1)


def inverse_frequencies(rope: RotarySpec, rope_dim: int):
    """Per-pair frequencies; YaRN without its attention factor (DeepSeek-V4 leaves cos and sin
    unscaled)."""
    return rope_inverse_frequencies(rope_dim, rope.theta, rope.scaling)


def window_scores(q_btnh, kv_bth, segment_ids_bt, window: int):
    """The sliding window's part of attention without a cache, by blocks of `window` queries,
    each over the keys of its block and the one before (O(t x window), not t x t): (scores
    (b, n, t, 2 window) float32, visible (b, t, 2 window), values(probs) -> (b, t, n, h))."""
    b, t, n, h = q_btnh.shape
    size = window
    blocks = -(-t // size)
    pad = blocks * size - t
    q_bjinh = jnp.pad(q_btnh, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, blocks, size, n, h)
    kv_pad = jnp.pad(kv_bth, ((0, 0), (size, pad), (0, 0)))  # a block of nothing before the first
    keys_bjkh = jnp.concatenate(
        [kv_pad[:, : blocks * size].reshape(b, blocks, size, h), kv_pad[:, size:].reshape(b, blocks, size, h)], axis=2
    )
    query_ji = jnp.arange(blocks)[:, None] * size + jnp.arange(size)[None, :]
    key_jk = jnp.arange(blocks)[:, None] * size - size + jnp.arange(2 * size)[None, :]
    distance_jik = query_ji[:, :, None] - key_jk[:, None, :]
    visible_bjik = ((distance_jik >= 0) & (distance_jik < window) & (key_jk >= 0)[:, None, :])[None]
    if segment_ids_bt is not None:
        seg_pad = jnp.pad(segment_ids_bt, ((0, 0), (size, pad)))
        key_seg_bjk = jnp.concatenate(
            [seg_pad[:, : blocks * size].reshape(b, blocks, size), seg_pad[:, size:].reshape(b, blocks, size)], axis=2
        )
        query_seg_bji = seg_pad[:, size:].reshape(b, blocks, size)
        same = (query_seg_bji[..., None] == key_seg_bjk[:, :, None, :]) & (key_seg_bjk != 0)[:, :, None, :]
        visible_bjik = visible_bjik & same
    scores_bnjik = jnp.einsum("bjinh,bjkh->bnjik", q_bjinh, keys_bjkh, preferred_element_type=jnp.float32)
    scores_bntk = scores_bnjik.reshape(b, n, blocks * size, 2 * size)[:, :, :t]
    visible_btk = jnp.broadcast_to(visible_bjik, (b, blocks, size, 2 * size)).reshape(b, blocks * size, -1)[:, :t]

    def values(probs_bntk):
        probs = jnp.pad(probs_bntk, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, n, blocks, size, 2 * size)
        out_bjinh = jnp.einsum("bnjik,bjkh->bjinh", probs.astype(kv_bth.dtype), keys_bjkh)
        return out_bjinh.reshape(b, blocks * size, n, h)[:, :t]

    return scores_bntk, visible_btk, values


def complete_windows(key_positions_bs, key_segments_bs, ratio: int):
    """The windows of `ratio` positions that documents hold whole, in slot order: (end slots
    (b, w) int32, valid (b, w) bool), w = s // ratio (they are disjoint: no more fit). A window
    is the positions [k ratio, (k + 1) ratio) of one document (positions restart at each
    document's start, so windows do), all in slots of its segment: none straddles two
    documents or holds padding (segment 0)."""
    b, s = key_positions_bs.shape
    w = s // ratio
    back = ((0, 0), (ratio - 1, 0))  # each slot's window start, ratio - 1 slots back
    start_seg_bs = jnp.pad(key_segments_bs, back)[:, :s]
    start_pos_bs = jnp.pad(key_positions_bs, back, constant_values=-1)[:, :s]
    ends_bs = (
        (key_segments_bs != 0)
        & ((key_positions_bs + 1) % ratio == 0)
        & (start_seg_bs == key_segments_bs)
        & (start_pos_bs == key_positions_bs - ratio + 1)
    )
    rank_bs = jnp.where(ends_bs, jnp.cumsum(ends_bs, axis=1) - 1, w)
    slots_bs = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    ends_bw = jnp.zeros((b, w), jnp.int32).at[jnp.arange(b)[:, None], rank_bs].set(slots_bs, mode="drop")
    return ends_bw, jnp.arange(w)[None] < jnp.sum(ends_bs, axis=1)[:, None]


def gather_windows(x_bsc, ends_bw, ratio: int):
    """(b, w, ratio, c): the slots of each window ending at `ends_bw`."""
    b, w = ends_bw.shape
    slots_bwm = jnp.maximum(ends_bw[:, :, None] - ratio + 1 + jnp.arange(ratio), 0)
    gathered = jnp.take_along_axis(x_bsc, slots_bwm.reshape(b, w * ratio, 1), axis=1)
    return gathered.reshape(b, w, ratio, x_bsc.shape[-1])  # w may be 0: fewer slots than one window


def pool_windows(kv_bwmc, gate_bwmc, follows_bw, bias_mc, scale_h, *, head_dim: int, overlap: bool, eps: float):
    """(b, w, h) float32: each window's entry, RMS-normed (before RoPE). `follows_bw`: window
    w - 1 is the previous one of its document (overlap reads its first series)."""
    kv = kv_bwmc.astype(jnp.float32)
    gate = gate_bwmc.astype(jnp.float32) + bias_mc.astype(jnp.float32)
    if overlap:  # the window's second series beside the previous window's first (none before a document's first)
        h = head_dim
        later = ((0, 0), (1, 0), (0, 0), (0, 0))  # one window later; padded then cut, so that w = 0 stays 0
        previous_kv = jnp.pad(kv[..., :h], later)[:, : kv.shape[1]]
        previous_gate = jnp.pad(gate[..., :h], later)[:, : gate.shape[1]]
        previous_gate = jnp.where(follows_bw[:, :, None, None], previous_gate, -jnp.inf)
        kv = jnp.concatenate([previous_kv, kv[..., h:]], axis=2)
        gate = jnp.concatenate([previous_gate, gate[..., h:]], axis=2)
    pooled_bwh = jnp.sum(kv * jax.nn.softmax(gate, axis=2), axis=2)
    return _unit_rms(pooled_bwh, eps) * scale_h.astype(jnp.float32)


class Compressor(nnx.Module):
    """One set of window-pooling weights (the attention's entries, or the indexer's keys)."""

    def __init__(self, d: int, width: int, head_dim: int, ratio: int, std: float, pdt, *, rngs: nnx.Rngs):
        self.w_kv_dc = param(rngs, (d, width), std, ("embed", None), pdt)
        self.w_gate_dc = param(rngs, (d, width), std, ("embed", None), pdt)
        # transformers keeps the position bias and the norm in float32
        self.b_pos_mc = nnx.Param(jnp.zeros((ratio, width), jnp.float32), out_sharding=(None, None))
        self.norm_h = nnx.Param(jnp.ones((head_dim,), jnp.float32), out_sharding=("norm",))


class CompressedAttention(nnx.Module):
    """A DeepSeek-V4 attention layer of a CompressedAttentionSpec (module docstring)."""

    def __init__(self, spec: CompressedAttentionSpec, build, *, rngs: nnx.Rngs):
        d, n, h, q = build.d_model, spec.num_heads, spec.head_dim, spec.q_lora_rank
        g_out, r_out = spec.out_groups, spec.out_rank
        pdt, std, out_std = build.param_dtype, build.init_std, build.out_std
        self.wq_a_dq = param(rngs, (d, q), std, ("embed", None), pdt)
        self.q_norm_q = nnx.Param(jnp.ones((q,), jnp.float32), out_sharding=("norm",))
        self.wq_b_qnh = param(rngs, (q, n, h), std, ("latent", "heads", None), pdt)
        self.wkv_dh = param(rngs, (d, h), std, ("embed", None), pdt)
        self.kv_norm_h = nnx.Param(jnp.ones((h,), jnp.float32), out_sharding=("norm",))
        self.wo_a_igr = param(rngs, (n * h // g_out, g_out, r_out), std, ("latent", "heads", None), pdt)
        self.wo_b_xd = param(rngs, (g_out * r_out, d), out_std, (None, "embed"), pdt)
        self.sinks_n = nnx.Param(jnp.zeros((n,), jnp.float32), out_sharding=("heads",))
        if spec.compress_ratio:
            self.compressor = Compressor(d, spec.overlap * h, h, spec.compress_ratio, std, pdt, rngs=rngs)
        if spec.sparse:
            g, i = spec.index_heads, spec.index_head_dim
            self.indexer = Compressor(d, 2 * i, i, spec.compress_ratio, std, pdt, rngs=rngs)
            self.wi_q_qgi = param(rngs, (q, g, i), std, ("latent", "heads", None), pdt)
            self.wi_weights_dg = param(rngs, (d, g), std, ("embed", None), pdt)
        self.dtype = build.dtype
        self.ties = build.compute.indexer_ties
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general

    def _dense(self, x, w: nnx.Param, n_in: int = 1):
        return dense(x, w[...].astype(self.dtype), n_in, backward=self.matmul_backward, dot_general=self.dot_general)

    def _raw(self, x_btd, spec: CompressedAttentionSpec):
        """(b, t, raw_width): the compressor's and indexer's projections and gate logits."""
        parts = []
        if spec.compress_ratio:
            parts += [self._dense(x_btd, self.compressor.w_kv_dc), self._dense(x_btd, self.compressor.w_gate_dc)]
        if spec.sparse:
            parts += [self._dense(x_btd, self.indexer.w_kv_dc), self._dense(x_btd, self.indexer.w_gate_dc)]
        return jnp.concatenate(parts, axis=-1)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: CompressedAttentionSpec, cache=None, **_):
        """As transformer.Attention: with a cache (decoding) returns (out, updated cache)."""
        b, t, _ = x_btd.shape
        h, r, eps = spec.head_dim, spec.rope_head_dim, spec.norm_eps
        rope = spec.compress_rope if spec.compress_ratio else spec.rope
        inv_freq = inverse_frequencies(rope, r)
        dt = self.dtype
        q_latent_btq = (_unit_rms(self._dense(x_btd, self.wq_a_dq), eps) * self.q_norm_q[...]).astype(dt)
        q_btnh = _unit_rms(self._dense(q_latent_btq, self.wq_b_qnh), eps).astype(dt)
        q_btnh = rotate_tail(q_btnh, positions_bt, inv_freq, r)
        q_btnh = constrain(q_btnh, ("act_batch", "act_seq", "act_heads", None))
        kv_bth = (_unit_rms(self._dense(x_btd, self.wkv_dh), eps) * self.kv_norm_h[...]).astype(dt)
        kv_bth = rotate_tail(kv_bth, positions_bt, inv_freq, r)
        raw_btx = self._raw(x_btd, spec) if spec.raw_width else jnp.zeros((b, t, 0), dt)
        if cache is None:  # the window's keys by blocks of `window` queries (window_scores)
            raw_bsx, written = raw_btx, None
            scores_bntk, visible_btk, local_values = window_scores(q_btnh, kv_bth, segment_ids_bt, spec.window)
        else:
            k_bs1h, raw_bs1x, visible_btk, cache = cache.update(kv_bth[:, :, None], raw_btx[:, :, None])
            keys_bsh, raw_bsx = k_bs1h[:, :, 0].astype(dt), raw_bs1x[:, :, 0]
            s = keys_bsh.shape[1]
            distance_ts = cache.end + jnp.arange(t)[:, None] - jnp.arange(s)[None, :]
            visible_btk = visible_btk & (distance_ts < spec.window)[None]
            scores_bntk = jnp.einsum("btnh,bsh->bnts", q_btnh, keys_bsh, preferred_element_type=jnp.float32)

            def local_values(probs_bnts):
                return jnp.einsum("bnts,bsh->btnh", probs_bnts.astype(dt), keys_bsh)

            written = cache.end + t
            # left padding: slot = position + the row's padding; the windows pool positions
            shift_b = written - 1 - positions_bt[:, -1]
            slots_bs = jnp.arange(s)[None, :] + shift_b[:, None]
            raw_bsx = jnp.take_along_axis(raw_bsx, jnp.minimum(slots_bs, s - 1)[:, :, None], axis=1)
            raw_bsx = jnp.where((slots_bs < s)[:, :, None], raw_bsx, 0)
            written = written - jnp.max(shift_b)
        local = scores_bntk.shape[-1]
        scores_bnts, visible_bts = scores_bntk, visible_btk
        if spec.compress_ratio:
            if cache is None:  # the row's documents (one, unpadded, without segment ids)
                segments_bt = jnp.ones((b, t), jnp.int32) if segment_ids_bt is None else segment_ids_bt
                rows = (positions_bt, segments_bt, segments_bt)
            else:  # one document, its slots shifted to its positions (above)
                s = raw_bsx.shape[1]
                one_bs = jnp.ones((b, s), jnp.int32)
                rows = (jnp.broadcast_to(jnp.arange(s), (b, s)), one_bs, one_bs[:, :t])
            entries_bwh, seen_btw = self._entries(x_btd, q_latent_btq, raw_bsx, positions_bt, spec, written, rows)
            entries_bwh = entries_bwh.astype(dt)
            entry_scores = jnp.einsum("btnh,bwh->bntw", q_btnh, entries_bwh, preferred_element_type=jnp.float32)
            scores_bnts = jnp.concatenate([scores_bnts, entry_scores], axis=-1)
            visible_bts = jnp.concatenate([visible_bts, seen_btw], axis=-1)
        scores_bnts = jnp.where(visible_bts[:, None], scores_bnts * (h**-0.5), NEG_INF)
        sinks_bnt1 = jnp.broadcast_to(
            self.sinks_n[...].astype(jnp.float32)[None, :, None, None], (b, spec.num_heads, t, 1)
        )
        top_bnt1 = jnp.maximum(jnp.max(scores_bnts, axis=-1, keepdims=True), sinks_bnt1)
        exp_bnts = jnp.exp(scores_bnts - top_bnt1)
        probs_bnts = exp_bnts / (jnp.sum(exp_bnts, axis=-1, keepdims=True) + jnp.exp(sinks_bnt1 - top_bnt1))
        out_btnh = local_values(probs_bnts[..., :local])
        if spec.compress_ratio:
            out_btnh = out_btnh + jnp.einsum("bntw,bwh->btnh", probs_bnts[..., local:].astype(dt), entries_bwh)
        out_btnh = rotate_tail(out_btnh, positions_bt, inv_freq, r, inverse=True)
        groups = spec.out_groups
        out_btgy = out_btnh.reshape(b, t, groups, -1)  # each group's heads, one after another
        grouped_btgr = jnp.einsum("btgy,ygr->btgr", out_btgy, self.wo_a_igr[...].astype(dt))
        out_btd = self._dense(grouped_btgr.reshape(b, t, -1), self.wo_b_xd)
        out_btd = constrain(out_btd, ("act_batch", "act_seq", "act_embed"))
        return out_btd if cache is None else (out_btd, cache)

    def _entries(self, x_btd, q_latent_btq, raw_bsx, positions_bt, spec: CompressedAttentionSpec, written, rows):
        """((b, w, h) the compressed entries, rotated; (b, t, w) bool: those each query attends
        to: its document's that it has read to the end). `rows`: (the slots' positions (b, s),
        their segments (b, s), the queries' segments (b, t)); `written`: the slots holding
        positions when decoding (None: a full forward)."""
        m, h, r, eps = spec.compress_ratio, spec.head_dim, spec.rope_head_dim, spec.norm_eps
        inv_freq = inverse_frequencies(spec.compress_rope, r)
        c = spec.overlap * h
        key_positions_bs, key_segments_bs, query_segments_bt = rows
        ends_bw, valid_bw = complete_windows(key_positions_bs, key_segments_bs, m)
        end_positions_bw = jnp.take_along_axis(key_positions_bs, ends_bw, axis=1)
        end_segments_bw = jnp.take_along_axis(key_segments_bs, ends_bw, axis=1)
        adjacent = (ends_bw[:, 1:] - ends_bw[:, :-1] == m) & (end_segments_bw[:, 1:] == end_segments_bw[:, :-1])
        follows_bw = jnp.pad(adjacent, ((0, 0), (1, 0)))[:, : ends_bw.shape[1]]  # window 0 follows none
        windows_bwmx = gather_windows(raw_bsx, ends_bw, m)
        comp = self.compressor
        entries_bwh = pool_windows(
            windows_bwmx[..., :c], windows_bwmx[..., c : 2 * c], follows_bw, comp.b_pos_mc[...], comp.norm_h[...],
            head_dim=h, overlap=spec.sparse, eps=eps,
        )  # fmt: skip
        w = entries_bwh.shape[1]
        window_starts_bw = end_positions_bw - m + 1
        entries_bwh = rotate_tail(entries_bwh, window_starts_bw, inv_freq, r)
        seen_btw = (
            valid_bw[:, None, :]
            & (end_segments_bw[:, None, :] == query_segments_bt[:, :, None])
            & (end_positions_bw[:, None, :] <= positions_bt[:, :, None])
        )
        if not spec.sparse:
            return entries_bwh, seen_btw
        i, g = spec.index_head_dim, spec.index_heads
        index = self.indexer
        keys_bwi = pool_windows(
            windows_bwmx[..., 2 * c : 2 * c + 2 * i], windows_bwmx[..., 2 * c + 2 * i :], follows_bw,
            index.b_pos_mc[...], index.norm_h[...], head_dim=i, overlap=True, eps=eps,
        )  # fmt: skip
        keys_bwi = rotate_tail(keys_bwi, window_starts_bw, inv_freq, r)
        index_q_btgi = rotate_tail(
            self._dense(q_latent_btq, self.wi_q_qgi).astype(jnp.float32), positions_bt, inv_freq, r
        )
        logits_btgw = jnp.einsum("btgi,bwi->btgw", index_q_btgi, keys_bwi) * (i**-0.5)
        weights_btg = self._dense(x_btd, self.wi_weights_dg).astype(jnp.float32) * (g**-0.5)
        scores_btw = jnp.einsum("btg,btgw->btw", weights_btg, jax.nn.relu(logits_btgw))
        scores_btw = jnp.where(seen_btw, scores_btw, NEG_INF)
        if spec.index_topk >= w:
            return entries_bwh, seen_btw
        b, t = positions_bt.shape
        if self.ties == "first" or written is not None:  # decoding: transformers' row, the entries emitted so far
            emitted = None if written is None else jnp.asarray(written // m, jnp.int32)
            index_btk = top_k_indices(scores_btw, spec.index_topk, self.ties, keys=emitted)
        else:  # torch's order over the row of the query's document alone (_document_rows)
            first_bt, length_bt = _document_rows(key_segments_bs, ends_bw, valid_bw, m)
            at_btw = first_bt[:, :, None] + jnp.arange(w)
            rows_btw = jnp.take_along_axis(scores_btw, jnp.minimum(at_btw, w - 1), axis=2)
            rows_btw = jnp.where(at_btw < w, rows_btw, NEG_INF)
            rows_q1w = rows_btw.reshape(b * t, 1, w)  # one row per query, its own length
            index_q1k = top_k_indices(rows_q1w, spec.index_topk, self.ties, keys=length_bt.ravel())
            index_btk = index_q1k.reshape(b, t, -1) + first_bt[:, :, None]
        index_btk = jnp.minimum(index_btk, w - 1)
        chosen_btw = (
            jnp.zeros((b, t, w), bool)
            .at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], index_btk]
            .set(True)
        )
        return entries_bwh, seen_btw & chosen_btw


def _document_rows(segments_bt, ends_bw, valid_bw, ratio: int):
    """For each query of a full forward, the row transformers' indexer holds for its document
    alone: (its first window's rank (b, t), the row's length (b, t): the windows of the
    document's slots and the padding after it, as a right-padded row has them)."""
    b, t = segments_bt.shape
    slots_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    starts_bt = (segments_bt != 0) & (segments_bt != jnp.pad(segments_bt[:, :-1], ((0, 0), (1, 0))))
    start_bt = jax.lax.cummax(jnp.where(starts_bt, slots_bt, 0), axis=1)
    next_start_bt = jax.lax.cummin(jnp.where(starts_bt, slots_bt, t), axis=1, reverse=True)
    next_start_bt = jnp.pad(next_start_bt[:, 1:], ((0, 0), (0, 1)), constant_values=t)  # the first after each slot
    before_bt = jnp.sum(valid_bw[:, None, :] & (ends_bw[:, None, :] < start_bt[:, :, None]), axis=2)
    return before_bt.astype(jnp.int32), (next_start_bt - start_bt) // ratio

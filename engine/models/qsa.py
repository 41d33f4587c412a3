"""Qwen4-Exp's QSA sparse attention (transformers' Qwen4ExpTextQSAIndexer): grouped-query
attention in which each query sees only the key blocks a small indexer selects, and the keys
of its own block while that block is incomplete.

The indexer has g query heads and one key head (one projection yields both, i wide each).
Its queries are RMS-normed and rotated at their positions as the attention's (the first
rotary dimensions). Keys are not scored one by one: each document's keys form blocks of
`block` consecutive ones (counted from its first key), and a block complete at the query
(its last key at or before it) is scored by its keys' mean, RMS-normed and rotated at the
position of the block's first key:

    score[t, c] = sum_g relu(q[t, g] . k_c) / sqrt(i)

The query attends to the keys of its budget // block best complete blocks (all of them while
there are no more) and to the keys of its own incomplete block (the tail), within the usual
causal, document and padding mask. Selection has no gradient, so the indexer's weights get
none from the LM loss.

Training and prefill score every block start for every query and mask the attention (O(t x s)
in the indexer's few heads and in the attention, as the dense reference does); decoding pools
the cached raw keys (KVCache.index_k) again each step. Ties among the block scores (every
head's ReLU at 0) are broken as ComputeConfig.indexer_ties says (torch_cpu: as transformers'
torch.topk on CPU, engine/ops/torch_cpu_topk.py). Shapes: b batch, t queries, s keys, c
blocks, d model width, g indexer heads, i their width.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.block_sparse import IndexerWeights, masked_attention
from engine.models.rope import layer_rotary, rotate_heads
from engine.models.specs import AttentionSpec
from engine.ops.attention_reference import attention_mask
from engine.ops.dense import dense
from engine.ops.torch_cpu_topk import torch_cpu_top_k


class QSAIndexer(IndexerWeights):
    """One layer's indexer (index_qk_proj, q_layernorm, k_layernorm)."""

    def __init__(self, spec: AttentionSpec, build, *, rngs: nnx.Rngs):
        assert spec.qsa_indexer is not None
        # its heads' scores are summed, whatever the key/value heads: not sharded as theirs
        super().__init__(spec, spec.qsa_indexer, build, None, rngs=rngs)
        self.ties = build.compute.indexer_ties

    def __call__(self, x_btd, rotary):
        """(queries (b, t, g, i) normed and rotated, in float32; raw keys (b, t, i))."""
        x = jax.lax.stop_gradient(x_btd).astype(self.dtype)  # the selection has no gradient
        q_btgi = self.q_norm(dense(x, self.wq_dgi[...].astype(self.dtype), 1))
        if self.rope is not None:
            q_btgi = rotate_heads(q_btgi, self.rope, rotary)
        return q_btgi.astype(jnp.float32), dense(x, self.wk_di[...].astype(self.dtype), 1)

    def block_keys(self, raw_k_bsi, positions_bs, max_position: int, block: int):
        """(b, s, i) float32: at each slot the mean of the `block` raw keys from it on, normed
        and rotated at the slot's position (what a block starting there is scored by)."""
        s = raw_k_bsi.shape[1]
        padded = jnp.pad(raw_k_bsi.astype(jnp.float32), ((0, 0), (0, block - 1), (0, 0)))
        total = functools.reduce(jnp.add, (padded[:, j : j + s] for j in range(block)))
        pooled_bsi = self.k_norm((total / block).astype(raw_k_bsi.dtype))
        if self.rope is not None:
            rotary = layer_rotary(positions_bs, self.rope, self.rope.rotary_dim or raw_k_bsi.shape[-1], max_position)
            pooled_bsi = rotate_heads(pooled_bsi[:, :, None], self.rope, rotary)[:, :, 0]
        return pooled_bsi.astype(jnp.float32)


def selected_keys(
    indexer: QSAIndexer,
    q_btgi,
    block_k_bsi,
    query_index_bt,
    key_index_bs,
    start_bt,
    eligible_bts,
    *,
    block: int,
    topk: int,
):
    """(b, t, s) bool: the keys query t attends to. `query_index_bt` and `key_index_bs` count
    each query's and key's place in its document, `start_bt` the slot of the query's
    document's first key, `eligible_bts` the keys it may see (causal, same document, valid)."""
    b, s, _ = block_k_bsi.shape
    t = q_btgi.shape[1]
    logits_btgs = jnp.einsum("btgi,bsi->btgs", q_btgi, block_k_bsi, precision=jax.lax.Precision.HIGHEST)
    scores_bts = jnp.sum(jax.nn.relu(logits_btgs), axis=2) / jnp.sqrt(jnp.float32(q_btgi.shape[-1]))
    blocks = -(-s // block)
    c = jnp.arange(blocks)
    slot_btc = jnp.clip(start_bt[..., None] + c * block, 0, s - 1)
    scores_btc = jnp.take_along_axis(scores_bts, slot_btc, axis=-1)
    complete_bt = (query_index_bt + 1) // block  # the query's complete blocks
    candidate_btc = c < complete_bt[..., None]
    if topk >= blocks:
        chosen_btc = candidate_btc
    else:
        scores_btc = jax.lax.stop_gradient(scores_btc)
        if indexer.ties == "torch_cpu":  # the blocks torch.topk takes of the complete ones
            rows = scores_btc.reshape(b * t, blocks)
            picked = jax.vmap(lambda row, n: torch_cpu_top_k(row, topk, n))(rows, complete_bt.reshape(-1))
            picked_btk = picked.reshape(b, t, topk)
        else:
            picked_btk = jax.lax.top_k(jnp.where(candidate_btc, scores_btc, -jnp.inf), topk)[1]
        top_btc = jnp.any(picked_btk[..., None] == c, axis=-2)
        chosen_btc = candidate_btc & (top_btc | (complete_bt[..., None] <= topk))
    key_block_bs = jnp.clip(key_index_bs // block, 0, blocks - 1)
    chosen_bts = jnp.take_along_axis(chosen_btc, jnp.broadcast_to(key_block_bs[:, None], (b, t, s)), axis=-1)
    tail_bts = (key_index_bs // block)[:, None, :] >= complete_bt[..., None]
    return eligible_bts & (chosen_bts | tail_bts)


def _document_index(segment_ids_bt):
    """(each slot's place in its document, the slot its document starts at), both (b, t)."""
    b, t = segment_ids_bt.shape
    slots = jnp.broadcast_to(jnp.arange(t), (b, t))
    change = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids_bt[:, 1:] != segment_ids_bt[:, :-1]], axis=1)
    start_bt = jax.lax.cummax(jnp.where(change, slots, 0), axis=1)
    return slots - start_bt, start_bt


def qsa_attention(attn, x_btd, q, k, v, positions_bt, segment_ids_bt, spec: AttentionSpec, cache, rotary):
    """(out (b, t, n, h), cache) of `attn`'s (a transformer.Attention) attention over the keys
    its QSA indexer selects."""
    indexer = spec.qsa_indexer
    assert indexer is not None
    index_q_btgi, raw_k_bti = attn.indexer(x_btd, rotary)
    t = q.shape[1]
    if cache is None:
        segments_bt = jnp.ones(q.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt
        mask_bts = attention_mask(segments_bt, segments_bt, window=spec.window)
        index_bt, start_bt = _document_index(segments_bt)
        raw_k_bsi, key_index_bs, query_index_bt = raw_k_bti, index_bt, index_bt
        key_positions_bs, max_position = positions_bt, t
    else:
        k, v, mask_bts, cache = cache.update(k, v, window=spec.window)
        raw_k_bsi, cache = cache.update_index(raw_k_bti)
        valid_bs = cache.valid_bs  # this step's slots valid already
        key_index_bs = jnp.maximum(jnp.cumsum(valid_bs.astype(jnp.int32), axis=1) - 1, 0)
        query_index_bt = jax.lax.dynamic_slice_in_dim(key_index_bs, cache.end, t, axis=1)
        start_bt = jnp.broadcast_to(jnp.argmax(valid_bs, axis=1)[:, None], query_index_bt.shape)
        key_positions_bs, max_position = key_index_bs, cache.length
    block_k_bsi = attn.indexer.block_keys(raw_k_bsi, key_positions_bs, max_position, indexer.block)
    chosen_bts = selected_keys(
        attn.indexer,
        index_q_btgi,
        block_k_bsi,
        query_index_bt,
        key_index_bs,
        start_bt,
        mask_bts,
        block=indexer.block,
        topk=indexer.budget // indexer.block,
    )
    sinks_n = attn.sinks_n[...] if spec.sinks else None
    out = masked_attention(q, k, v, chosen_bts[:, None], scale=spec.score_scale, softcap=spec.softcap, sinks_n=sinks_n)
    return out, cache

"""MiniMax-M3's block-sparse attention (transformers' MiniMaxM3VLIndexer): grouped-query
attention in which each key/value group's queries see only some blocks of keys, chosen by a
small indexer of its own.

The indexer has one query head per key/value head and one key per position (both i wide,
each through an RMSNorm of the model's kind, RoPE on their first rotary dimensions as the
attention's). Key s's score for query t in group g is q[t, g] . k[s] (unscaled) over the keys
up to the query's position; keys form blocks of `block` slots (s // block), a block's score
is its best key's, the `local_blocks` blocks ending at the query's own block always win, and
the query's group attends to the `topk_blocks` best blocks (fewer while there are fewer),
within the usual causal, segment and padding mask. Blocks count positions in the document, of
keys and queries alike (transformers counts slots of the row for keys: the same in a row
without left padding). In the parallel form padding keys take part in the scores, as in
transformers' forward pass (they are never attended to); decoding leaves the cache's empty
slots out (the sampler pads prompts on the left), as transformers' generate of an unpadded
prompt has none.

Training and prefill compute every score and mask the attention (O(t x s) in the indexer's
few heads and in the attention, as the dense reference does); decoding scores the cached
indexer keys (KVCache.index_k) of every slot. Selection has no gradient, so the indexer's
weights get none from the LM loss (MiniMax trains it apart). Shapes: b batch, t queries, s
keys, d model width, g indexer heads = key/value heads, i its head width, n query heads, h
head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import make_norm, param
from engine.models.rope import rotate_heads
from engine.models.specs import AttentionSpec, BlockIndexerSpec, QSAIndexerSpec
from engine.ops.attention_reference import softmax_with_sinks
from engine.ops.dense import dense

NEG_INF = -1e30  # finite: a padding query's row (nothing visible) stays finite


class IndexerWeights(nnx.Module):
    """An attention layer's indexer's weights (this module's and qsa.py's): projections of x to
    g query heads and to one key, i wide each, a norm of the model's kind on each, and the
    attention's rotation of its first rotary dimensions. `heads_axis` shards the g heads."""

    def __init__(
        self,
        spec: AttentionSpec,
        indexer: BlockIndexerSpec | QSAIndexerSpec,
        build,
        heads_axis: str | None,
        *,
        rngs: nnx.Rngs,
    ):
        d, g, i = build.d_model, indexer.heads, indexer.head_dim
        pdt, std = build.param_dtype, build.init_std
        self.wq_dgi = param(rngs, (d, g, i), std, ("embed", heads_axis, None), pdt)
        self.wk_di = param(rngs, (d, i), std, ("embed", None), pdt)
        self.q_norm = make_norm(spec.norm, i, pdt, rngs=rngs)
        self.k_norm = make_norm(spec.norm, i, pdt, rngs=rngs)
        self.rope = None
        if spec.rope is not None:  # the attention's rotation of its first rotary dimensions
            self.rope = spec.rope.model_copy(update={"rotary_dim": spec.rope.rotary_dim or spec.head_dim})
        self.dtype = build.dtype


class BlockIndexer(IndexerWeights):
    """The indexer of one attention layer: its queries (b, t, g, i) and keys (b, t, i)."""

    def __init__(self, spec: AttentionSpec, build, *, rngs: nnx.Rngs):
        assert spec.block_indexer is not None
        # a query head per key/value head: sharded as they are
        super().__init__(spec, spec.block_indexer, build, "kv_heads", rngs=rngs)

    def __call__(self, x_btd, rotary):
        """(queries (b, t, g, i), keys (b, t, i)) in float32; `rotary` the attention's (cos, sin)."""
        x = jax.lax.stop_gradient(x_btd).astype(self.dtype)  # the selection has no gradient
        q_btgi = self.q_norm(dense(x, self.wq_dgi[...].astype(self.dtype), 1))
        k_bt1i = self.k_norm(dense(x, self.wk_di[...].astype(self.dtype), 1))[:, :, None]
        if self.rope is not None:
            q_btgi, k_bt1i = rotate_heads(q_btgi, self.rope, rotary), rotate_heads(k_bt1i, self.rope, rotary)
        return q_btgi.astype(jnp.float32), k_bt1i[:, :, 0].astype(jnp.float32)


def selected_blocks(q_btgi, k_bsi, query_bt, key_bs, eligible_bts, *, block: int, topk: int, local: int):
    """(b, g, t, s): key s lies in one of the blocks query t's group selects. Blocks are
    position // block, `query_bt` and `key_bs` the queries' and keys' positions (below s);
    `eligible_bts` the keys that may score (at or before the query)."""
    b, s, _ = k_bsi.shape
    g, t = q_btgi.shape[2], q_btgi.shape[1]
    scores_bgts = jnp.einsum("btgi,bsi->bgts", q_btgi, k_bsi, precision=jax.lax.Precision.HIGHEST)
    scores_bgts = jnp.where(eligible_bts[:, None], scores_bgts, -jnp.inf)
    blocks = -(-s // block)
    key_block_bs = jnp.clip(key_bs // block, 0, blocks - 1)
    # each block's score its best key's: a max over the keys of each (row, block)
    ids = (jnp.arange(b)[:, None] * blocks + key_block_bs).reshape(-1)
    per_key = scores_bgts.transpose(0, 3, 1, 2).reshape(b * s, g, t)
    block_scores = jax.ops.segment_max(per_key, ids, num_segments=b * blocks, indices_are_sorted=False)
    block_scores_bgtc = block_scores.reshape(b, blocks, g, t).transpose(0, 2, 3, 1)
    distance_btc = (query_bt // block)[..., None] - jnp.arange(blocks)
    local_btc = (distance_btc >= 0) & (distance_btc < local)  # the blocks ending at the query's always win
    block_scores_bgtc = jnp.where(local_btc[:, None], jnp.inf, block_scores_bgtc)
    top_scores, top_blocks = jax.lax.top_k(block_scores_bgtc, min(topk, blocks))
    chosen_bgtc = jnp.any(  # a block of -inf (future, or no key) is never chosen
        (top_blocks[..., None] == jnp.arange(blocks)) & (top_scores[..., None] > -jnp.inf), axis=-2
    )
    index_bgts = jnp.broadcast_to(key_block_bs[:, None, None], (b, g, t, s))
    return jnp.take_along_axis(chosen_bgtc, index_bgts, axis=-1)


def masked_attention(q_btnh, k_bskh, v_bskh, mask_bkts, *, scale: float, softcap=None, sinks_n=None):
    """Grouped-query attention over a mask per key/value head (b, k, t, s); float32 softmax."""
    b, t, n, h = q_btnh.shape
    kv = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, kv, n // kv, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask_bkts[:, :, None], scores, NEG_INF)
    sinks = None if sinks_n is None else sinks_n.astype(jnp.float32).reshape(kv, n // kv)[None, :, :, None, None]
    probs = softmax_with_sinks(scores, sinks).astype(v_bskh.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh, preferred_element_type=jnp.float32)
    return out.astype(v_bskh.dtype).reshape(b, t, n, h)

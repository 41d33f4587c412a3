"""DeepSeek Sparse Attention (DSA; DeepSeek-V3.2, arXiv 2512.02556, and GLM-5): a lightning
indexer picks, for each query, the index_topk earlier keys multi-head latent attention
(mla.py) attends to.

The indexer is a small attention of its own, as transformers' DeepseekV32Indexer defines it:
g heads of queries (i wide) up-projected from MLA's compressed, normed query; one key per
position (i wide, LayerNorm-ed); RoPE on the first rope_head_dim dimensions of both (halves
for DeepSeek-V3.2, adjacent pairs for GLM-5), with MLA's frequencies; and a learned weight
per head and position. Its score of key s for query t is

    I[t, s] = sum_g w[t, g] * g**-0.5 * relu(q[t, g] . k[s] * i**-0.5)

and the query attends to the keys of the index_topk highest scores among those causal
attention lets it see (all of them while there are no more). The selection is a mask on
MLA's scores: training and prefill attend densely over that explicit mask
(engine/ops/attention_reference.py), decoding adds it to the cache's mask; the indexer's
keys are cached per position beside MLA's latent (KVCache.index_k).

Training the indexer (ComputeConfig.indexer_loss) follows the published recipe: its target
is the main attention's distribution summed over heads and L1-normalised, p[t, :], and its
loss KL(p[t, :] || softmax(I[t, :])) over every visible key in the dense warm-up (attention
stays dense, every other weight frozen) or over the selected keys in sparse training. The
indexer reads its inputs detached and the target is a constant, so the KL reaches only the
indexer's weights, and the LM loss never does (the selection has no gradient). As MaxText
(attention_mla.py: calculate_indexer_loss) the KL is a mean over query tokens; unlike it,
the target is the attention the model computes (scores times the softmax scale), and padding
queries are left out. Shapes: b batch, t queries, s keys, d d_model, q q_lora_rank, g the
indexer's heads, i its head width, n MLA's heads, h MLA's query/key head width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import dtype_of, param
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.moe import MoEStats
from engine.models.rope import apply_rope, rope_inverse_frequencies
from engine.ops.dense import DotGeneral, dense

NEG_INF = -1e30  # finite, as attention's: a padding query's row (nothing visible) stays finite
LAYER_NORM_EPS = 1e-6  # the key LayerNorm's, fixed in transformers' indexer


class WithIndexerLoss(NamedTuple):
    """A layer's statistics when its indexer trains: the router's (None for a dense MLP) and
    the indexer's KL (a scalar per layer; a leading layer axis once stacked)."""

    moe: MoEStats | None
    indexer_kl: jax.Array


class Indexer(nnx.Module):
    """The lightning indexer of one MLA layer: scores (b, t, s) of every key for every query."""

    def __init__(
        self, cfg: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs, dot_general: DotGeneral = jax.lax.dot_general
    ):
        d, g, i = cfg.d_model, cfg.index_heads, cfg.index_head_dim
        assert cfg.q_lora_rank is not None and cfg.index_topk is not None
        pdt, std = dtype_of(compute.param_dtype), cfg.init_std
        self.wq_b_qgi = param(rngs, (cfg.q_lora_rank, g, i), std, (None, "heads", None), pdt)
        self.wk_di = param(rngs, (d, i), std, ("embed", None), pdt)
        self.k_norm_scale = nnx.Param(jnp.ones((i,), pdt), out_sharding=("norm",))
        self.k_norm_bias = nnx.Param(jnp.zeros((i,), pdt), out_sharding=("norm",))
        # transformers keeps weights_proj in float32 (_keep_in_fp32_modules): so is its product here
        self.w_weights_dg = param(rngs, (d, g), std, ("embed", "heads"), pdt)
        self.heads, self.head_dim, self.rope_dim = g, i, cfg.rope_head_dim
        self.rope_theta, self.rope_scaling, self.interleave = (
            cfg.rope_theta,
            cfg.rope_scaling,
            cfg.index_rope_interleave,
        )
        self.dtype = dtype_of(compute.dtype)
        self.matmul_backward, self.dot_general = compute.matmul_backward, dot_general

    def _dense(self, x, w: nnx.Param, n_in: int = 1):
        return dense(x, w[...].astype(self.dtype), n_in, backward=self.matmul_backward, dot_general=self.dot_general)

    def _rope(self, x_btgi, positions_bt, max_position: int):
        """RoPE on the first rope_head_dim dimensions; interleaved pairs as mla.py rotates them
        (evens then odds, which leaves every dot product as transformers' order does)."""
        r = self.rope_dim
        x_rot = x_btgi[..., :r]
        if self.interleave:
            x_rot = jnp.concatenate([x_rot[..., 0::2], x_rot[..., 1::2]], axis=-1)
        inv_freq = rope_inverse_frequencies(r, self.rope_theta, self.rope_scaling)
        factor = 1.0 if self.rope_scaling is None else self.rope_scaling.yarn_attention_factor()
        x_rot = apply_rope(x_rot, positions_bt, inv_freq, factor, max_position)
        return jnp.concatenate([x_rot, x_btgi[..., r:]], axis=-1)

    def keys(self, x_btd, positions_bt, max_position: int):
        """(b, t, i): each position's one key, LayerNorm-ed and rotated, in float32."""
        k_bti = self._dense(x_btd, self.wk_di).astype(jnp.float32)
        mean = jnp.mean(k_bti, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(k_bti - mean), axis=-1, keepdims=True)
        k_bti = (k_bti - mean) * jax.lax.rsqrt(var + LAYER_NORM_EPS)
        k_bti = k_bti * self.k_norm_scale[...].astype(jnp.float32) + self.k_norm_bias[...].astype(jnp.float32)
        return self._rope(k_bti[:, :, None], positions_bt, max_position)[:, :, 0]

    def queries(self, x_btd, q_latent_btq, positions_bt, max_position: int):
        """((b, t, g, i) queries, (b, t, g) head weights), in float32."""
        q_btgi = self._dense(q_latent_btq, self.wq_b_qgi).astype(jnp.float32)
        q_btgi = self._rope(q_btgi, positions_bt, max_position)
        weights_btg = jnp.einsum(
            "btd,dg->btg", x_btd.astype(jnp.float32), self.w_weights_dg[...].astype(jnp.float32)
        ) * (self.heads**-0.5)
        return q_btgi, weights_btg

    def scores(self, q_btgi, weights_btg, k_bsi, visible_bts):
        """(b, t, s) float32: I[t, s] where visible, NEG_INF elsewhere."""
        logits_btgs = jnp.einsum("btgi,bsi->btgs", q_btgi, k_bsi.astype(jnp.float32)) * (self.head_dim**-0.5)
        scores_bts = jnp.einsum("btg,btgs->bts", weights_btg, jax.nn.relu(logits_btgs))
        return jnp.where(visible_bts, scores_bts, NEG_INF)


def select_top_k(scores_bts, top_k: int):
    """(b, t, s) bool: the top_k highest scores of each query (all keys if there are no more
    than top_k; ties go to the earlier key). Callers and it with the visible mask, so masked
    keys a short row fills its top_k with are never attended to."""
    b, t, s = scores_bts.shape
    if top_k >= s:
        return jnp.ones(scores_bts.shape, bool)
    _, index_btk = jax.lax.top_k(jax.lax.stop_gradient(scores_bts), top_k)
    rows_b11, queries_1t1 = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
    return jnp.zeros(scores_bts.shape, bool).at[rows_b11, queries_1t1, index_btk].set(True)


def indexer_kl(q_btnh, k_bsnh, scale: float, target_bts, scores_bts, valid_bt):
    """Mean over valid queries of KL(p || softmax(scores)) over the keys of `target_bts`, p
    the main attention's probabilities there summed over heads and L1-normalised (a constant:
    q and k are detached)."""
    f32 = jnp.float32
    q_btnh, k_bsnh = jax.lax.stop_gradient(q_btnh), jax.lax.stop_gradient(k_bsnh)
    logits_bnts = jnp.einsum("btnh,bsnh->bnts", q_btnh.astype(f32), k_bsnh.astype(f32)) * scale
    probs_bnts = jax.nn.softmax(jnp.where(target_bts[:, None], logits_bnts, NEG_INF), axis=-1)
    target_bts_p = jnp.sum(probs_bnts, axis=1)
    target_bts_p = jnp.where(target_bts, target_bts_p / jnp.sum(target_bts_p, axis=-1, keepdims=True), 0.0)
    log_q_bts = jax.nn.log_softmax(jnp.where(target_bts, scores_bts, NEG_INF), axis=-1)
    safe_p = jnp.where(target_bts_p > 0, target_bts_p, 1.0)
    kl_bt = jnp.sum(jnp.where(target_bts_p > 0, target_bts_p * (jnp.log(safe_p) - log_q_bts), 0.0), axis=-1)
    valid = valid_bt.astype(f32)
    return jnp.sum(kl_bt * valid) / jnp.maximum(jnp.sum(valid), 1.0)

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
attention lets it see (all of them while there are no more). `sparse_attention` computes
it as DeepSeek-V3.2's sparse kernel does: queries in chunks, each chunk's indexer scores of
every key (O(t x s), but in the indexer's few narrow heads), its top-k, then MLA in the
absorbed form over only the gathered latents and rotary keys of those keys
(engine/ops/sparse_mla.py), so the attention's work and memory per token are proportional to
index_topk, not to the sequence; training, prefill and decoding alike (the indexer's keys
cached per position beside MLA's latent, KVCache.index_k). The dense-masked path (the
selection as a mask on every score, engine/ops/attention_reference.py) stays as the
reference (attention_impl `reference`) and runs where the top-k keeps every key.

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

from engine.models.common import param
from engine.models.moe import MoEStats
from engine.models.rope import apply_rope, rope_inverse_frequencies
from engine.models.specs import MLASpec, RotarySpec
from engine.ops.dense import dense
from engine.ops.sparse_mla import gather_rows, selected_latent_attention
from engine.ops.torch_cpu_topk import torch_cpu_top_k

NEG_INF = -1e30  # finite, as attention's: a padding query's row (nothing visible) stays finite
LAYER_NORM_EPS = 1e-6  # the key LayerNorm's, fixed in transformers' indexer


class WithIndexerLoss(NamedTuple):
    """A layer's statistics when its indexer trains: the router's (None for a dense MLP) and
    the indexer's KL (a scalar per layer; a leading layer axis once stacked)."""

    moe: MoEStats | None
    indexer_kl: jax.Array


class Indexer(nnx.Module):
    """The lightning indexer of one MLA layer: scores (b, t, s) of every key for every query."""

    def __init__(self, spec: MLASpec, build, *, rngs: nnx.Rngs):
        """`spec`: its MLA layer's (the indexer's sizes, the RoPE); `build` a common.Build."""
        indexer = spec.indexer
        assert spec.q_lora_rank is not None and indexer is not None
        d, g, i = build.d_model, indexer.heads, indexer.head_dim
        pdt, std = build.param_dtype, build.init_std
        self.wq_b_qgi = param(rngs, (spec.q_lora_rank, g, i), std, (None, "heads", None), pdt)
        self.wk_di = param(rngs, (d, i), std, ("embed", None), pdt)
        self.k_norm_scale = nnx.Param(jnp.ones((i,), pdt), out_sharding=("norm",))
        self.k_norm_bias = nnx.Param(jnp.zeros((i,), pdt), out_sharding=("norm",))
        # transformers keeps weights_proj in float32 (_keep_in_fp32_modules): so is its product here
        self.w_weights_dg = param(rngs, (d, g), std, ("embed", "heads"), pdt)
        self.heads, self.head_dim, self.rope_dim = g, i, spec.rope_head_dim
        rope = spec.rope or RotarySpec()
        self.rope_theta, self.rope_scaling, self.interleave = rope.theta, rope.scaling, indexer.rope_interleave
        self.rope_last, self.key_norm_eps = indexer.rope_last, indexer.key_norm_eps  # HY-V4: the last dims, its eps
        self.dtype = build.dtype
        self.matmul_backward, self.dot_general = build.compute.matmul_backward, build.dot_general

    def _dense(self, x, w: nnx.Param, n_in: int = 1):
        return dense(x, w[...].astype(self.dtype), n_in, backward=self.matmul_backward, dot_general=self.dot_general)

    def _rope(self, x_btgi, positions_bt, max_position: int):
        """RoPE on the first rope_head_dim dimensions; interleaved pairs as mla.py rotates them
        (evens then odds, which leaves every dot product as transformers' order does)."""
        r = self.rope_dim
        x_rot = x_btgi[..., -r:] if self.rope_last else x_btgi[..., :r]
        if self.interleave:
            x_rot = jnp.concatenate([x_rot[..., 0::2], x_rot[..., 1::2]], axis=-1)
        inv_freq = rope_inverse_frequencies(r, self.rope_theta, self.rope_scaling)
        factor = 1.0 if self.rope_scaling is None else self.rope_scaling.yarn_attention_factor()
        x_rot = apply_rope(x_rot, positions_bt, inv_freq, factor, max_position)
        if self.rope_last:
            return jnp.concatenate([x_btgi[..., :-r], x_rot], axis=-1)
        return jnp.concatenate([x_rot, x_btgi[..., r:]], axis=-1)

    def keys(self, x_btd, positions_bt, max_position: int):
        """(b, t, i): each position's one key, LayerNorm-ed and rotated, in float32."""
        k_bti = self._dense(x_btd, self.wk_di).astype(jnp.float32)
        mean = jnp.mean(k_bti, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(k_bti - mean), axis=-1, keepdims=True)
        k_bti = (k_bti - mean) * jax.lax.rsqrt(var + self.key_norm_eps)
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

    @staticmethod
    def scores(q_btgi, weights_btg, k_bsi, visible_bts):
        """(b, t, s) float32: I[t, s] where visible, NEG_INF elsewhere."""
        return jnp.where(visible_bts, index_scores(q_btgi, weights_btg, k_bsi), NEG_INF)


def index_scores(q_btgi, weights_btg, k_bsi):
    """(b, t, s) float32: the indexer's I[t, s] of every key for every query."""
    logits_btgs = jnp.einsum("btgi,bsi->btgs", q_btgi, k_bsi.astype(jnp.float32)) * (q_btgi.shape[-1] ** -0.5)
    return jnp.einsum("btg,btgs->bts", weights_btg, jax.nn.relu(logits_btgs))


def top_k_indices(scores_bts, top_k: int, ties: str = "first", keys=None, first_b=None):
    """(b, t, top_k) int32: the keys of each query's top_k highest scores. Among keys tied with
    the k-th (ComputeConfig.indexer_ties): `first` the earlier ones (XLA's top_k), `torch_cpu`
    those torch.topk takes on CPU from the row as transformers' indexer holds it
    (engine/ops/torch_cpu_topk.py): keys [first_b, keys) of it (a traced (b,) and scalar; None:
    0 and s); decoding passes the cache's written slots from each row's first real token, as
    transformers' cache holds an unpadded prompt and what followed it."""
    scores_bts = jax.lax.stop_gradient(scores_bts)
    if ties == "first":
        return jax.lax.top_k(scores_bts, top_k)[1]
    b, t, s = scores_bts.shape
    first_b = jnp.zeros((b,), jnp.int32) if first_b is None else first_b
    at_bs = first_b[:, None] + jnp.arange(s)[None, :]  # the row from first_b on, NEG_INF after it
    rows_bts = jnp.where(
        (at_bs < s)[:, None], jnp.take_along_axis(scores_bts, jnp.minimum(at_bs, s - 1)[:, None], 2), NEG_INF
    )
    lengths_bt = jnp.broadcast_to(((s if keys is None else keys) - first_b)[:, None], (b, t))
    picked = jax.vmap(lambda row, n: torch_cpu_top_k(row, top_k, n))(rows_bts.reshape(b * t, s), lengths_bt.reshape(-1))
    return picked.reshape(b, t, top_k) + first_b[:, None, None]


def select_top_k(scores_bts, top_k: int, ties: str = "first", keys=None, first_b=None):
    """(b, t, s) bool: the top_k highest scores of each query (all keys if there are no more
    than top_k; ties as top_k_indices breaks them). Callers and it with the visible mask, so
    masked keys a short row fills its top_k with are never attended to."""
    b, t, s = scores_bts.shape
    if top_k >= s:
        return jnp.ones(scores_bts.shape, bool)
    index_btk = jnp.minimum(top_k_indices(scores_bts, top_k, ties, keys, first_b), s - 1)
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


QUERY_CHUNK_BYTES = 2**28
"""Bound per row on the float32 work tensors of one query chunk of sparse_attention (the
indexer's per-head scores of every key, the heads' scores of the selected ones): the chunk is
the largest power of two of queries (at most 512) that keeps them under it."""


def query_chunk(t: int, s: int, heads: int, index_heads: int, top_k: int) -> int:
    """Queries per chunk of sparse_attention: all t if they fit QUERY_CHUNK_BYTES."""
    per_query = 4 * max(index_heads * s, heads * top_k)
    chunk = 1
    while chunk < min(t, 512) and 2 * chunk * per_query <= QUERY_CHUNK_BYTES:
        chunk *= 2
    return min(chunk, t)


def sparse_attention(
    q_nope_btno,
    q_rope_btnr,
    latent_bsc,
    k_rope_bsr,
    w_kb_cno,
    w_vb_cnw,
    index_q_btgi,
    index_w_btg,
    index_k_bsi,
    *,
    scale: float,
    top_k: int,
    segments_bt=None,
    mask_bts=None,
    with_kl: bool = False,
    chunk: int | None = None,
    ties: str = "first",
    keys=None,
    first_b=None,
    sinks_n=None,
):
    """DeepSeek Sparse Attention's sparse path: ((b, t, n, w) output, the indexer's KL over
    the selected keys or None). Queries go in chunks (a lax.scan; each chunk rematerialised in
    the backward pass, so nothing of size t x top_k is kept): the chunk's indexer scores of
    every key (the O(t x s) part, in the indexer's i-wide heads), its top_k keys, then MLA over
    only those (engine/ops/sparse_mla.py). Visibility: `segments_bt` for training and prefill
    without a cache (t == s; causal, same segment, 0 padding), or the cache's `mask_bts`. The
    same selection and softmax as the dense-masked path (MLA._sparse); the KL as indexer_kl's,
    its target the attention probabilities the chunk computed (constants). `ties`, `keys` and
    `first_b`: top_k_indices'. `sinks_n`: MLA's attention sinks (HY-V4)."""
    b, t, n, _ = q_nope_btno.shape
    s = latent_bsc.shape[1]
    assert top_k < s and (segments_bt is None) != (mask_bts is None)
    chunk = chunk or query_chunk(t, s, n, index_q_btgi.shape[2], top_k)
    chunks = -(-t // chunk)
    pad = chunks * chunk - t
    valid_bt = jnp.ones((b, t), bool) if segments_bt is None else segments_bt != 0

    def chunked(x_bt, fill=0):  # (b, t, ...) -> (chunks, b, chunk, ...), padded queries see nothing
        x_bt = jnp.pad(x_bt, [(0, 0), (0, pad)] + [(0, 0)] * (x_bt.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x_bt.reshape(b, chunks, chunk, *x_bt.shape[2:]), 1, 0)

    xs = {
        "q_nope": chunked(q_nope_btno),
        "q_rope": chunked(q_rope_btnr),
        "index_q": chunked(index_q_btgi),
        "index_w": chunked(index_w_btg),
        "valid": chunked(valid_bt, False),
        "start": jnp.arange(chunks) * chunk,
    }
    if mask_bts is None:
        xs["segments"] = chunked(segments_bt, 0)
    else:
        xs["mask"] = chunked(mask_bts, False)
    index_k_f32 = index_k_bsi.astype(jnp.float32)

    def one_chunk(kl_sum, x):
        if mask_bts is None:  # causal by row index, as attention_mask: query `start + j` sees keys <= it
            rows_c = x["start"] + jnp.arange(chunk)
            visible_bcs = (jnp.arange(s)[None, :] <= rows_c[:, None])[None]
            visible_bcs = visible_bcs & (x["segments"][:, :, None] == segments_bt[:, None, :])
            visible_bcs = visible_bcs & (segments_bt != 0)[:, None, :]
        else:
            visible_bcs = x["mask"]
        selection = jax.lax.stop_gradient((x["index_q"], x["index_w"], index_k_f32))
        scores_bcs = jnp.where(visible_bcs, index_scores(*selection), NEG_INF)
        index_bck = jnp.minimum(top_k_indices(scores_bcs, top_k, ties, keys, first_b), s - 1)  # as select_top_k
        selected_bck = jnp.take_along_axis(visible_bcs, index_bck, axis=-1)
        out_bcnw, probs_bcnk = selected_latent_attention(
            x["q_nope"],
            x["q_rope"],
            latent_bsc,
            k_rope_bsr,
            index_bck,
            selected_bck,
            w_kb_cno,
            w_vb_cnw,
            scale=scale,
            sinks_n=sinks_n,
        )
        if with_kl:
            keys_bcki = gather_rows(index_k_f32, index_bck)
            logits_bcgk = jnp.einsum("bcgi,bcki->bcgk", x["index_q"], keys_bcki) * (keys_bcki.shape[-1] ** -0.5)
            index_bck_scores = jnp.einsum("bcg,bcgk->bck", x["index_w"], jax.nn.relu(logits_bcgk))
            target_bck = jnp.sum(jax.lax.stop_gradient(probs_bcnk), axis=2)
            target_bck = jnp.where(selected_bck, target_bck / jnp.sum(target_bck, axis=-1, keepdims=True), 0.0)
            log_q_bck = jax.nn.log_softmax(jnp.where(selected_bck, index_bck_scores, NEG_INF), axis=-1)
            safe_p = jnp.where(target_bck > 0, target_bck, 1.0)
            kl_bc = jnp.sum(jnp.where(target_bck > 0, target_bck * (jnp.log(safe_p) - log_q_bck), 0.0), axis=-1)
            kl_sum = kl_sum + jnp.sum(kl_bc * x["valid"])
        return kl_sum, out_bcnw

    kl_sum, out_xbcnw = jax.lax.scan(jax.checkpoint(one_chunk, prevent_cse=False), jnp.zeros((), jnp.float32), xs)
    out_btnw = jnp.moveaxis(out_xbcnw, 0, 1).reshape(b, chunks * chunk, *out_xbcnw.shape[3:])[:, :t]
    if not with_kl:
        return out_btnw, None
    return out_btnw, kl_sum / jnp.maximum(jnp.sum(valid_bt.astype(jnp.float32)), 1.0)

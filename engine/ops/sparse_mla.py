"""Multi-head latent attention over a few selected keys per query: the core of DeepSeek Sparse
Attention (engine/models/dsa.py), as DeepSeek-V3.2's sparse kernel (FlashMLA's sparse MLA)
computes it.

The key up-projection is absorbed into the query (q_o . W_uk c = (W_uk^T q_o) . c), so every
head reads the same keys: the compressed latent c and the shared rotary key of each selected
position, (c + r) numbers. A query's k selected rows are gathered once for all its heads, the
softmax runs over those k, and the value up-projection W_uv is applied after the weighted sum
of latents. Work and memory per query are proportional to k, not to the sequence.

Shapes: b batch, t queries, s keys, k selected keys per query, n heads, o the non-rotary
query width, r the rotary width, c the latent width, w the value head width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.ops.attention_reference import softmax_with_sinks

NEG_INF = -1e30  # finite: a query with no valid key (padding) stays finite, never NaN


def gather_rows(x_bsx, index_btk):
    """(b, t, k, x): row index_btk[b, t, j] of x_bsx[b] (its gradient a scatter-add)."""
    return jax.vmap(lambda rows_sx, index_tk: rows_sx[index_tk])(x_bsx, index_btk)


def selected_latent_attention(
    q_nope_btno,
    q_rope_btnr,
    latent_bsc,
    k_rope_bsr,
    index_btk,
    valid_btk,
    w_kb_cno,
    w_vb_cnw,
    *,
    scale: float,
    sinks_n=None,
):
    """((b, t, n, w) output in q's dtype, (b, t, n, k) float32 probabilities): each query's
    softmax over its selected keys (index_btk; the invalid ones, valid_btk False, masked out),
    scores (W_uk^T q_o) . c + q_r . k_r times `scale`; products in the inputs' dtype with
    float32 accumulation, the softmax in float32; `sinks_n` (n,): a logit per head in its
    denominator (HY-V4)."""
    f32, dtype = jnp.float32, q_nope_btno.dtype
    latent_btkc = gather_rows(latent_bsc.astype(dtype), index_btk)
    k_rope_btkr = gather_rows(k_rope_bsr.astype(dtype), index_btk)
    q_latent_btnc = jnp.einsum("btno,cno->btnc", q_nope_btno, w_kb_cno.astype(dtype), preferred_element_type=f32)
    scores_btnk = jnp.einsum(
        "btnc,btkc->btnk", q_latent_btnc.astype(dtype), latent_btkc, preferred_element_type=f32
    ) + jnp.einsum("btnr,btkr->btnk", q_rope_btnr.astype(dtype), k_rope_btkr, preferred_element_type=f32)
    scores_btnk = jnp.where(valid_btk[:, :, None], scores_btnk * scale, NEG_INF)
    probs_btnk = softmax_with_sinks(scores_btnk, None if sinks_n is None else sinks_n.astype(f32)[:, None])
    out_latent_btnc = jnp.einsum("btnk,btkc->btnc", probs_btnk.astype(dtype), latent_btkc, preferred_element_type=f32)
    out_btnw = jnp.einsum(
        "btnc,cnw->btnw", out_latent_btnc.astype(dtype), w_vb_cnw.astype(dtype), preferred_element_type=f32
    )
    return out_btnw.astype(dtype), probs_btnk

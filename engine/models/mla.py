"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, and DeepSeek-V3).

Keys and values of every head are up-projected from one compressed latent per position
(kv_lora_rank wide, RMS-normalised), and each key is that head's non-rotary part
concatenated with one rotary key shared by all heads (rope_head_dim wide, "decoupled RoPE").
Queries go through a low-rank bottleneck of their own (q_lora_rank, with an RMSNorm) or one
projection. Shapes as in transformer.py, plus c the latent (kv_lora_rank), r the rotary
width (rope_head_dim), o = head_dim - r the non-rotary width, w the value head width.

Training and prefill without a cache up-project the latent to full keys and values and use
the shared attention entry point (engine/ops/attention.py), the values zero-padded to the
query/key width, which every implementation there needs.

Decoding caches only the latent and the rotary key per position (engine/models/kv_cache.py:
k holds the latent, v the rotary key, one "head" each), (c + r) numbers where grouped-query
attention would keep 2 * heads * head_dim, and attends in the absorbed form: the key
up-projection is folded into the query (q_o . W_uk c = (W_uk^T q_o) . c) and the value
up-projection applied after the weighted sum of latents, so no per-head key or value is
ever materialised over the cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from engine.config import ConfigError
from engine.models.common import Build, RMSNorm, param
from engine.models.dsa import Indexer, indexer_kl, select_top_k, sparse_attention
from engine.models.kv_cache import KVCache
from engine.models.lora import MLA_WEIGHTS, adapted_weight, add_adapters, has_adapter, project
from engine.models.rope import apply_rope, rope_inverse_frequencies
from engine.models.specs import MLASpec, RotarySpec
from engine.ops.attention import attention
from engine.ops.attention_reference import attention_mask, dot_product_attention, softmax_with_sinks
from engine.ops.dense import dense
from engine.ops.partitioning import constrain

NEG_INF = -1e30  # finite, as engine/ops/attention_reference.py's: a fully masked (padding) row stays finite


class MLA(nnx.Module):
    """Multi-head latent attention, called as transformer.Attention is."""

    def __init__(self, spec: MLASpec, build: Build, *, rngs: nnx.Rngs):
        d, n, h, r = build.d_model, spec.num_heads, spec.head_dim, spec.rope_head_dim
        c, w = spec.kv_lora_rank, spec.value_head_dim
        pdt, std = build.param_dtype, build.init_std
        if spec.q_lora_rank:
            self.wq_a_dq = param(rngs, (d, spec.q_lora_rank), std, ("embed", None), pdt)
            self.q_norm = RMSNorm(spec.q_lora_rank, spec.latent_norm_eps, pdt, rngs=rngs)
            self.wq_b_qnh = param(rngs, (spec.q_lora_rank, n, h), std, (None, "heads", "head_dim"), pdt)
        else:
            self.wq_dnh = param(rngs, (d, n, h), std, ("embed", "heads", "head_dim"), pdt)
        # The latent and the shared rotary key come out of one projection (HF's kv_a_proj_with_mqa).
        self.wkv_a_dx = param(rngs, (d, c + r), std, ("embed", None), pdt)
        self.kv_norm = RMSNorm(c, spec.latent_norm_eps, pdt, rngs=rngs)
        if spec.key_norm_eps is not None:  # Dots3: the shared rotary key normed before RoPE
            self.k_rope_norm = RMSNorm(r, spec.key_norm_eps, pdt, rngs=rngs)
        # Per head, the non-rotary key then the value (HF's kv_b_proj).
        self.wkv_b_cny = param(rngs, (c, n, h - r + w), std, (None, "heads", "head_dim"), pdt)
        self.wo_nwd = param(rngs, (n, w, d), build.out_std, ("heads", "head_dim", "embed"), pdt)
        if spec.head_gate:  # Ling 3, Dots3: a sigmoid gate per head from the layer's input
            self.w_head_gate_dn = param(rngs, (d, n), std, ("embed", "heads"), pdt)
        if spec.sinks:  # HY-V4: a logit per head in the softmax's denominator
            self.sinks_n = nnx.Param(jnp.zeros((n,), pdt), out_sharding=("heads",))
        if spec.output_gate:  # HY-V4: sigmoid(x . W_gate) per head and value dimension on the output
            self.w_gate_dnw = param(rngs, (d, n, w), std, ("embed", "heads", "head_dim"), pdt)
        self.q_lora = spec.q_lora_rank is not None
        self.nope_dim, self.rope_dim, self.latent_dim, self.value_dim = h - r, r, c, w
        self.scale = spec.score_scale  # the same for every layer of a model
        self.dtype = build.dtype
        compute = build.compute
        self.attention_impl, self.attention_block = compute.attention_impl, compute.attention_block
        self.matmul_backward, self.dot_general = compute.matmul_backward, build.dot_general
        self.index_topk = None if spec.indexer is None else spec.indexer.topk  # DeepSeek Sparse Attention (dsa.py)
        # GLM-5's shared layers have no indexer: they select with the last earlier indexer's state
        self.index_shared = spec.indexer is not None and spec.indexer.shared
        if self.index_shared and compute.indexer_loss != "none":
            raise ConfigError(
                f"compute.indexer_loss {compute.indexer_loss} is not supported with model.index_shared_layers "
                "(layers that reuse another layer's selection): use indexer_loss none"
            )
        if spec.indexer is not None and not self.index_shared:
            self.indexer = Indexer(spec, build, rngs=rngs)
        self.indexer_loss = compute.indexer_loss if spec.indexer is not None else "none"
        self.indexer_ties = compute.indexer_ties
        add_adapters(self, MLA_WEIGHTS, build, rngs)

    def _dense(self, x, attr: str, n_in: int = 1):
        """x . the weight `attr` (+ its LoRA update, if adapted). lora.project reads the weight
        with weight_value: a QLoRA base holds a query projection without q_lora (wq_dnh, the name
        attention's query has) quantized, as it holds every attention projection it names."""
        return project(self, attr, x, n_in, self.dtype, backward=self.matmul_backward, dot_general=self.dot_general)

    def _output(self, out_btnw, x_btd, spec: MLASpec, gate_btn=None):
        """o_proj of the heads' outputs (b, t, n, w), gated first where the spec says: per head
        (gate_btn, Ling 3's head gate) or per head and value dimension (HY-V4's output gate)."""
        if gate_btn is not None:
            out_btnw = out_btnw * gate_btn[..., None]
        if spec.output_gate:
            gate_btnw = jax.nn.sigmoid(self._dense(x_btd, "w_gate_dnw").astype(jnp.float32))
            out_btnw = (out_btnw.astype(jnp.float32) * gate_btnw).astype(out_btnw.dtype)
        return self._dense(out_btnw, "wo_nwd", 2)

    def _rope(self, x_btnr, positions_bt, max_position: int, rope: RotarySpec):
        """RoPE on the rotary part; interleaved checkpoints rotate pairs (x0, x1), (x2, x3), ...,
        which is the half-split rotation of the evens followed by the odds (transformers'
        apply_rotary_pos_emb_interleave returns that order too)."""
        if rope.interleave:
            x_btnr = jnp.concatenate([x_btnr[..., 0::2], x_btnr[..., 1::2]], axis=-1)
        inv_freq = rope_inverse_frequencies(self.rope_dim, rope.theta, rope.scaling)
        factor = 1.0 if rope.scaling is None else rope.scaling.yarn_attention_factor()
        return apply_rope(x_btnr, positions_bt, inv_freq, factor, max_position)

    def __call__(
        self, x_btd, positions_bt, segment_ids_bt, spec: MLASpec, cache: KVCache | None = None, index_state=None
    ):
        """As transformer.Attention: `spec` (static) is the layer's: its window slides; without
        RoPE the rotary part stays unrotated (Kimi Linear's MLA); with a cache (decoding) returns
        (out, updated cache). With a training indexer loss (dsa.py) and no cache: (out, the
        indexer's KL). Given an `index_state` (a model with shared indexer layers, whose layers
        pass it on): (that, the state for the next layer), the state the last indexer's (queries
        (b, t, g, i), head weights (b, t, g), keys (b, t or s, i)): a layer with an indexer
        passes its own on, a shared one selects with the state it got and passes it on."""
        gate_btn = None
        if spec.head_gate:  # sigmoid(x . w) per head, on the heads' outputs before wo
            gate_btn = jax.nn.sigmoid(self._dense(x_btd, "w_head_gate_dn").astype(jnp.float32)).astype(self.dtype)
        result, index_state = self._call(x_btd, positions_bt, segment_ids_bt, spec, cache, index_state, gate_btn)
        return result if index_state is None else (result, index_state)

    def _call(self, x_btd, positions_bt, segment_ids_bt, spec: MLASpec, cache, index_state, gate_btn=None):
        """__call__'s (result, index_state, None where none was given)."""
        o, r, c = self.nope_dim, self.rope_dim, self.latent_dim
        rope = spec.rope
        rotate = (lambda x, *a: self._rope(x, *a, rope)) if rope is not None else (lambda x, *_: x)
        if self.q_lora:
            q_latent_btq = self.q_norm(self._dense(x_btd, "wq_a_dq"))
            q_btnh = self._dense(q_latent_btq, "wq_b_qnh")
        else:
            q_btnh = self._dense(x_btd, "wq_dnh")
        if spec.lora_scale and self.q_lora:  # LongCat-Flash: sqrt(d / q_lora_rank)
            q_btnh = q_btnh * jnp.asarray((x_btd.shape[-1] / spec.q_lora_rank) ** 0.5, q_btnh.dtype)
        q_btnh = constrain(q_btnh, ("act_batch", "act_seq", "act_heads", None))
        max_position = positions_bt.shape[1] if cache is None else cache.length  # RoPE's table (rope.py)
        q_nope, q_rope = q_btnh[..., :o], rotate(q_btnh[..., o:], positions_bt, max_position)
        kv_btx = self._dense(x_btd, "wkv_a_dx")
        latent_btc = self.kv_norm(kv_btx[..., :c])
        if spec.lora_scale:  # LongCat-Flash: sqrt(d / kv_lora_rank)
            latent_btc = latent_btc * jnp.asarray((x_btd.shape[-1] / c) ** 0.5, latent_btc.dtype)
        k_rope_bt1r = kv_btx[..., None, c:]
        if spec.key_norm_eps is not None:  # Dots3
            k_rope_bt1r = self.k_rope_norm(k_rope_bt1r)
        k_rope_bt1r = rotate(k_rope_bt1r, positions_bt, max_position)
        window = spec.window
        sinks_n = self.sinks_n[...] if spec.sinks else None  # HY-V4
        wkv_b_cny = self.wkv_b_cny[...]
        if has_adapter(self, "wkv_b_cny"):  # read as a matrix (absorbed): its update folded in
            wkv_b_cny = adapted_weight(self, "wkv_b_cny", 1, wkv_b_cny.dtype)
        w_kb_cno, w_vb_cnw = wkv_b_cny[..., :o], wkv_b_cny[..., o:]
        passes_on = index_state is not None
        if self.index_shared:  # the last earlier indexer's queries, head weights and keys
            index_q_btgi, index_w_btg, index_k_bti = index_state
        elif self.index_topk is not None:  # its inputs detached: only its KL trains it (dsa.py)
            index_x_btd, index_q_btq = jax.lax.stop_gradient(x_btd), jax.lax.stop_gradient(q_latent_btq)
            if spec.lora_scale:  # Dots3 scales the compressed query before its indexer reads it too
                index_q_btq = index_q_btq * jnp.asarray((x_btd.shape[-1] / spec.q_lora_rank) ** 0.5, index_q_btq.dtype)
            index_q_btgi, index_w_btg = self.indexer.queries(index_x_btd, index_q_btq, positions_bt, max_position)
            index_k_bti = self.indexer.keys(index_x_btd, positions_bt, max_position)
        if cache is not None:
            latent_bs1c, k_rope_bs1r, mask_bts, cache = cache.update(latent_btc[:, :, None], k_rope_bt1r, window=window)
            if self.index_topk is not None:
                if self.index_shared:  # decoding: the state's keys are that indexer's cached ones
                    index_k_bsi = index_k_bti
                else:
                    index_k_bsi, cache = cache.update_index(index_k_bti)
                if passes_on:
                    index_state = (index_q_btgi, index_w_btg, index_k_bsi)
                first_b = None  # torch_cpu ties: each row from its first real token (dsa.top_k_indices)
                if self.indexer_ties == "torch_cpu":
                    first_b = jnp.argmax(jnp.any(mask_bts, axis=1), axis=-1)
                if self._gathers(mask_bts.shape[2]):  # the selected keys only (dsa.sparse_attention)
                    out_btnw, _ = sparse_attention(
                        q_nope,
                        q_rope,
                        latent_bs1c[:, :, 0],
                        k_rope_bs1r[:, :, 0],
                        w_kb_cno,
                        w_vb_cnw,
                        index_q_btgi,
                        index_w_btg,
                        index_k_bsi,
                        scale=self.scale,
                        top_k=self.index_topk,
                        mask_bts=mask_bts,
                        ties=self.indexer_ties,
                        keys=cache.end + x_btd.shape[1],
                        first_b=first_b,
                        sinks_n=sinks_n,
                    )
                    return (self._output(out_btnw, x_btd, spec, gate_btn), cache), index_state
                scores_bts = Indexer.scores(index_q_btgi, index_w_btg, index_k_bsi, mask_bts)
                keys = cache.end + x_btd.shape[1]
                mask_bts = mask_bts & select_top_k(scores_bts, self.index_topk, self.indexer_ties, keys, first_b)
            out_btnw = self._absorbed(
                q_nope,
                q_rope,
                latent_bs1c[:, :, 0],
                k_rope_bs1r[:, :, 0],
                mask_bts,
                w_kb_cno.astype(self.dtype),
                w_vb_cnw.astype(self.dtype),
                sinks_n,
            )
            return (self._output(out_btnw, x_btd, spec, gate_btn), cache), index_state
        if self.index_topk is not None and passes_on:
            index_state = (index_q_btgi, index_w_btg, index_k_bti)
        if self.index_topk is not None and self.indexer_loss != "warmup" and self._gathers(x_btd.shape[1]):
            segments_bt = jnp.ones(x_btd.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt
            out_btnw, kl = sparse_attention(
                q_nope,
                q_rope,
                latent_btc,
                k_rope_bt1r[:, :, 0],
                w_kb_cno,
                w_vb_cnw,
                index_q_btgi,
                index_w_btg,
                index_k_bti,
                scale=self.scale,
                top_k=self.index_topk,
                segments_bt=segments_bt,
                with_kl=self.indexer_loss == "sparse",
                ties=self.indexer_ties,
                sinks_n=sinks_n,
            )
            out_btd = self._output(out_btnw, x_btd, spec, gate_btn)
            return (out_btd if kl is None else (out_btd, kl)), index_state
        kv_btny = dense(
            latent_btc, wkv_b_cny.astype(self.dtype), backward=self.matmul_backward, dot_general=self.dot_general
        )
        k_btnh = jnp.concatenate([kv_btny[..., :o], jnp.broadcast_to(k_rope_bt1r, (*q_nope.shape[:3], r))], axis=-1)
        q_btnh = checkpoint_name(jnp.concatenate([q_nope, q_rope], axis=-1), "qkv_proj")
        k_btnh = checkpoint_name(constrain(k_btnh, ("act_batch", "act_seq", "act_heads", None)), "qkv_proj")
        v_btnw = checkpoint_name(kv_btny[..., o:], "qkv_proj")
        w, h = self.value_dim, o + r
        if w < h:  # one width for q, k and v: every attention implementation needs it
            v_btnw = jnp.pad(v_btnw, ((0, 0), (0, 0), (0, 0), (0, h - w)))
        elif w > h:  # zeros on q and k leave the scores as they are
            q_btnh, k_btnh = (jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, w - h))) for a in (q_btnh, k_btnh))
        if self.index_topk is not None:
            out = self._sparse(
                q_btnh, k_btnh, v_btnw, segment_ids_bt, index_q_btgi, index_w_btg, index_k_bti, w, x_btd, spec, gate_btn
            )
            return out, index_state
        with jax.named_scope("core"):
            out_btnh = attention(
                q_btnh,
                k_btnh,
                v_btnw,
                segment_ids_bt,
                impl=self.attention_impl,
                scale=self.scale,
                window=window,
                local=window is not None,
                block=self.attention_block,
                sinks_n=sinks_n,
            )
        return self._output(out_btnh[..., :w], x_btd, spec, gate_btn), index_state

    def _gathers(self, keys: int) -> bool:
        """Whether sparse attention gathers each query's selected keys (dsa.sparse_attention)
        over `keys` positions: when top-k drops some, unless attention_impl is `reference`,
        which keeps the dense-masked path (MLA._sparse, _absorbed's mask) the tests compare to."""
        return self.index_topk is not None and self.index_topk < keys and self.attention_impl != "reference"

    def _sparse(
        self,
        q_btnh,
        k_btnh,
        v_btnh,
        segment_ids_bt,
        index_q_btgi,
        index_w_btg,
        index_k_bti,
        w: int,
        x_btd,
        spec,
        gate_btn=None,
    ):
        """Training and prefill with the indexer: each query attends to its top-k visible keys
        over an explicit mask. Dense where no query can see more than index_topk keys (the
        selection keeps them all) and in the indexer's dense warm-up; the indexer's KL
        returned beside the output when it trains."""
        t, top_k = q_btnh.shape[1], self.index_topk
        assert top_k is not None
        segments_bt = jnp.ones(q_btnh.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt
        dense = t <= top_k or self.indexer_loss == "warmup"
        sinks_n = self.sinks_n[...] if spec.sinks else None  # HY-V4
        visible_bts = attention_mask(segments_bt, segments_bt)
        if dense and self.indexer_loss == "none":
            scores_bts = None
        else:
            scores_bts = Indexer.scores(index_q_btgi, index_w_btg, index_k_bti, visible_bts)
        with jax.named_scope("core"):
            if dense:
                out_btnh = attention(
                    q_btnh,
                    k_btnh,
                    v_btnh,
                    segment_ids_bt,
                    impl=self.attention_impl,
                    scale=self.scale,
                    block=self.attention_block,
                    sinks_n=sinks_n,
                )
                selected_bts = visible_bts
            else:
                selected_bts = visible_bts & select_top_k(scores_bts, top_k, self.indexer_ties)
                out_btnh = dot_product_attention(
                    q_btnh, k_btnh, v_btnh, selected_bts, scale=self.scale, sinks_n=sinks_n
                )
        out_btd = self._output(out_btnh[..., :w], x_btd, spec, gate_btn)
        if self.indexer_loss == "none":
            return out_btd
        return out_btd, indexer_kl(q_btnh, k_btnh, self.scale, selected_bts, scores_bts, segments_bt != 0)

    def _absorbed(self, q_nope_btno, q_rope_btnr, latent_bsc, k_rope_bsr, mask_bts, w_kb_cno, w_vb_cnw, sinks_n=None):
        """Attention over the compressed cache, softmax in float32: scores are (W_uk^T q_o) . c
        + q_r . k_r, the output W_uv (sum_s p_s c_s)."""
        f32 = jnp.float32
        q_latent_btnc = jnp.einsum("btno,cno->btnc", q_nope_btno, w_kb_cno, preferred_element_type=f32)
        scores_bnts = jnp.einsum("btnc,bsc->bnts", q_latent_btnc, latent_bsc.astype(f32)) + jnp.einsum(
            "btnr,bsr->bnts", q_rope_btnr.astype(f32), k_rope_bsr.astype(f32)
        )
        scores_bnts = jnp.where(mask_bts[:, None], scores_bnts * self.scale, NEG_INF)
        sinks = None if sinks_n is None else sinks_n.astype(f32)[None, :, None, None]  # HY-V4
        probs_bnts = softmax_with_sinks(scores_bnts, sinks)
        out_latent_btnc = jnp.einsum("bnts,bsc->btnc", probs_bnts, latent_bsc.astype(f32))
        out_btnw = jnp.einsum("btnc,cnw->btnw", out_latent_btnc, w_vb_cnw.astype(f32))
        return out_btnw.astype(self.dtype)

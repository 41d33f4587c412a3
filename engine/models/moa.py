"""A mixture of attention heads (JetMoE, arXiv 2404.07413): the keys and values are one
grouped-query projection's, while each token's queries and output projection come from k of
E expert pairs, chosen by a router (softmax over the k best logits). Expert slot s of a token
gives num_kv_heads query heads, head j attending with KV head j; the k slots' outputs go
through their experts' output projections, weighted by the router, summed, plus a bias.

Here the heads are ordered KV-major (head j * k + s), so the attention is grouped-query
attention of num_kv_heads * k heads over num_kv_heads (engine/ops/attention.py), the KV cache
that of such a layer. Every expert's projection is computed and each token's k are taken from
them: E / k times the projection work of a gathered form, simple and exact.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import Build, param
from engine.models.kv_cache import KVCache
from engine.models.lora import ATTENTION_WEIGHTS, add_adapters, has_adapter, project_shared
from engine.models.rope import layer_rotary, rotate_heads
from engine.models.specs import MixtureOfAttentionSpec
from engine.ops.attention import attention, decode_attention
from engine.ops.partitioning import constrain


class MixtureOfAttention(nnx.Module):
    def __init__(self, spec: MixtureOfAttentionSpec, build: Build, *, rngs: nnx.Rngs):
        a = spec.attention
        d, e, kv, h = build.d_model, spec.num_experts, a.num_kv_heads, a.head_dim
        pdt, std = build.param_dtype, build.init_std
        # HF's (E, out, in) experts, last two axes swapped: input_linear (E, kv h, d), output_linear (E, d, kv h)
        self.w_router_de = param(rngs, (d, e), std, ("embed", None), pdt)
        self.wq_edq = param(rngs, (e, d, kv * h), std, ("expert", "embed", "heads"), pdt)
        self.wk_dkh = param(rngs, (d, kv, h), std, ("embed", "kv_heads", "head_dim"), pdt)
        self.wv_dkh = param(rngs, (d, kv, h), std, ("embed", "kv_heads", "head_dim"), pdt)
        self.wo_eqd = param(rngs, (e, kv * h, d), build.out_std, ("expert", "heads", "embed"), pdt)
        self.bo_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("embed",))
        self.dtype, self.compute = build.dtype, build.compute
        add_adapters(self, ATTENTION_WEIGHTS, build, rngs)  # kv_proj (the experts' projections take none)

    def __call__(
        self, x_btd, positions_bt, segment_ids_bt, spec: MixtureOfAttentionSpec, cache: KVCache | None = None, **extra
    ):
        """`extra`: the attention's (cos, sin) as `rotary`, if the caller computed them."""
        dt, a, k = self.dtype, spec.attention, spec.experts_per_token
        b, t, _ = x_btd.shape
        kv, h = a.num_kv_heads, a.head_dim
        logits_bte = jnp.einsum("btd,de->bte", x_btd.astype(jnp.float32), self.w_router_de[...].astype(jnp.float32))
        top_btk, experts_btk = jax.lax.top_k(logits_bte, k)
        gates_btk = jax.nn.softmax(top_btk, axis=-1).astype(dt)
        q_bteq = jnp.einsum("btd,edq->bteq", x_btd, self.wq_edq[...].astype(dt))
        q_btkq = jnp.take_along_axis(q_bteq, experts_btk[..., None], axis=2)
        # slot s's head j -> head j * k + s: KV head j's group
        q = q_btkq.reshape(b, t, k, kv, h).transpose(0, 1, 3, 2, 4).reshape(b, t, kv * k, h)
        if has_adapter(self, "wk_dkh"):  # kv_proj's LoRA update (one A for k and v)
            key, value = project_shared(self, ("wk_dkh", "wv_dkh"), x_btd, dt, backward=self.compute.matmul_backward)
        else:
            key = jnp.einsum("btd,dkh->btkh", x_btd, self.wk_dkh[...].astype(dt))
            value = jnp.einsum("btd,dkh->btkh", x_btd, self.wv_dkh[...].astype(dt))
        if a.rope is not None:
            rotary = extra.get("rotary")
            if rotary is None:
                max_position = positions_bt.shape[1] if cache is None else cache.length
                rotary = layer_rotary(positions_bt, a.rope, h, max_position)
            q, key = rotate_heads(q, a.rope, rotary), rotate_heads(key, a.rope, rotary)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
        if cache is None:
            out_btnh = attention(
                q,
                key,
                value,
                segment_ids_bt,
                impl=self.compute.attention_impl,
                scale=a.score_scale,
                softcap=a.softcap,
                window=a.window,
                local=a.window is not None,
                block=self.compute.attention_block,
            )
        else:
            key, value, mask, cache = cache.update(key, value, window=a.window, raw=True)
            out_btnh = decode_attention(
                q,
                key,
                value,
                mask,
                impl=self.compute.decode_attention_impl,
                scale=a.score_scale,
                softcap=a.softcap,
                shared=cache.shared_prefix(window=a.window, raw=True),
            )
        out_btkq = out_btnh.reshape(b, t, kv, k, h).transpose(0, 1, 3, 2, 4).reshape(b, t, k, kv * h)
        out_btked = jnp.einsum("btkq,eqd->btked", out_btkq, self.wo_eqd[...].astype(dt))
        out_btkd = jnp.take_along_axis(out_btked, experts_btk[..., None, None], axis=3)[:, :, :, 0]
        out_btd = jnp.einsum("btkd,btk->btd", out_btkd, gates_btk) + self.bo_d[...].astype(dt)
        out_btd = constrain(out_btd, ("act_batch", "act_seq", "act_embed"))
        return out_btd if cache is None else (out_btd, cache)

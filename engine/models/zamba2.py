"""Zamba2's hybrid layers (Zyphra; transformers' zamba2): a backbone of Mamba2 layers, some of
which first call a shared attention + MLP block, whose parameters the model holds once (or
`shared_blocks` times, called in turn) and every call reuses with low-rank adapters of its own:

    s = mlp(norm2(attention(norm1([x, e]))))     e: the token embeddings, [x, e] (b, t, 2 d)
    x = x + mamba2(norm(x + linear(s)))

The attention reads the 2 d-wide join of the stream and the embeddings (heads of 2 d / heads,
scores scaled by (head_dim / 2)^-1/2, RoPE where use_mem_rope); its q, k, v projections each
add this call's adapter up(down(input)) where use_shared_attention_adapter, and the MLP's gate
and up projection always does (transformers' *_adapter_list[call]). Neither sublayer has a
residual of its own. `linear` is the layer's own (d, d).

The layer kind is `zamba2_hybrid` (ModelConfig.mixer_pattern), each such layer a stack of its
own (its adapters' names carry its call's index). This module's `Zamba2Hybrid` is its mixer: the
layer's own parameters (the Mamba2 mixer, its norm, linear, the adapters); `SharedBlock` is one
shared block, a model-level module (transformer.Transformer's `zamba2_shared_{b}`), which the
decoder passes to each hybrid layer's call with the embeddings (`zamba`). Decoding keeps the
shared attention's keys and values of each call in its layer's KV slots and the Mamba2 state
beside them (kv_cache.KEYS_AND_STATE). Shapes: b batch, t time, d model width, x = 2 d the
joined width, f heads x head_dim, r the adapter rank, m the MLP width.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from engine.models.common import ACTIVATIONS, Build, make_norm, param
from engine.models.kv_cache import DECODE_STATES, KEYS_AND_STATE, KVCache
from engine.models.mamba2 import Mamba2
from engine.models.mamba2 import decode_state as mamba2_decode_state
from engine.models.rope import layer_rotary, rotate_heads
from engine.models.specs import Zamba2HybridSpec
from engine.ops.attention import attention, decode_attention
from engine.ops.dense import dense

nnx.use_eager_sharding(False)  # placed by engine/models/params.py, as transformer.py's layers

DECODE_STATES["zamba2_hybrid"] = lambda spec, compute, batch: mamba2_decode_state(spec.mamba2, compute, batch)
KEYS_AND_STATE.add("zamba2_hybrid")  # the shared attention's keys and values too


MLP_ADAPTER = ("gate_up_adapter_down_dr", "gate_up_adapter_up_rm")


class SharedBlock(nnx.Module):
    """One shared attention + MLP block (transformers' Zamba2AttentionDecoderLayer without its
    adapters): the join's norm, q, k, v from 2 d, o to d, the MLP's norm, its gate and up
    projection fused (as transformers stores it: gate then up) and down."""

    def __init__(self, spec: Zamba2HybridSpec, build: Build, *, rngs: nnx.Rngs):
        d, a, pdt, std = build.d_model, spec.attention, build.param_dtype, build.init_std
        q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        self.input_norm = make_norm(spec.norm, 2 * d, pdt, rngs=rngs)
        self.wq_xf = param(rngs, (2 * d, q_width), std, ("embed", "mlp"), pdt)
        self.wk_xf = param(rngs, (2 * d, kv_width), std, ("embed", "mlp"), pdt)
        self.wv_xf = param(rngs, (2 * d, kv_width), std, ("embed", "mlp"), pdt)
        self.wo_fd = param(rngs, (q_width, d), build.out_std, ("mlp", "embed"), pdt)
        self.mlp_norm = make_norm(spec.norm, d, pdt, rngs=rngs)
        self.w_gate_up_dm = param(rngs, (d, 2 * spec.mlp_dim), std, ("embed", "mlp"), pdt)
        self.w_down_md = param(rngs, (spec.mlp_dim, d), build.out_std, ("mlp", "embed"), pdt)


class Zamba2Hybrid(nnx.Module):
    """A hybrid layer's own parameters and its call (transformer.MIXERS' zamba2_hybrid): called
    as transformer.Attention is, on the un-normed stream (the layer has no pre-norm), with the
    decoder's `zamba` = (each shared block as nnx.split gives it, the embeddings (b, t, d))."""

    def __init__(self, spec: Zamba2HybridSpec, build: Build, *, rngs: nnx.Rngs):
        d, a, r, pdt, std = build.d_model, spec.attention, spec.adapter_rank, build.param_dtype, build.init_std
        self.mamba = Mamba2.of_spec(spec.mamba2, build, rngs=rngs)
        self.mamba_norm = make_norm(spec.norm, d, pdt, rngs=rngs)
        self.w_linear_dd = param(rngs, (d, d), std, ("embed", None), pdt)
        if spec.attention_adapters:
            q_width, kv_width = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
            for name, width in (("q", q_width), ("k", kv_width), ("v", kv_width)):
                setattr(self, f"{name}_adapter_down_xr", param(rngs, (2 * d, r), std, ("embed", None), pdt))
                setattr(self, f"{name}_adapter_up_rf", param(rngs, (r, width), std, (None, "mlp"), pdt))
        self.gate_up_adapter_down_dr = param(rngs, (d, r), std, ("embed", None), pdt)
        self.gate_up_adapter_up_rm = param(rngs, (r, 2 * spec.mlp_dim), std, (None, "mlp"), pdt)
        self.dtype, self.compute, self.dot_general = build.dtype, build.compute, build.dot_general

    def _dense(self, x, w):
        return dense(x, w.astype(self.dtype), backward=self.compute.matmul_backward, dot_general=self.dot_general)

    def _adapted(self, x, w, down: str, up: str):
        """x . w plus this call's adapter: x . down . up."""
        return self._dense(x, w[...]) + self._dense(self._dense(x, getattr(self, down)[...]), getattr(self, up)[...])

    def __call__(
        self,
        x_btd,
        positions_bt,
        segment_ids_bt,
        spec: Zamba2HybridSpec,
        cache: KVCache | None = None,
        *,
        zamba,
        rotary=None,
    ):
        blocks, embeds_btd = zamba
        shared = nnx.merge(*blocks[spec.block])
        dt = self.dtype
        joined_btx = shared.input_norm(jnp.concatenate([x_btd, embeds_btd.astype(x_btd.dtype)], axis=-1).astype(dt))
        a = spec.attention
        adapters = spec.attention_adapters
        projections = []
        for name, w in (("q", shared.wq_xf), ("k", shared.wk_xf), ("v", shared.wv_xf)):
            adapted = (f"{name}_adapter_down_xr", f"{name}_adapter_up_rf")
            out = self._adapted(joined_btx, w, *adapted) if adapters else self._dense(joined_btx, w[...])
            projections.append(out)
        b, t = x_btd.shape[:2]
        q = projections[0].reshape(b, t, a.num_heads, a.head_dim)
        k, v = (p.reshape(b, t, a.num_kv_heads, a.head_dim) for p in projections[1:])
        if a.rope is not None:
            if rotary is None:
                rotary = layer_rotary(positions_bt, a.rope, a.head_dim, t if cache is None else cache.length)
            q, k = rotate_heads(q, a.rope, rotary), rotate_heads(k, a.rope, rotary)
        if cache is None:
            out_btnh = attention(q, k, v, segment_ids_bt, impl=self.compute.attention_impl, scale=a.score_scale)
        else:
            k_all, v_all, mask, cache = cache.update(k, v, raw=True)
            shared_prefix = cache.shared_prefix(raw=True)  # a group's prompt (KVCache.share)
            impl = self.compute.decode_attention_impl
            out_btnh = decode_attention(q, k_all, v_all, mask, impl=impl, scale=a.score_scale, shared=shared_prefix)
        attended_btd = self._dense(out_btnh.reshape(b, t, -1), shared.wo_fd[...])
        normed_btd = shared.mlp_norm(attended_btd)
        gate_btm, up_btm = jnp.split(self._adapted(normed_btd, shared.w_gate_up_dm, *MLP_ADAPTER), 2, axis=-1)
        activation = ACTIVATIONS[spec.activation]
        hidden_btm = (activation(gate_btm.astype(jnp.float32)) * up_btm.astype(jnp.float32)).astype(dt)
        shared_btd = self._dense(hidden_btm, shared.w_down_md[...])
        mamba_in_btd = self.mamba_norm(x_btd + self._dense(shared_btd, self.w_linear_dd[...]).astype(x_btd.dtype))
        return self.mamba(mamba_in_btd, positions_bt, segment_ids_bt, spec.mamba2, cache)


def shared_blocks(cfg, build: Build, *, rngs: nnx.Rngs) -> list[SharedBlock]:
    """The model's shared blocks (Zamba2Config.shared_blocks), built from its first hybrid layer's spec."""
    spec = next(s.mixer for s in cfg.layer_specs() if isinstance(s.mixer, Zamba2HybridSpec))
    return [SharedBlock(spec, build, rngs=rngs) for _ in range(cfg.zamba2.shared_blocks)]

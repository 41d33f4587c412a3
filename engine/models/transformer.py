"""The decoder-only transformer, in Flax NNX.

One implementation, built and run from typed layer specs (engine/models/specs.py; a model's
are ModelConfig.layer_specs()): no model family is named here. Shapes are in names: b batch,
t query positions, s key positions, d d_model, n query heads, k kv heads, g query heads per
kv head, h head_dim, f mlp_dim, v vocab.

Every parameter carries logical axis names (its `sharding_names` metadata) that
engine/ops/partitioning.py maps to mesh axes; activations are constrained at block boundaries.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from engine.config import ConfigError
from engine.models import hash_routing
from engine.models.altup import AltUp, AltUpStreams, altup_layer
from engine.models.block_sparse import BlockIndexer, masked_attention, selected_blocks
from engine.models.common import ACTIVATIONS, Build, dtype_of, make_norm, param
from engine.models.compressed_attention import CompressedAttention
from engine.models.config import ComputeConfig, LoraConfig, ModelConfig
from engine.models.dsa import WithIndexerLoss
from engine.models.gated_delta_block import GatedDeltaNet
from engine.models.gated_residual import GatedResidual, gated_residual_layer
from engine.models.hyper_connection import HyperConnection, HyperHead, hyper_layer, streams_of
from engine.models.kimi_delta_block import KimiDeltaAttention
from engine.models.kv_cache import KVCache
from engine.models.laurel import Laurel
from engine.models.lightning import LightningAttention
from engine.models.lora import (
    ATTENTION_WEIGHTS,
    MLP_WEIGHTS,
    MODEL_WEIGHTS,
    PER_LAYER_INPUT_WEIGHTS,
    add_adapters,
    has_adapter,
    in_layer,
    project,
    project_shared,
    weight_value,
)
from engine.models.mamba1 import Mamba1
from engine.models.mamba2 import Mamba2
from engine.models.mla import MLA
from engine.models.moa import MixtureOfAttention
from engine.models.moe import MoE, MoEStats, clamped_swiglu, combine_stats
from engine.models.mtp import MTPHead, mtp_loss
from engine.models.ngram_embedding import NGramEmbedding
from engine.models.parallel_hybrid import AttentionMamba2
from engine.models.qsa import QSAIndexer, qsa_attention
from engine.models.rglru import RecurrentBlock
from engine.models.rope import layer_rotary, rotate_heads
from engine.models.short_conv import ShortConv
from engine.models.specs import (
    AttentionSpec,
    IndexerSpec,
    LayerSpec,
    MLASpec,
    MLPSpec,
    MoESpec,
    ParallelHybridSpec,
    RotarySpec,
)
from engine.models.xielu import initial_parameters as xielu_initial_parameters
from engine.models.xielu import xielu
from engine.models.zamba2 import Zamba2Hybrid, shared_blocks
from engine.ops.attention import attention, chunked_segment_ids, decode_attention
from engine.ops.attention_reference import alibi_slopes, attention_mask
from engine.ops.dense import DotGeneral, dense, gated_mlp, matmuls_in, uses_cpu_backward, weight_grads_in
from engine.ops.partitioning import constrain, current_platform
from engine.ops.pipeline import gpipe, pipeline_stages

# Parameters are created unsharded and placed by engine/models/params.py under jit with the
# shardings the rules table gives; NNX's eager sharding would need a mesh at construction.
nnx.use_eager_sharding(False)

_dtype, _param = dtype_of, param  # engine/models/common.py: the one initialiser


def _unit_rms(x, eps: float):
    """x / rms(x) over the last axis, in float32, no scale (Llama 4's L2 QK norm; Gemma 4's value norm)."""
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _alibi_distances(slopes, end, t: int, slots: int, shared):
    """ALiBi's operand of decode_attention: the slopes and the distances from a step's queries
    (slots end + [0, t)) to the cache's slots (b = 1, t, slots), and to a shared prefix's
    (1, prefix), which precedes slot 0; slot distances are position distances (left padding)."""
    distance_ts = end + jnp.arange(t)[:, None] - jnp.arange(slots)[None, :]
    prefix = None
    if shared is not None:
        count = shared[0].shape[-1]
        prefix = (count + end - jnp.arange(count))[None]
    return slopes, distance_ts[None], prefix


class Attention(nnx.Module):
    """Grouped-query attention with RoPE, built from an AttentionSpec's parameter structure and
    called with its layer's spec (static): the sliding window, RoPE or NoPE, chunks and the
    score scale are chosen per call, so one stacked set of layers can mix them (Gemma 2/3,
    SmolLM3) and a local layer computes only its window."""

    def __init__(self, spec: AttentionSpec, build: Build, *, rngs: nnx.Rngs):
        d, n, k, h = build.d_model, spec.num_heads, spec.num_kv_heads, spec.head_dim
        w = spec.value_head_dim or h  # MiMo-V2-Flash: narrower values
        # Gemma 4's KV sharing: a `reuse` layer (a stack of its own) has no key/value projections.
        self.reuses_kv = spec.kv_sharing == "reuse"
        self.values_from_keys = spec.values_from_keys
        own_kv = not self.reuses_kv
        pdt, std = build.param_dtype, build.init_std
        # With an output gate (Qwen3-Next) each head's query and gate, side by side, as HF's q_proj has them.
        self.output_gate = spec.output_gate
        self.wq_dnh = _param(rngs, (d, n, 2 * h if self.output_gate else h), std, ("embed", "heads", "head_dim"), pdt)
        if own_kv:
            self.wk_dkh = _param(rngs, (d, k, h), std, ("embed", "kv_heads", "head_dim"), pdt)
        if own_kv and not self.values_from_keys:
            self.wv_dkh = _param(rngs, (d, k, w), std, ("embed", "kv_heads", "head_dim"), pdt)
        if spec.qkv_bias:
            self.bq_nh = nnx.Param(jnp.zeros((n, h), pdt), out_sharding=("heads", "head_dim"))
            self.bk_kh = nnx.Param(jnp.zeros((k, h), pdt), out_sharding=("kv_heads", "head_dim"))
            self.bv_kh = nnx.Param(jnp.zeros((k, w), pdt), out_sharding=("kv_heads", "head_dim"))
        if spec.qk_norm != "none":  # over head_dim, over all heads' dims at once (OLMo 2), or per head (StableLM 2)
            across = spec.qk_norm in ("across_heads", "per_head")
            qk = spec.norm.model_copy(update={"bias": False}) if spec.qk_norm == "per_head" else spec.norm
            self.q_norm = make_norm(qk, h, pdt, rngs=rngs, heads=(n, "heads") if across else None)
            if own_kv:
                self.k_norm = make_norm(qk, h, pdt, rngs=rngs, heads=(k, "kv_heads") if across else None)
        self.wo_nhd = _param(rngs, (n, w, d), build.out_std, ("heads", "head_dim", "embed"), pdt)
        if spec.out_bias:
            self.bo_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("embed",))
        if spec.sinks:  # GPT-OSS: a logit per head in the softmax's denominator (0: as much as one key)
            self.sinks_n = nnx.Param(jnp.zeros((n,), pdt), out_sharding=("heads",))
        if spec.head_gate:  # LFM3: a sigmoid gate per head from the layer's input
            self.w_head_gate_dn = _param(rngs, (d, n), std, ("embed", "heads"), pdt)
        self.head_dim, self.norm_eps = h, spec.norm.eps
        self.dtype, self.compute, self.dot_general = build.dtype, build.compute, build.dot_general
        if spec.block_indexer is not None:  # MiniMax-M3's sparse layers (block_sparse.py)
            self.indexer: BlockIndexer | QSAIndexer = BlockIndexer(spec, build, rngs=rngs)
        if spec.qsa_indexer is not None:  # Qwen4-Exp's QSA layers (qsa.py)
            self.indexer = QSAIndexer(spec, build, rngs=rngs)
        add_adapters(self, ATTENTION_WEIGHTS, build, rngs)

    def _dense(self, x, attr: str, n_in: int = 1):
        """x . the weight `attr` (plus its LoRA update, if it has an adapter)."""
        backward = self.compute.matmul_backward
        return project(self, attr, x, n_in, self.dtype, backward=backward, dot_general=self.dot_general)

    def __call__(
        self,
        x_btd,
        positions_bt,
        segment_ids_bt,
        spec: AttentionSpec,
        cache: KVCache | None = None,
        *,
        rotary=None,
        shared_kv=None,
        store_kv: bool = False,
    ):
        """`spec` (static): this layer's (window, RoPE or NoPE, chunks, scale). segment_ids_bt
        None: one unpadded document per row. With a cache (decoding) returns (out, updated
        cache). `rotary`: this layer's (cos, sin) at `positions_bt`, if the caller computed
        them. KV sharing (Gemma 4): a `reuse` layer attends with `shared_kv`, the (keys,
        values) a `store` layer returned beside its output (`store_kv`, static), or when
        decoding with the cache of that layer (cache.layer)."""
        dt = self.dtype
        reuse = self.reuses_kv
        names = ("wq_dnh", "wk_dkh") if self.values_from_keys else ("wq_dnh", "wk_dkh", "wv_dkh")
        q, *kv = project_shared(
            self,
            names[:1] if reuse else names,
            x_btd,
            dt,
            backward=self.compute.matmul_backward,
            dot_general=self.dot_general,
        )
        # Gemma 4's global layers: the values are the keys before their norm. A reuse layer's k
        # and v are stand-ins (its queries), replaced by the shared ones before attention.
        k = q if reuse else kv[0]
        v = k if self.values_from_keys or reuse else kv[1]
        if self.output_gate:
            q, gate = q[..., : self.head_dim], q[..., self.head_dim :]
        if spec.qkv_bias:
            q, k, v = q + self.bq_nh[...].astype(dt), k + self.bk_kh[...].astype(dt), v + self.bv_kh[...].astype(dt)
        if spec.qkv_clip is not None:  # OLMo 1, DBRX: the projections clamped
            q, k, v = (jnp.clip(a, -spec.qkv_clip, spec.qkv_clip) for a in (q, k, v))
        if spec.key_multiplier != 1.0:  # Falcon-H1's key_multiplier
            k = k * jnp.asarray(spec.key_multiplier, k.dtype)
        if spec.qk_norm != "none" and not spec.qk_norm_after_rope:
            q, k = self.q_norm(q), k if reuse else self.k_norm(k)
        if spec.value_norm:  # RMSNorm over head_dim without a scale (Gemma 4)
            v = _unit_rms(v, self.norm_eps)
        if spec.value_scale != 1.0:  # MiMo-V2-Flash's attention_value_scale
            v = v * jnp.asarray(spec.value_scale, v.dtype)
        value_dim = spec.value_head_dim or self.head_dim
        if v.shape[-1] < self.head_dim:  # one width for q, k and v (every kernel and the KV cache need it)
            v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, self.head_dim - v.shape[-1])))
        q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", None))
        rope = spec.rope
        if rope is not None:
            if rotary is None:  # looked up in a table of the positions below the row's (cache's) length
                max_position = positions_bt.shape[1] if cache is None else cache.length
                rotary = layer_rotary(positions_bt, rope, self.head_dim, max_position)
            q, k = rotate_heads(q, rope, rotary), rotate_heads(k, rope, rotary)
            if spec.qk_l2_norm:  # Llama 4: RMS over head_dim, no scale, after RoPE
                q, k = _unit_rms(q, self.norm_eps), _unit_rms(k, self.norm_eps)
            if spec.qk_norm_after_rope:  # Hunyuan dense: the norms of the rotated queries and keys
                q, k = self.q_norm(q), k if reuse else self.k_norm(k)
            if spec.query_position_scale is not None:  # Ministral 3 (llama_4_scaling_beta), every layer
                steps_bt = jnp.floor(positions_bt.astype(jnp.float32) / spec.query_position_period)
                scale_bt = jnp.log1p(steps_bt) * spec.query_position_scale + 1.0
                q = (q * scale_bt[:, :, None, None]).astype(q.dtype)
        elif spec.temperature_floor is not None:  # Llama 4's NoPE layers (arXiv 2501.19399)
            steps_bt = jnp.floor((positions_bt.astype(jnp.float32) + 1.0) / spec.temperature_floor)
            temperature_bt = jnp.log1p(steps_bt) * spec.temperature_scale + 1.0
            q = (q * temperature_bt[:, :, None, None]).astype(q.dtype)
        q = checkpoint_name(q, "qkv_proj")
        k = checkpoint_name(k, "qkv_proj")
        v = checkpoint_name(v, "qkv_proj")
        sinks_n = self.sinks_n[...] if spec.sinks else None
        slopes = tuple(alibi_slopes(spec.num_heads)) if spec.alibi else None  # BLOOM, MPT
        if reuse and cache is None:
            k, v = shared_kv
        if spec.block_indexer is not None:  # block-sparse attention (block_sparse.py)
            out_btnh, cache = self._block_sparse(x_btd, q, k, v, positions_bt, segment_ids_bt, spec, cache, rotary)
        elif spec.qsa_indexer is not None:  # QSA's selected blocks (qsa.py)
            out_btnh, cache = qsa_attention(self, x_btd, q, k, v, positions_bt, segment_ids_bt, spec, cache, rotary)
        elif cache is None:
            if spec.chunk is not None:  # each chunk of each document its own segment (engine/ops/attention.py)
                segment_ids_bt = chunked_segment_ids(segment_ids_bt, positions_bt, spec.chunk)
            with jax.named_scope("core"):
                out_btnh = attention(
                    q,
                    k,
                    v,
                    segment_ids_bt,
                    impl=self.compute.attention_impl,
                    scale=spec.score_scale,
                    softcap=spec.softcap,
                    window=spec.window,
                    local=spec.window is not None,
                    block=self.compute.attention_block,
                    sinks_n=sinks_n,
                    alibi_slopes=slopes,
                )
        else:  # decoding: attend over the cache, this step's keys and values written into it
            window = spec.window
            chunk = (spec.chunk, positions_bt) if spec.chunk is not None else None
            if reuse:  # the keys and values the store layer (cache.layer) wrote, this step's too
                k, v, mask, cache = cache.read(q.shape[1], window=window, raw=True, chunk=chunk)
            else:
                k, v, mask, cache = cache.update(k, v, window=window, raw=True, chunk=chunk)
            shared = cache.shared_prefix(window=window, raw=True, chunk=chunk)
            out_btnh = decode_attention(
                q,
                k,
                v,
                mask,
                impl=self.compute.decode_attention_impl,
                scale=spec.score_scale,
                softcap=spec.softcap,
                sinks_n=sinks_n,
                shared=shared,
                alibi=None if slopes is None else _alibi_distances(slopes, cache.end, q.shape[1], k.shape[-1], shared),
            )
        out_btnh = out_btnh[..., :value_dim]  # the zero columns of padded values dropped
        if self.output_gate:  # sigmoid(gate) per head and dimension, in the compute dtype
            out_btnh = out_btnh * jax.nn.sigmoid(gate).astype(out_btnh.dtype)
        if spec.head_gate:  # sigmoid(x . w) per head, one scalar each (Laguna: softplus)
            gate_btn = self._dense(x_btd, "w_head_gate_dn")
            softplus = spec.head_gate_activation == "softplus"  # in float32, as transformers' Laguna
            gate_btn = jax.nn.softplus(gate_btn.astype(jnp.float32)) if softplus else jax.nn.sigmoid(gate_btn)
            out_btnh = out_btnh * gate_btn[..., None].astype(out_btnh.dtype)
        out_btd = self._dense(out_btnh, "wo_nhd", 2)
        if spec.out_bias:
            out_btd = out_btd + self.bo_d[...].astype(dt)
        if cache is None and store_kv:
            return out_btd, (k, v)
        return out_btd if cache is None else (out_btd, cache)

    def _block_sparse(self, x_btd, q, k, v, positions_bt, segment_ids_bt, spec: AttentionSpec, cache, rotary):
        """(out, cache) of attention over the key blocks the layer's indexer selects."""
        indexer = spec.block_indexer
        assert indexer is not None
        index_q_btgi, index_k_bti = self.indexer(x_btd, rotary)
        t = q.shape[1]
        if cache is None:
            segments_bt = jnp.ones(q.shape[:2], jnp.int32) if segment_ids_bt is None else segment_ids_bt
            mask_bts = attention_mask(segments_bt, segments_bt, window=spec.window)
            same_bts = segments_bt[:, :, None] == segments_bt[:, None, :]
            causal_ts = jnp.arange(t)[:, None] >= jnp.arange(t)[None, :]
            eligible_bts = causal_ts & (same_bts | (segments_bt[:, None, :] == 0))  # padding keys score too
            index_k_bsi, key_positions_bs = index_k_bti, positions_bt
        else:
            k, v, mask_bts, cache = cache.update(k, v, window=spec.window)
            index_k_bsi, cache = cache.update_index(index_k_bti)
            index_k_bsi = index_k_bsi.astype(jnp.float32)
            valid_bs, slots_s = cache.valid_bs, jnp.arange(k.shape[1])  # this step's slots valid already
            key_positions_bs = jnp.cumsum(valid_bs.astype(jnp.int32), axis=1) - 1
            eligible_bts = valid_bs[:, None, :] & (slots_s[None, :] <= cache.end + jnp.arange(t)[:, None])[None]
        chosen_bgts = selected_blocks(
            index_q_btgi,
            index_k_bsi,
            positions_bt,
            key_positions_bs,
            eligible_bts,
            block=indexer.block,
            topk=indexer.topk_blocks,
            local=indexer.local_blocks,
        )
        sinks_n = self.sinks_n[...] if spec.sinks else None
        mask_bkts = mask_bts[:, None] & chosen_bgts
        out = masked_attention(q, k, v, mask_bkts, scale=spec.score_scale, softcap=spec.softcap, sinks_n=sinks_n)
        return out, cache


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (gelu_tanh). Without a
    gate: down(act(up(x))) (Nemotron-H's relu2)."""

    def __init__(self, spec: MLPSpec, build: Build, *, rngs: nnx.Rngs, lora: bool = True):
        """`lora` False: no adapter here whatever the run's (a mixture of experts' dense layers)."""
        d, f = build.d_model, spec.dim
        pdt, std = build.param_dtype, build.init_std
        self.gated = spec.gated
        if self.gated:
            self.w_gate_df = _param(rngs, (d, f), std, ("embed", "mlp"), pdt)
        self.w_up_df = _param(rngs, (d, f), std, ("embed", "mlp"), pdt)
        self.w_down_fd = _param(rngs, (f, d), build.out_std, ("mlp", "embed"), pdt)
        self.bias = spec.bias
        if spec.bias:  # GPT-era MLPs
            if self.gated:
                self.b_gate_f = nnx.Param(jnp.zeros((f,), pdt), out_sharding=("mlp",))
            self.b_up_f = nnx.Param(jnp.zeros((f,), pdt), out_sharding=("mlp",))
            self.b_down_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("embed",))
        self.xielu = spec.activation == "xielu"
        if self.xielu:  # Apertus: xIELU's two learned scalars (engine/models/xielu.py)
            alpha_p, alpha_n = xielu_initial_parameters()
            self.xielu_alpha_p = nnx.Param(jnp.full((1,), alpha_p, pdt), out_sharding=("norm",))
            self.xielu_alpha_n = nnx.Param(jnp.full((1,), alpha_n, pdt), out_sharding=("norm",))
        self.activation: Callable = ACTIVATIONS.get(spec.activation, xielu)  # xielu: _mlp binds its alphas
        self.down_scale = spec.down_multiplier  # Falcon-H1's mlp_multipliers
        self.swiglu = None  # MiniMax-M3: GPT-OSS's clamped SwiGLU (moe.clamped_swiglu)
        if spec.swiglu_limit is not None:
            self.swiglu = functools.partial(clamped_swiglu, limit=spec.swiglu_limit, alpha=spec.swiglu_alpha)
        if spec.gate_multiplier != 1.0:
            self.activation = ScaledInput(self.activation, spec.gate_multiplier)
        self.dtype, self.compute, self.dot_general = build.dtype, build.compute, build.dot_general
        add_adapters(self, MLP_WEIGHTS, build if lora else None, rngs)

    def __call__(self, x_btd, gate_sparsity: float = 0.0):
        """`gate_sparsity` (static; MLPSpec.gate_sparsity, the calling layer's): Gemma 3n's Gaussian top-k."""
        out_btd = self._mlp(x_btd, gate_sparsity)
        return out_btd if self.down_scale == 1.0 else out_btd * jnp.asarray(self.down_scale, out_btd.dtype)

    def _mlp(self, x_btd, gate_sparsity: float = 0.0):
        dt = self.dtype
        kw = {"backward": self.compute.matmul_backward, "dot_general": self.dot_general}
        if not self.gated:
            up = project(self, "w_up_df", x_btd, 1, dt, **kw)
            if self.bias:
                up = up + self.b_up_f[...].astype(dt)
            activation = self.activation
            if self.xielu:
                alphas = {"alpha_p_1": self.xielu_alpha_p[...], "alpha_n_1": self.xielu_alpha_n[...]}
                activation = functools.partial(xielu, **alphas)
            hidden = activation(up.astype(jnp.float32)).astype(dt)
            out = project(self, "w_down_fd", constrain(hidden, ("act_batch", "act_seq", "act_mlp")), 1, dt, **kw)
            return out + self.b_down_d[...].astype(dt) if self.bias else out
        if self.swiglu is not None:  # autodiff's backward: gated_mlp's takes activation(gate) * up only
            gate, up = project_shared(self, ("w_gate_df", "w_up_df"), x_btd, dt, **kw)
            hidden = self.swiglu(gate.astype(jnp.float32), up.astype(jnp.float32)).astype(dt)
            return project(self, "w_down_fd", constrain(hidden, ("act_batch", "act_seq", "act_mlp")), 1, dt, **kw)
        if self.bias or any(has_adapter(self, attr) for attr in MLP_WEIGHTS):
            # With adapters, three products, each with its update (x.w + scale * x.A.B); the
            # fused gated_mlp has no seam for them. The activation is recomputed in the backward
            # pass (as gated_mlp's is), so only gate and up are kept, not its intermediates.
            gate, up = project_shared(self, ("w_gate_df", "w_up_df"), x_btd, dt, **kw)
            if self.bias:
                gate, up = gate + self.b_gate_f[...].astype(dt), up + self.b_up_f[...].astype(dt)
            activation = self.activation if not gate_sparsity else SparseGate(self.activation, gate_sparsity)
            hidden = jax.checkpoint(
                lambda g, u: (activation(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(dt), prevent_cse=False
            )(gate, up)
            out = project(self, "w_down_fd", constrain(hidden, ("act_batch", "act_seq", "act_mlp")), 1, dt, **kw)
            return out + self.b_down_d[...].astype(dt) if self.bias else out
        return gated_mlp(
            x_btd,
            weight_value(self.w_gate_df, dt),
            weight_value(self.w_up_df, dt),
            weight_value(self.w_down_fd, dt),
            self.activation if not gate_sparsity else SparseGate(self.activation, gate_sparsity),
            ("act_batch", "act_seq", "act_mlp"),
            **kw,
        )


@dataclasses.dataclass(frozen=True)
class ScaledInput:
    """activation(scale * x): Falcon-H1's gate multiplier, compared by value (a static argument)."""

    activation: Callable
    scale: float

    def __call__(self, x):
        return self.activation(x * jnp.asarray(self.scale, x.dtype))


@dataclasses.dataclass(frozen=True)
class SparseGate:
    """activation(relu(x - (mean + std * Phi^-1(sparsity)))) over the hidden width: Gemma 3n's
    Gaussian top-k on the gate (MLPSpec.gate_sparsity), compared by value (a static argument)."""

    activation: Callable
    sparsity: float

    def __call__(self, x):
        z = statistics.NormalDist().inv_cdf(self.sparsity)
        mean = jnp.mean(x, axis=-1, keepdims=True)
        std = jnp.sqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True))  # torch's unbiased=False
        return self.activation(jax.nn.relu(x - (mean + std * jnp.asarray(z, x.dtype))))


def _attention_mamba2(spec: ParallelHybridSpec, build: Build, *, rngs: nnx.Rngs) -> AttentionMamba2:
    return AttentionMamba2(
        spec, Attention(spec.attention, build, rngs=rngs), Mamba2.of_spec(spec.mamba2, build, rngs=rngs)
    )


def finish_logits(cfg: ModelConfig, logits_btv, bias_v=None):
    """The LM head's product made the model's logits: its bias, multipliers and softcap
    (cfg.head, Falcon-H1's muP), then the logits' sharding. Transformer._forward and the
    tiled loss (engine/train/lm_head.py) both end the head here."""
    if bias_v is not None:  # GPT-J, Phi
        logits_btv = logits_btv + bias_v.astype(logits_btv.dtype)
    if cfg.head.multiplier is not None:  # Cohere's logit_scale
        logits_btv = logits_btv * jnp.asarray(cfg.head.multiplier, logits_btv.dtype)
    if cfg.head.divisor is not None:  # Granite
        logits_btv = logits_btv / jnp.asarray(cfg.head.divisor, logits_btv.dtype)
    if cfg.mup is not None and cfg.mup.lm_head != 1.0:  # Falcon-H1
        logits_btv = logits_btv * jnp.asarray(cfg.mup.lm_head, logits_btv.dtype)
    if cfg.head.softcap is not None:
        cap = cfg.head.softcap
        logits_btv = (cap * jnp.tanh(logits_btv.astype(jnp.float32) / cap)).astype(logits_btv.dtype)
    return constrain(logits_btv, ("act_batch", "act_seq", "act_vocab"))


MIXERS: dict[str, Callable[..., nnx.Module]] = {
    "attention": Attention,
    "mla": MLA,
    "gated_delta": GatedDeltaNet,
    "kimi_delta": KimiDeltaAttention,
    "mamba2": Mamba2.of_spec,
    "attention_mamba2": _attention_mamba2,
    "mixture_of_attention": MixtureOfAttention,
    "mamba1": Mamba1,
    "short_conv": ShortConv,
    "rglru": RecurrentBlock,
    "lightning": LightningAttention,
    "compressed_attention": CompressedAttention,
    "zamba2_hybrid": Zamba2Hybrid,
}
"""A mixer spec's kind -> its module, built (spec, build, rngs=) and called (x, positions,
segment_ids, spec, cache=None, **extras) -> out, or with a cache (out, cache); `spec` is the
calling layer's (static). A kind that decodes with a state instead of keys and values registers
its initial state in kv_cache.DECODE_STATES and reads and writes cache.states[cache.layer]."""


class Block(nnx.Module):
    """A decoder layer of a LayerSpec: x + mixer(norm(x)), then x + ffn(norm(x)). With
    post_norms (Gemma 2/3) each branch output is normalised again before the add; without
    pre_norms (OLMo 2) only the outputs are: x + norm(mixer(x)).

    `self.attn` is the sequence mixer of the spec's kind (MIXERS); `self.mlp` the
    feed-forward: a dense MLP, or a mixture of experts (engine/models/moe.py) that also
    returns its router statistics. Either may be absent (Nemotron-H's layers)."""

    def __init__(self, spec: LayerSpec, build: Build, *, rngs: nnx.Rngs, mlp_lora: bool = True):
        """`mlp_lora` False: a dense MLP here takes no adapter (a mixture of experts' dense
        layers, which LoraConfig.targets leaves unadapted)."""
        d, pdt = build.d_model, build.param_dtype
        self.has_mixer, self.has_ffn = spec.mixer is not None, spec.ffn is not None
        norm = functools.partial(make_norm, spec.norm, d, pdt, rngs=rngs)
        if spec.pre_norms and self.has_mixer:
            self.attn_norm = norm()
        if spec.mixer is not None:
            self.attn = MIXERS[spec.mixer.kind](spec.mixer, build, rngs=rngs)
        if spec.pre_norms and self.has_ffn and spec.residual != "parallel_shared_norm":
            self.mlp_norm = norm()
        if isinstance(spec.ffn, MoESpec):
            self.mlp = MoE(spec.ffn, build, rngs=rngs)
            if spec.ffn.beside is not None:  # Gemma 4's 26B-A4B: the dense MLP beside the experts, each with its norms
                self.dense_mlp = MLP(spec.ffn.beside, build, rngs=rngs, lora=False)
                self.post_dense_norm = norm()
                self.moe_norm = norm()
                self.post_moe_norm = norm()
        elif spec.ffn is not None:
            self.mlp = MLP(spec.ffn, build, rngs=rngs, lora=mlp_lora)
        if spec.post_norms and self.has_mixer:
            self.post_attn_norm = norm()
        if spec.post_norms and self.has_ffn:
            self.post_mlp_norm = norm()
        if spec.layer_scale:  # Gemma 4: the stream times a learned scalar after the layer
            self.layer_scale = nnx.Param(jnp.ones((1,), pdt), out_sharding=("norm",))
        p = spec.per_layer_input_dim
        if p is not None:  # Gemma 4's per-layer embeddings: this layer's gate, projection, norm
            self.per_layer_gate_dp = _param(rngs, (d, p), build.init_std, ("embed", None), pdt)
            self.per_layer_proj_pd = _param(rngs, (p, d), build.out_std, (None, "embed"), pdt)
            self.post_per_layer_norm = norm()
            self.activation, self.dtype = ACTIVATIONS[spec.per_layer_activation], build.dtype
            self.compute, self.dot_general = build.compute, build.dot_general
            add_adapters(self, PER_LAYER_INPUT_WEIGHTS, build, rngs)
        if spec.hyper is not None:  # DeepSeek-V4's residual streams (hyper_connection.py)
            self.attn_hc = HyperConnection(spec.hyper, d, build.init_std, rngs=rngs)
            self.ffn_hc = HyperConnection(spec.hyper, d, build.init_std, rngs=rngs)
        if spec.laurel is not None:  # Gemma 3n's low-rank residual beside the attention (laurel.py)
            self.laurel = Laurel(spec.laurel, spec.norm, build, rngs=rngs)
        if spec.altup is not None:  # Gemma 3n's AltUp streams (altup.py)
            self.altup = AltUp(spec.altup, spec.norm, build, rngs=rngs)
        if spec.shortcut_moe is not None:  # LongCat-Flash: the experts beside the MLP
            self.shortcut = MoE(spec.shortcut_moe, build, rngs=rngs)
        if spec.gated_residual is not None:  # Qwen4-Exp's gated residual streams (gated_residual.py)
            self.attn_gr = GatedResidual(spec.gated_residual, d, build, rngs=rngs)
            self.ffn_gr = GatedResidual(spec.gated_residual, d, build, rngs=rngs)
        if spec.ngram_embedding is not None:  # Qwen4-Exp's hashed n-gram embedding (ngram_embedding.py)
            streams = 1 if spec.gated_residual is None else spec.gated_residual.streams
            self.ple = NGramEmbedding(spec.ngram_embedding, streams, build, rngs=rngs)

    def forward(
        self,
        x_btd,
        positions_bt,
        segment_ids_bt,
        spec: LayerSpec,
        cache: KVCache | None = None,
        *,
        rotary=None,
        per_layer_btp=None,
        shared_kv=None,
        store_kv: bool = False,
        index_state=None,
        zamba=None,
    ):
        """(x, cache or None, MoEStats of the router or None for a dense MLP). `spec`: this
        layer's (static). `rotary`: the attention's RoPE (cos, sin), where the caller computed
        them for all layers at once. Gemma 4: `per_layer_btp` this layer's per-layer input;
        `shared_kv` the keys and values a reuse layer attends with; `store_kv` (static): a
        store layer, its own in place of the cache (there is none without decoding). Sparse
        attention with shared indexer layers (IndexerSpec.shared): `index_state` the last
        earlier indexer's selection inputs (MLA.__call__), and x in the result is then (x, the
        state this layer passes on)."""
        if spec.hyper is not None:  # n residual streams (DeepSeek-V4): hyper_connection.py runs the layer
            return hyper_layer(self, x_btd, positions_bt, segment_ids_bt, spec, cache, rotary, index_state)
        if spec.gated_residual is not None:  # n gated residual streams (Qwen4-Exp): gated_residual.py runs the layer
            return gated_residual_layer(self, x_btd, positions_bt, segment_ids_bt, spec, cache, rotary)
        if spec.altup is not None:  # AltUp's streams (Gemma 3n): altup.py runs the layer
            extra = {"per_layer_btp": per_layer_btp, "shared_kv": shared_kv, "store_kv": store_kv}
            return altup_layer(self, x_btd, positions_bt, segment_ids_bt, spec, cache, rotary=rotary, **extra)
        indexer_kl = stats = carried_btd = None
        if spec.shortcut_moe is not None or spec.shortcut_close:  # LongCat-Flash: (stream, carried experts' output)
            x_btd, carried_btd = jnp.split(x_btd, 2, axis=-1)
        x_in, attn_in = x_btd, None  # a parallel layer's feed-forward reads the layer's input
        if spec.mixer is not None:
            extra = {"rotary": rotary, "shared_kv": shared_kv, "store_kv": store_kv, "index_state": index_state}
            if zamba is not None:  # Zamba2's hybrid layers: the shared blocks and the embeddings (zamba2.py)
                extra["zamba"] = zamba
            attn_in = self.attn_norm(x_btd) if spec.pre_norms else x_btd
            branch, cache, indexer_kl = self._mix(attn_in, positions_bt, segment_ids_bt, spec, cache, extra)
            if index_state is not None:
                branch, index_state = branch
            if spec.residual_scales is not None:  # MiniMax: alpha * norm(x) + beta * mixer(norm(x))
                alpha, beta = (jnp.asarray(f, branch.dtype) for f in spec.residual_scales[:2])
                x_btd = attn_in * alpha + branch * beta
            else:
                x_btd = x_btd + branch
        if spec.ffn is None:
            x_btd = constrain(x_btd, ("act_batch", "act_seq", "act_embed"))
            x_out = x_btd if index_state is None else (x_btd, index_state)
            return x_out, cache, None if indexer_kl is None else WithIndexerLoss(None, indexer_kl)
        with jax.named_scope("mlp"):
            if spec.residual == "parallel_shared_norm":  # GPT-J, Phi: one norm feeds both
                mlp_in = attn_in
            else:
                normed = x_in if spec.residual == "parallel" else x_btd
                mlp_in = self.mlp_norm(normed) if spec.pre_norms else normed
            valid_bt = None if segment_ids_bt is None else segment_ids_bt != 0
            if spec.shortcut_moe is not None:  # carried to the next layer's end
                carried_btd, stats = self.shortcut(mlp_in, valid_bt)
            if isinstance(spec.ffn, MoESpec) and spec.ffn.beside is not None:
                # the experts on their own pre-norm, routed by the residual itself
                moe_out, stats = self.mlp(self.moe_norm(x_btd), valid_bt, router_x_btd=x_btd)
                mlp_out = self.post_dense_norm(self.dense_mlp(mlp_in)) + self.post_moe_norm(moe_out)
            elif isinstance(spec.ffn, MoESpec):
                mlp_out, stats = self.mlp(mlp_in, valid_bt)
            else:
                mlp_out = self.mlp(mlp_in, spec.ffn.gate_sparsity)
        if spec.residual_multiplier is not None:  # Granite
            mlp_out = mlp_out * jnp.asarray(spec.residual_multiplier, mlp_out.dtype)
        if spec.residual_scales is not None:  # MiniMax: alpha * norm(x) + beta * ffn(norm(x))
            alpha, beta = (jnp.asarray(f, mlp_out.dtype) for f in spec.residual_scales[2:])
            assert mlp_in is not None  # a layer with a feed-forward has its input
            x_btd = mlp_in * alpha + mlp_out * beta
        else:
            x_btd = x_btd + (self.post_mlp_norm(mlp_out) if spec.post_norms else mlp_out)
        if spec.shortcut_close:  # the previous layer's experts join the stream
            assert carried_btd is not None  # (split from the stream above)
            x_btd, carried_btd = x_btd + carried_btd, jnp.zeros_like(carried_btd)
        if spec.per_layer_input_dim is not None:  # x + norm(proj(act(gate(x)) * e)), e this layer's input
            dt, kw = self.dtype, {"backward": self.compute.matmul_backward, "dot_general": self.dot_general}
            gate_btp = project(self, "per_layer_gate_dp", x_btd, 1, dt, **kw)  # (+ the LoRA updates, if adapted)
            gated_btp = (self.activation(gate_btp.astype(jnp.float32)) * per_layer_btp.astype(jnp.float32)).astype(dt)
            out_btd = project(self, "per_layer_proj_pd", gated_btp, 1, dt, **kw)
            x_btd = x_btd + self.post_per_layer_norm(out_btd)
        if spec.layer_scale:
            x_btd = x_btd * self.layer_scale[...].astype(x_btd.dtype)
        if carried_btd is not None:
            x_btd = jnp.concatenate([x_btd, carried_btd.astype(x_btd.dtype)], axis=-1)
        x_btd = constrain(x_btd, ("act_batch", "act_seq", "act_embed"))
        x_out = x_btd if index_state is None else (x_btd, index_state)
        return x_out, cache, stats if indexer_kl is None else WithIndexerLoss(stats, indexer_kl)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, spec: LayerSpec, cache: KVCache | None = None, **extra):
        x_btd, cache, _ = self.forward(x_btd, positions_bt, segment_ids_bt, spec, cache, **extra)
        return x_btd if cache is None else (x_btd, cache)

    def _mix(self, attn_in, positions_bt, segment_ids_bt, spec: LayerSpec, cache, extra: dict):
        """The mixer sublayer's branch of its (normed) input: (what it adds to the stream,
        cache, sparse attention's indexer KL or None); a store layer's (keys, values) in place
        of the cache without one (Attention: KV sharing); given an index_state, the branch is
        (it, the state passed on)."""
        store_kv = extra["store_kv"] and cache is None
        with jax.named_scope("attention"):  # names the ops in profiles (bench/profile_step.py)
            kw = {name: value for name, value in extra.items() if value is not None and value is not False}
            if not store_kv:
                kw.pop("store_kv", None)
            attn_out = self.attn(attn_in, positions_bt, segment_ids_bt, spec.mixer, cache, **kw)
        index_state = None
        if extra.get("index_state") is not None:
            attn_out, index_state = attn_out
        indexer_kl = None
        if cache is not None or store_kv:
            attn_out, cache = attn_out
        elif getattr(self.attn, "indexer_loss", "none") != "none":  # sparse attention's indexer trains (dsa.py)
            attn_out, indexer_kl = attn_out
        if spec.residual_multiplier is not None:  # Granite
            attn_out = attn_out * jnp.asarray(spec.residual_multiplier, attn_out.dtype)
        branch = self.post_attn_norm(attn_out) if spec.post_norms else attn_out
        return (branch if index_state is None else (branch, index_state)), cache, indexer_kl


def shared_indexer(layers: list[LayerSpec]) -> IndexerSpec | None:
    """The sparse-attention indexer of a model with shared indexer layers (IndexerSpec.shared,
    GLM-5's), whose layers then carry the last indexer's selection inputs beside the residual
    stream (MLA.__call__'s index_state); None without any."""
    for layer in layers:
        if isinstance(layer.mixer, MLASpec) and layer.mixer.indexer is not None and layer.mixer.indexer.shared:
            return layer.mixer.indexer
    return None


def _initial_index_state(x_btd, indexer: IndexerSpec):
    """The index_state before the first layer, whose own indexer replaces it: zeros (queries
    (b, t, g, i), head weights (b, t, g), keys (b, t, i), float32 as the indexer's)."""
    b, t, _ = x_btd.shape
    g, i, f32 = indexer.heads, indexer.head_dim, jnp.float32
    return jnp.zeros((b, t, g, i), f32), jnp.zeros((b, t, g), f32), jnp.zeros((b, t, i), f32)


def _runs(items: list[tuple[LayerSpec, int]]) -> list[tuple[LayerSpec, int, int]]:
    """(layer kind, first slot, length) of each run of like layers in consecutive slots of one
    stack: [(L, 0), (L, 1), (G, 2)] -> [(L, 0, 2), (G, 2, 1)]."""
    runs: list[tuple[LayerSpec, int, int]] = []
    for layer, slot in items:
        if runs and runs[-1][0] == layer and runs[-1][1] + runs[-1][2] == slot:
            runs[-1] = (layer, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((layer, slot, 1))
    return runs


class _Pieces(NamedTuple):
    """A stack's (params, layer indices) cut once along the layer axis into the ranges the
    top-level schedule takes, (lo, hi) -> the pytree of layers [lo, hi). One split's gradient
    is one concatenation; a slice per range (a[lo:hi]) has a full-size padded gradient each,
    which XLA adds up: Nemotron 3 Nano's expert stack, taken in 4 ranges, held 4 stack-sized
    float32 gradients per chip among the temporaries (186 GiB on a v5p-8)."""

    by_range: dict


def _split_stack(stack, ranges: set[tuple[int, int]]):
    """`stack` as _Pieces over `ranges` (disjoint, together every slot), or itself where one
    range covers it (a model of one run of like layers keeps its program)."""
    if len(ranges) == 1:
        return stack
    bounds = sorted(ranges)
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])), f"ranges {bounds} do not tile the stack"
    cuts = [lo for lo, _ in bounds[1:]]
    leaves, treedef = jax.tree.flatten(stack)
    split = [jnp.split(a, cuts) for a in leaves]
    return _Pieces({r: jax.tree.unflatten(treedef, [parts[i] for parts in split]) for i, r in enumerate(bounds)})


def _take(stack, lo: int, hi: int):
    """The layers [lo, hi) of a stack (a pytree with a leading layer axis, or _Pieces)."""
    if isinstance(stack, _Pieces):
        return stack.by_range[(lo, hi)]
    return jax.tree.map(lambda a: a[lo:hi], stack)


def _take_one(stack, i: int):
    """Layer `i` of a stack (its params and index, no layer axis)."""
    if isinstance(stack, _Pieces):
        return jax.tree.map(lambda a: a[0], stack.by_range[(i, i + 1)])
    return jax.tree.map(lambda a: a[i], stack)


def _unit_shares(unit: list[tuple[LayerSpec, int]]) -> dict[str, tuple[int, int]]:
    """Per stack in a repeating unit: (its first slot, its slots per unit)."""
    shares: dict[str, tuple[int, int]] = {}
    for layer, slot in unit:
        first, count = shares.get(layer.stack, (slot, 0))
        shares[layer.stack] = (first, count + 1)
    return shares


def _stack_ranges(parts) -> dict[str, set[tuple[int, int]]]:
    """Per stack, the slot ranges a top-level schedule takes: `parts` is (layers, steps) pairs,
    steps None for layers run by runs of like layers, else a unit of that many repeats."""
    ranges: dict[str, set[tuple[int, int]]] = {}
    for part, steps in parts:
        if steps is None:
            for layer, first, length in _runs(part):
                ranges.setdefault(layer.stack, set()).add((first, first + length))
        else:
            for name, (first, count) in _unit_shares(part).items():
                ranges.setdefault(name, set()).add((first, first + steps * count))
    return ranges


def _smallest_period(kinds: list[LayerSpec]) -> int:
    """The smallest p with kinds[i] == kinds[i + p] wherever both exist (KMP's border)."""
    border, k = [0] * len(kinds), 0
    for i in range(1, len(kinds)):
        while k and kinds[i] != kinds[k]:
            k = border[k - 1]
        if kinds[i] == kinds[k]:
            k += 1
        border[i] = k
    return len(kinds) - border[-1]


def layer_schedule(layers: list[LayerSpec]) -> tuple[int, int, int]:
    """(start, period, steps): the layers [start, start + period * steps) repeat one unit of
    `period` layers, run as a scan of `steps` unit steps; the layers before and after it run
    as runs of like layers, a run longer than one layer scanned. The choice compiles the
    fewest layer bodies (ties: the earliest start); (len, 0, 0) when no repeat saves one.

    Llama: no unit (one run, one scan). DeepSeek-V3: none either (a run of dense layers, a run
    of expert layers). Gemma 3: a unit of six (five local layers, one scan, and a global one)
    from layer 0, the left-over layers after it. Qwen3-MoE with decoder_sparse_step 2: a unit
    of a dense and an expert layer, each from its own stack."""

    def cost(part: list[LayerSpec]) -> int:  # like layers in a row count once (consecutive slots)
        return sum(1 for i, layer in enumerate(part) if i == 0 or part[i - 1] != layer)

    n = len(layers)
    best_cost, best = cost(layers), (n, 0, 0)
    for start in range(n):
        period = _smallest_period(layers[start:])
        steps = (n - start) // period
        if period == 1 or steps < 2:
            continue
        end = start + period * steps
        total = cost(layers[:start]) + cost(layers[start : start + period]) + cost(layers[end:])
        if total < best_cost:
            best_cost, best = total, (start, period, steps)
    return best


class Segment(NamedTuple):
    """A part of the layer stack in a multi-unit schedule (layer_segments): the layers [start,
    start + period * steps). `unit` None: a run of `steps` like layers (period 1; more than one
    scanned, as a run is in layer_schedule's); else a unit of `period` layers run as a scan of
    `steps` unit steps, `unit` its own schedule (positions within the unit)."""

    start: int
    period: int
    steps: int
    unit: tuple[Segment, ...] | None = None


def segments_cost(segments) -> int:
    """The layer bodies a schedule compiles: one per run, a unit's own inside it."""
    return sum(1 if s.unit is None else segments_cost(s.unit) for s in segments)


def describe_segments(segments) -> str:
    """A schedule as text: `M-M*` a run or unit's layers, `x5` its steps, units in brackets."""
    return " ".join(
        f"run x{s.steps}" if s.unit is None else f"[{describe_segments(s.unit)}] x{s.steps}" for s in segments
    )


@functools.lru_cache(maxsize=256)
def _best_segments(layers: tuple[LayerSpec, ...]) -> tuple[int, tuple[Segment, ...]]:
    """(bodies, segments) of the schedule compiling the fewest layer bodies: from each layer, a
    run of like layers, or a unit (itself scheduled so, not one kind, not a repeat of a shorter
    unit) repeated 2+ times in a row. Ties: fewer segments, then the longer run or unit first."""
    n = len(layers)
    best: list[tuple[int, int, tuple[Segment, ...]]] = [(0, 0, ())] * (n + 1)
    for i in range(n - 1, -1, -1):
        options = []
        run = 1
        while i + run < n and layers[i + run] == layers[i]:
            run += 1
        for length in range(run, 0, -1):
            cost, count, rest = best[i + length]
            options.append((cost + 1, count + 1, (Segment(i, 1, length),) + rest))
        for period in range((n - i) // 2, 1, -1):
            unit = layers[i : i + period]
            if layers[i + period : i + 2 * period] != unit or len(set(unit)) == 1:
                continue
            if _smallest_period(list(unit)) < period and period % _smallest_period(list(unit)) == 0:
                continue  # a repeat of a shorter unit: that unit covers it
            steps = 2
            while layers[i + steps * period : i + (steps + 1) * period] == unit:
                steps += 1
            inner_cost, inner = _best_segments(unit)
            for k in range(steps, 1, -1):
                cost, count, rest = best[i + k * period]
                options.append((inner_cost + cost, count + 1, (Segment(i, period, k, inner),) + rest))
        best[i] = min(options, key=lambda o: (o[0], o[1]))
    return best[0][0], best[0][2]


def layer_segments(layers: list[LayerSpec]) -> tuple[Segment, ...] | None:
    """A schedule of several repeating units, runs and units inside units (Segment), where it
    compiles fewer layer bodies than layer_schedule's one unit; None where it does not (the
    model keeps layer_schedule's program). Nemotron-H 8B (M-M-M-M*-M-M-M-M-M*-... over 52
    layers, - an MLP layer, * attention): one unit compiles 44 bodies (41 layers one by one);
    `M, [- M] x3, [* [- M] x5] x4, -` compiles 7. Every preset but Nemotron-H's gets None."""

    def runs(part: list[LayerSpec]) -> int:
        return sum(1 for i, layer in enumerate(part) if i == 0 or part[i - 1] != layer)

    start, period, steps = layer_schedule(layers)
    end = start + period * steps
    one_unit = runs(layers[:start]) + (runs(layers[start : start + period]) + runs(layers[end:]) if steps else 0)
    cost, segments = _best_segments(tuple(layers))
    return segments if cost < one_unit else None


def _one_layer(stats: MoEStats | None) -> list[MoEStats]:
    """One layer's router stats with a leading layer axis of 1, as a list to extend by."""
    return [] if stats is None else [jax.tree.map(lambda a: a[None], stats)]


def _layers(stats: MoEStats | None) -> list[MoEStats]:
    """Stats that already have their layer axis (a scan's), as a list to extend by."""
    return [] if stats is None else [stats]


def _stack(stats: Sequence[MoEStats | WithIndexerLoss]) -> MoEStats | WithIndexerLoss | None:
    """The layers' router stats as one MoEStats (leading axis: layers); None for dense. With
    a training indexer (dsa.py), a WithIndexerLoss of those and every layer's KL."""
    if any(isinstance(s, WithIndexerLoss) for s in stats):  # (Dots3: its sliding layers have no indexer)
        moe = [s.moe if isinstance(s, WithIndexerLoss) else s for s in stats]
        kl = [s.indexer_kl for s in stats if isinstance(s, WithIndexerLoss)]
        routers = _stack([s for s in moe if s is not None])
        assert not isinstance(routers, WithIndexerLoss)
        return WithIndexerLoss(routers, jnp.concatenate(kl))
    return jax.tree.map(lambda *a: jnp.concatenate(a), *stats) if stats else None


def scan_unroll(compute: ComputeConfig) -> int | bool:
    """jax.lax.scan's `unroll` for the layer scan: ComputeConfig.scan_unroll, with auto the
    whole stack (True) for bfloat16 compute on CPU and 1 elsewhere."""
    if compute.scan_unroll == "auto":
        return True if current_platform() == "cpu" and compute.dtype == "bfloat16" else 1
    return compute.scan_unroll


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv_proj"),
}


class Transformer(nnx.Module):
    """The decoder: embeddings, `num_layers` blocks (stacked for lax.scan, or a list), the
    final norm and the LM head. `compute` says how (dtypes, scan, remat, attention and matmul
    implementations); `dot_general` is every matmul's product (jax.lax.dot_general, or a
    quantized one).

    The layers are ModelConfig.layer_specs, data (engine/models/specs.py): each layer's mixer
    and feed-forward specs, its norm and residual form; each block is built from its stack's
    spec and called with its layer's. Layers whose parameters have one structure form one
    stack (ModelConfig.layer_stacks): `blocks`, and in a mixture of experts with dense layers
    (DeepSeek-V3's first ones, Qwen3-MoE's interleaved ones) `dense_blocks`."""

    def __init__(
        self,
        cfg: ModelConfig,
        compute: ComputeConfig | None = None,
        *,
        rngs: nnx.Rngs,
        dot_general: DotGeneral = jax.lax.dot_general,
        lora: LoraConfig | None = None,
    ):
        compute = compute or ComputeConfig()
        self.cfg, self.compute = cfg, compute
        pdt = _dtype(compute.param_dtype)
        build = Build.of(cfg, compute, dot_general, lora)
        self.embed_vd = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"), pdt)
        specs = cfg.layer_specs()
        mlp_lora = not cfg.is_moe  # LoraConfig.targets leaves a mixture of experts' dense layers unadapted
        for name, indices in cfg.layer_stacks():
            spec = specs[indices[0]]
            if compute.scan_layers:
                stack = self._stacked_blocks(spec, build, rngs, len(indices), mlp_lora)
            else:
                stack = nnx.List([Block(spec, build, rngs=rngs, mlp_lora=mlp_lora) for _ in indices])
            setattr(self, name, stack)
        if cfg.mtp_layers:  # multi-token prediction (engine/models/mtp.py): run by its loss only
            for name in cfg.mtp_head_names():  # `mtp`, `mtp_1`, ...: each module's own
                setattr(self, name, MTPHead(cfg, compute, rngs=rngs))
            spec, plain = cfg.mtp_layer_spec(), dataclasses.replace(build, lora=None)
            self.mtp_blocks = (
                self._stacked_blocks(spec, plain, rngs, cfg.mtp_layers, mlp_lora)
                if compute.scan_layers
                else nnx.List([Block(spec, plain, rngs=rngs) for _ in range(cfg.mtp_layers)])
            )
        norm = cfg.layer_specs()[0].norm  # one kind of norm in a model
        if cfg.head.norm_eps is not None:  # JetMoE: the final norm's epsilon its own
            norm = norm.model_copy(update={"eps": cfg.head.norm_eps})
        gated = cfg.layer_specs()[0].gated_residual
        if gated is None:  # (Qwen4-Exp: the streams' final mix norms them, no final norm)
            self.final_norm = make_norm(norm, cfg.d_model, pdt, rngs=rngs)
        else:
            self.gr_head = GatedResidual(gated, cfg.d_model, build, rngs=rngs, inject=False)
        if (hyper := cfg.layer_specs()[0].hyper) is not None:  # DeepSeek-V4: the streams' final mix
            self.hc_head = HyperHead(hyper, cfg.d_model, cfg.init_std, rngs=rngs)
        if (altup := cfg.layer_specs()[0].altup) is not None:  # Gemma 3n: into and out of the streams
            self.altup_streams = AltUpStreams(altup, build, rngs=rngs)
        if cfg.positions == "learned":  # GPT-2, OPT: an absolute position's embedding (rows offset on)
            rows = cfg.max_seq_len + cfg.embedding.position_offset
            self.pos_embed_pd = _param(rngs, (rows, cfg.d_model), cfg.init_std, (None, "embed"), pdt)
        if cfg.embedding.norm:  # BLOOM: the token embeddings normed before the first layer
            self.embed_norm = make_norm(norm, cfg.d_model, pdt, rngs=rngs)
        if cfg.embedding.per_layer_input_dim:  # Gemma 4's per-layer embeddings: num_layers * p columns per token
            width = cfg.num_layers * cfg.embedding.per_layer_input_dim  # its columns sharded as the embedding's
            rows = cfg.embedding.per_layer_vocab_size or cfg.vocab_size  # Gemma 3n's: fewer rows
            self.per_layer_embed_vx = _param(rngs, (rows, width), cfg.init_std, ("vocab", "embed"), pdt)
            self.per_layer_proj_dx = _param(rngs, (cfg.d_model, width), cfg.init_std, ("embed", None), pdt)
            self.per_layer_proj_norm = make_norm(
                cfg.layer_specs()[0].norm, cfg.embedding.per_layer_input_dim, pdt, rngs=rngs
            )
        if not cfg.tie_embeddings:
            rows = cfg.head.vocab_size or cfg.vocab_size  # Apertus 1.5's pruned head
            self.lm_head_dv = _param(rngs, (cfg.d_model, rows), cfg.init_std, ("embed", "vocab"), pdt)
        if cfg.head.bias:  # GPT-J, Phi
            self.lm_head_bias_v = nnx.Param(jnp.zeros((cfg.vocab_size,), pdt), out_sharding=("vocab",))
        self.matmul_backward, self.dot_general = compute.matmul_backward, dot_general
        if cfg.zamba2 is not None:  # Zamba2's shared blocks, which its hybrid layers call (zamba2.py)
            for b, block in enumerate(shared_blocks(cfg, build, rngs=rngs)):
                setattr(self, f"zamba2_shared_{b}", block)
        if (
            cfg.embedding.per_layer_input_dim
        ):  # LoRA on the per-layer inputs' projection (last: the base inits as without)
            add_adapters(self, MODEL_WEIGHTS, build, rngs)

    @staticmethod
    def _stacked_blocks(spec: LayerSpec, build: Build, rngs: nnx.Rngs, count: int, mlp_lora: bool) -> Block:
        """One Block whose every parameter has a leading `layers` axis (`count`), for lax.scan."""

        @nnx.split_rngs(splits=count)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(spec, build, rngs=rngs, mlp_lora=mlp_lora)

        return make(rngs)

    def _slots(self) -> list[tuple[LayerSpec, int]]:
        """Per layer of the model: (its spec, its slot in its stack)."""
        specs, slots = self.cfg.layer_specs(), {}
        for _, indices in self.cfg.layer_stacks():
            slots.update({layer: slot for slot, layer in enumerate(indices)})
        return [(spec, slots[i]) for i, spec in enumerate(specs)]

    def _per_layer_inputs(self, tokens_bt, x_btd):
        """Gemma 4's per-layer inputs (b, t, layers, p): (norm(the embeddings' projection *
        d**-0.5) + the token's second embedding * p**0.5) * 2**-0.5, per layer."""
        cfg, dt = self.cfg, _dtype(self.compute.dtype)
        shape = (*tokens_bt.shape, cfg.num_layers, cfg.embedding.per_layer_input_dim)
        if cfg.embedding.per_layer_vocab_size:  # tokens past its rows read row 0 (Gemma 3n)
            tokens_bt = jnp.where(tokens_bt < cfg.embedding.per_layer_vocab_size, tokens_bt, 0)
        token_btlp = (self.per_layer_embed_vx[...].astype(dt)[tokens_bt]).reshape(shape)
        token_btlp = token_btlp * jnp.asarray(math.sqrt(cfg.embedding.per_layer_input_dim), dt)
        kw = {"backward": self.matmul_backward, "dot_general": self.dot_general}
        projected_btx = project(self, "per_layer_proj_dx", x_btd, 1, dt, **kw)  # (+ its LoRA update, if adapted)
        projected_btlp = self.per_layer_proj_norm((projected_btx * jnp.asarray(cfg.d_model**-0.5, dt)).reshape(shape))
        return (projected_btlp + token_btlp) * jnp.asarray(2**-0.5, dt)

    def _run_blocks(self, x_btd, positions_bt, segment_ids_bt, per_layer_btlp=None, zamba=None):
        """(x, MoEStats with a leading layer axis, or None for a dense model): every layer in
        turn, each with its static flags (a local layer computes only its window,
        engine/ops/attention.py; a global one pays nothing for it).

        Stacked layers are scanned (layer_schedule): a run of like layers of one stack is one
        scan; a repeating unit of mixed layers (Gemma 3's five local and one global, Qwen3-MoE's
        dense and expert layers) is one scan over units, each step slicing every stack it uses
        its share, within a step each run of like layers one block again. A pattern one unit
        covers badly (Nemotron-H's) runs layer_segments' several units instead, units and runs
        nested in units, each scanned the same way. The params keep
        their stacked `layers` axis; each step slices its share, and with it the layers' index
        in the model, which a LoRA adapter's dropout draws its mask from.
        """
        compute = self.compute
        unroll = scan_unroll(compute)
        one_per_step = unroll is not True and unroll == 1  # (True == 1 in Python)

        shared_kv: dict = {}  # KV sharing (Gemma 4): attention kind (local) -> its store layer's (keys, values)
        # shared indexer layers: every layer's carry is (x, the selection's inputs) (_forward wraps x)
        carries_index = shared_indexer(self.cfg.layer_specs()) is not None

        def layer_fn(layer: LayerSpec, in_scan: bool, index=None, rows=(positions_bt, segment_ids_bt)):
            def run(block: Block, x):
                extra = {}
                if carries_index:
                    x, extra["index_state"] = x
                if per_layer_btlp is not None:  # this layer's per-layer input (Gemma 4)
                    extra["per_layer_btp"] = jax.lax.dynamic_index_in_dim(per_layer_btlp, index, 2, keepdims=False)
                if layer.kv_sharing == "reuse":
                    extra["shared_kv"] = shared_kv[layer.local]
                elif layer.kv_sharing == "store":
                    extra["store_kv"] = True
                if zamba is not None and getattr(layer.mixer, "kind", None) == "zamba2_hybrid":
                    extra["zamba"] = zamba
                with in_layer(index):
                    positions, segments = rows
                    x, kv, stats = block.forward(x, positions, segments, layer, **extra)
                return x, ((stats, kv) if layer.kv_sharing == "store" else stats)

            if compute.remat == "none":
                return run
            # Remat's guard against XLA merging a layer's recomputation with its forward pass
            # may go only where each loop iteration runs one layer; an unrolled scan puts
            # layers in straight-line code and keeps it.
            return nnx.remat(run, policy=REMAT_POLICIES[compute.remat], prevent_cse=not (in_scan and one_per_step))

        def kept(layer: LayerSpec, layer_stats):
            """A one-layer run's stats, a store layer's keys and values put aside (it is unique
            in the model, so never in a scan of like layers or of units)."""
            if layer.kv_sharing != "store":
                return layer_stats
            layer_stats, shared_kv[layer.local] = layer_stats
            return layer_stats

        items = self._slots()
        if not compute.scan_layers:
            stats = []
            for i, (layer, slot) in enumerate(items):
                block = getattr(self, layer.stack)[slot]
                x_btd, layer_stats = layer_fn(layer, in_scan=False, index=i)(block, x_btd)
                stats += _one_layer(kept(layer, layer_stats))
            return x_btd, _stack(stats)
        graphdefs, stacked = {}, {}
        for name, indices in self.cfg.layer_stacks():  # each layer's params and index in the model
            graphdefs[name], state = nnx.split(getattr(self, name))
            contiguous = indices == tuple(range(indices[0], indices[0] + len(indices)))
            stacked[name] = (
                state,
                jnp.arange(indices[0], indices[0] + len(indices)) if contiguous else jnp.array(indices),
            )
        if (stages := pipeline_stages()) > 1:  # pipeline parallelism: engine/ops/pipeline.py
            return self._pipelined(x_btd, (positions_bt, segment_ids_bt), graphdefs, stacked, layer_fn, stages), None

        def run_layers(x, state: dict, part: list[tuple[LayerSpec, int]], in_scan: bool):
            """The layers `part` ((kind, slot in `state`[its stack])), run by run of like layers."""
            stats = []
            for layer, first, length in _runs(part):
                graphdef, stack_state = graphdefs[layer.stack], state[layer.stack]
                if length == 1:
                    layer_state, index = _take_one(stack_state, first)
                    x, layer_stats = layer_fn(layer, in_scan, index)(nnx.merge(graphdef, layer_state), x)
                    stats += _one_layer(kept(layer, layer_stats))
                else:
                    assert layer.kv_sharing != "store", "a store layer is unique"

                    def step(x, one, layer=layer, graphdef=graphdef):
                        layer_state, index = one
                        return layer_fn(layer, True, index)(nnx.merge(graphdef, layer_state), x)

                    run_state = _take(stack_state, first, first + length)
                    x, run_stats = jax.lax.scan(step, x, run_state, unroll=unroll)
                    stats += _layers(run_stats)
            return x, _stack(stats)

        def units(state: dict, unit: list[tuple[LayerSpec, int]], steps: int):
            """(each stack's share of `steps` repeats of `unit` as (steps, slots per unit, ...),
            the unit's layers with their slots in one step's share)."""
            shares = _unit_shares(unit)
            by_unit = {
                name: jax.tree.map(
                    lambda a, c=count: a.reshape(steps, c, *a.shape[1:]),
                    _take(state[name], first, first + steps * count),
                )
                for name, (first, count) in shares.items()
            }
            return by_unit, [(layer, slot - shares[layer.stack][0]) for layer, slot in unit]

        def run_segments(x, state: dict, part: list[tuple[LayerSpec, int]], segments, in_scan: bool):
            """The layers `part` by a multi-unit schedule (layer_segments): runs as run_layers
            runs them, each unit one scan over its steps, its own segments inside."""
            stats = []
            for seg in segments:
                layers = part[seg.start : seg.start + seg.period * seg.steps]
                if seg.unit is None:
                    x, run_stats = run_layers(x, state, layers, in_scan)
                    stats += _layers(run_stats)
                    continue
                by_unit, in_unit = units(state, layers[: seg.period], seg.steps)

                def unit_step(x, unit_state, in_unit=in_unit, inner=seg.unit):
                    return run_segments(x, unit_state, in_unit, inner, True)

                x, unit_stats = jax.lax.scan(unit_step, x, by_unit, unroll=unroll)
                if unit_stats is not None:  # (steps, layers per unit, ...) -> (steps * those, ...)
                    stats.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), unit_stats))
            return x, _stack(stats)

        def split(parts) -> dict:
            """`stacked` with each stack cut once into the ranges `parts` take (_Pieces)."""
            return {name: _split_stack(stacked[name], r) for name, r in _stack_ranges(parts).items()}

        segments = layer_segments([layer for layer, _ in items])
        if segments is not None:
            parts = [
                (items[g.start : g.start + g.steps], None)
                if g.unit is None
                else (items[g.start : g.start + g.period], g.steps)
                for g in segments
            ]
            return run_segments(x_btd, split(parts), items, segments, False)
        start, period, steps = layer_schedule([layer for layer, _ in items])
        stacked = split(
            [
                (items[:start], None),
                (items[start : start + period], steps or None),
                (items[start + period * steps :], None),
            ]
        )
        x_btd, before = run_layers(x_btd, stacked, items[:start], False)
        stats = _layers(before)
        if steps:
            by_unit, in_unit = units(stacked, items[start : start + period], steps)
            x_btd, unit_stats = jax.lax.scan(
                lambda x, unit_state: run_layers(x, unit_state, in_unit, True), x_btd, by_unit, unroll=unroll
            )
            if unit_stats is not None:  # (steps, experts' layers per unit, ...) -> (steps * those, ...)
                stats.append(jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), unit_stats))
            x_btd, after = run_layers(x_btd, stacked, items[start + period * steps :], False)
            stats += _layers(after)
        return x_btd, _stack(stats)

    def _pipelined(self, x_btd, rows, graphdefs, stacked, layer_fn, stages: int):
        """The layers as `stages` pipeline stages of consecutive layers (engine/ops/pipeline.py:
        gpipe), each stage's layers one scan; a stack of like layers without experts only."""
        layers = self.cfg.layer_specs()
        if len(set(layers)) > 1 or layers[0].is_moe:
            raise ConfigError(
                f"mesh.pipeline: the layers of family {self.cfg.family} are not all alike or have "
                "experts; pipeline stages need one stack of identical dense layers (use pipeline 1)"
            )
        ((name, (state, index)),) = stacked.items()
        graphdef, layer = graphdefs[name], layers[0]

        def stage(stage_state, x_btd, stage_rows):
            def step(x, one):
                layer_state, i = one
                return layer_fn(layer, True, i, stage_rows)(nnx.merge(graphdef, layer_state), x)[0], None

            return jax.lax.scan(step, x_btd, stage_state, unroll=scan_unroll(self.compute))[0]

        microbatches = self.compute.pipeline_microbatches or stages
        return gpipe(stage, (state, index), x_btd, rows, stages=stages, microbatches=microbatches)

    def _decode_blocks(self, x_btd, positions_bt, segment_ids_bt, cache: KVCache, per_layer_btlp=None, zamba=None):
        """The blocks with a KV cache; each layer writes its slots of the stacked cache in place.

        Unrolled even for stacked params: with a static layer index XLA updates the cache in
        place, where a scan carrying it copied the whole cache every layer (3x slower decode
        at batch 32, bench/sample.py).
        """
        valid_bt = segment_ids_bt != 0
        cache = cache.replace(valid_bs=jax.lax.dynamic_update_slice(cache.valid_bs, valid_bt, (0, cache.end)))
        stacks = {}
        for name, _ in self.cfg.layer_stacks():
            if self.compute.scan_layers:
                stacks[name] = nnx.split(getattr(self, name))
        # RoPE's cos and sin once per step for all global (local) layers: XLA:CPU kept each
        # layer's table lookups apart, four small gathers per layer in every decode step.
        rotary: dict[tuple[RotarySpec, int], tuple] = {}  # (RoPE, head width) -> (cos, sin)
        store: dict[bool, int] = {}  # KV sharing (Gemma 4): attention kind (local) -> the layer whose cache it reads
        # shared indexer layers: the last indexer's selection inputs, its keys the cached ones (MLA)
        index_state = () if shared_indexer(self.cfg.layer_specs()) is not None else None
        for i, (layer, slot) in enumerate(self._slots()):
            if self.compute.scan_layers:
                graphdef, stacked = stacks[layer.stack]
                block = nnx.merge(graphdef, jax.tree.map(lambda a, j=slot: a[j], stacked))
            else:
                block = getattr(self, layer.stack)[slot]
            extra = {}
            if isinstance(layer.mixer, AttentionSpec) and layer.mixer.rope is not None:
                key = (layer.mixer.rope, layer.mixer.head_dim)
                if key not in rotary:
                    rotary[key] = layer_rotary(positions_bt, layer.mixer.rope, layer.mixer.head_dim, cache.length)
                extra["rotary"] = rotary[key]
            if layer.kv_sharing == "store":
                store[layer.local] = i
            if per_layer_btlp is not None:
                extra["per_layer_btp"] = per_layer_btlp[:, :, i]
            if index_state is not None:
                extra["index_state"] = index_state
            if zamba is not None and getattr(layer.mixer, "kind", None) == "zamba2_hybrid":
                extra["zamba"] = zamba
            x_btd, cache = block(
                x_btd,
                positions_bt,
                segment_ids_bt,
                layer,
                cache.replace(layer=store[layer.local] if layer.kv_sharing == "reuse" else i),
                **extra,
            )
            if index_state is not None:
                x_btd, index_state = x_btd
        return x_btd, cache.replace(end=cache.end + x_btd.shape[1], layer=0)

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache: KVCache | None = None):
        """Logits (b, t, v) in the compute dtype. Packed rows pass positions and segments;
        positions lie in [0, t), or, with a cache, below its length (RoPE's table, rope.py).

        Decoding passes a KVCache (segment id 0 marks left padding) and gets (logits, cache),
        the logits in float32 whatever the compute dtype: the LM head's product accumulates in
        f32 anyway, and the sampler's softmax and draw take them unrounded.
        """
        if cache is None:
            return self.forward(tokens_bt, positions_bt, segment_ids_bt)[0]
        return self._forward(tokens_bt, positions_bt, segment_ids_bt, cache)[0::2]

    def forward(self, tokens_bt, positions_bt=None, segment_ids_bt=None, *, lm_head: bool = True):
        """(logits, aux) without a cache: aux is a mixture of experts' router losses and
        expert loads (engine/models/moe.py: combine_stats) and `aux_loss`, their sum weighted
        as ComputeConfig says, to add to the training loss; empty for a dense model. Without
        the `lm_head`: the final-normed hidden states (b, t, d) in place of the logits."""
        with weight_grads_in(self.compute.weight_grad_dtype):  # what the backward's products round to
            hidden: list | None = [] if self.cfg.mtp_layers and self.compute.mtp_loss and lm_head else None
            logits_btv, stats, _ = self._forward(tokens_bt, positions_bt, segment_ids_bt, None, lm_head, hidden)
            if hidden:  # multi-token prediction (engine/models/mtp.py): its loss joins aux_loss
                mtp_ce = mtp_loss(self, hidden[0], tokens_bt, positions_bt, segment_ids_bt)
        indexer_kl = None
        if isinstance(stats, WithIndexerLoss):  # sparse attention's indexer trains (dsa.py)
            stats, indexer_kl = stats
            if self.compute.indexer_loss == "warmup":  # the dense warm-up: only the indexer learns
                logits_btv = jax.lax.stop_gradient(logits_btv)
        if stats is None and indexer_kl is None:
            return logits_btv, {}
        aux = {"aux_loss": jnp.zeros((), jnp.float32)}
        if stats is not None:
            aux = combine_stats(stats, self.cfg.moe.num_experts, self.cfg.moe.experts_per_token)
            aux["aux_loss"] = (
                self.compute.moe_balance_loss * aux["balance_loss"]
                + self.compute.moe_router_z_loss * aux["router_z_loss"]
            )
        if indexer_kl is not None:  # the mean over layers of each one's mean over query tokens
            aux["indexer_loss"] = jnp.mean(indexer_kl)
            aux["aux_loss"] = aux["aux_loss"] + self.compute.indexer_loss_weight * aux["indexer_loss"]
        if hidden:
            aux["mtp_loss"] = mtp_ce
            aux["aux_loss"] = aux["aux_loss"] + self.compute.mtp_loss * mtp_ce
        return logits_btv, aux

    def hidden_states(self, tokens_bt, positions_bt=None, segment_ids_bt=None):
        """(final-normed hidden states (b, t, d) in the compute dtype, aux as `forward`'s):
        what a head other than the LM head reads (a reward model's score,
        engine/posttrain/reward_model.py), by `forward`'s path stopped before the head."""
        return self.forward(tokens_bt, positions_bt, segment_ids_bt, lm_head=False)

    def _forward(
        self, tokens_bt, positions_bt, segment_ids_bt, cache: KVCache | None, lm_head: bool = True, hidden=None
    ):
        """(logits, router stats of every layer or None, cache or None); without the `lm_head`,
        the final-normed hidden states in place of the logits, which a list `hidden` gets too."""
        cfg = self.cfg
        dt = _dtype(self.compute.dtype)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        x_btd = self.embed_vd[...].astype(dt)[tokens_bt]
        if cfg.embedding.scale:  # the factor rounded to the compute dtype, as Gemma does
            x_btd = x_btd * jnp.asarray(math.sqrt(cfg.d_model), dt)
        if cfg.embedding.multiplier is not None:  # Granite
            x_btd = x_btd * jnp.asarray(cfg.embedding.multiplier, dt)
        if cfg.positions == "learned":  # GPT-2, OPT: each position's own embedding added
            x_btd = x_btd + self.pos_embed_pd[...].astype(dt)[positions_bt + cfg.embedding.position_offset]
        if cfg.embedding.norm:  # BLOOM
            x_btd = self.embed_norm(x_btd)
        if (hyper := cfg.layer_specs()[0].hyper) is not None:  # DeepSeek-V4: n copies of the stream
            x_btd = streams_of(x_btd, hyper.streams)
        if (gated := cfg.layer_specs()[0].gated_residual) is not None:  # Qwen4-Exp: n copies too
            x_btd = streams_of(x_btd, gated.streams)
        shortcut = cfg.block.shortcut_moe  # LongCat-Flash: the stream and the carried experts' output
        if shortcut:
            x_btd = jnp.concatenate([x_btd, jnp.zeros_like(x_btd)], axis=-1)
        x_btd = constrain(x_btd, ("act_batch", "act_seq", "act_embed"))
        hashed = hash_routing.set_tokens(tokens_bt)  # what hash-routed experts read (hash_routing.py)
        per_layer_btlp = self._per_layer_inputs(tokens_bt, x_btd) if cfg.embedding.per_layer_input_dim else None
        if hasattr(self, "altup_streams"):  # Gemma 3n: the embedding and its projections, n streams
            x_btd = self.altup_streams.expand(x_btd)
        zamba = None
        if cfg.zamba2 is not None:  # Zamba2: its shared blocks and the embeddings, for the hybrid layers
            blocks = tuple(nnx.split(getattr(self, f"zamba2_shared_{b}")) for b in range(cfg.zamba2.shared_blocks))
            zamba = (blocks, x_btd)
        stats = None
        if cache is None:  # segment_ids_bt None: one unpadded document per row, no mask needed
            with matmuls_in(self.compute.matmul_precision):  # fp8/int8 recipes: the layers' products only
                indexer = shared_indexer(cfg.layer_specs())
                carried: Any = x_btd  # the layers carry (x, the last indexer's selection inputs)
                if indexer is not None:
                    carried = (x_btd, _initial_index_state(x_btd, indexer))
                carried, stats = self._run_blocks(carried, positions_bt, segment_ids_bt, per_layer_btlp, zamba)
                x_btd = carried[0] if indexer is not None else carried
        else:
            if segment_ids_bt is None:
                segment_ids_bt = jnp.ones_like(tokens_bt)
            x_btd, cache = self._decode_blocks(x_btd, positions_bt, segment_ids_bt, cache, per_layer_btlp, zamba)
        hash_routing.reset(hashed)
        if hasattr(self, "hc_head"):
            if hidden is not None:  # DeepSeek-V4's multi-token prediction reads the streams
                hidden.append(x_btd)
            x_btd = self.hc_head(x_btd)
        if hasattr(self, "altup_streams"):
            x_btd = self.altup_streams.collapse(x_btd)
        if shortcut:
            x_btd = x_btd[..., : cfg.d_model]
        with jax.named_scope("lm_head"):
            x_btd = self.final_norm(x_btd) if hasattr(self, "final_norm") else self.gr_head.read(x_btd)[0]
            if hidden is not None and not hidden:  # the multi-token-prediction layer's input (forward)
                hidden.append(x_btd)
            if not lm_head:
                return x_btd, stats, cache
            head_dv = self.embed_vd[...].T if cfg.tie_embeddings else self.lm_head_dv[...]
            if cache is None:
                # On CPU the logits stay float32, as the loss reads them: XLA:CPU would write
                # out a rounded copy and a float32 one of this, the step's largest tensor.
                logits_btv = dense(
                    x_btd,
                    head_dv.astype(dt),
                    float32_out=uses_cpu_backward(self.matmul_backward),
                    backward=self.matmul_backward,
                    dot_general=self.dot_general,
                )
            else:  # decoding: f32 logits, not rounded to the compute dtype
                logits_btv = self.dot_general(
                    x_btd, head_dv.astype(dt), (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32
                )
        bias_v = self.lm_head_bias_v[...] if cfg.head.bias else None
        return finish_logits(cfg, logits_btv, bias_v), stats, cache

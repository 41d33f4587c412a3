"""The decoder-only transformer, in Flax NNX.

One implementation; model families are configs (engine/models/config.py: ModelConfig). Shapes are
in names: b batch, t query positions, s key positions, d d_model, n query heads, k kv heads,
g query heads per kv head, h head_dim, f mlp_dim, v vocab.

Every parameter carries logical axis names (its `sharding_names` metadata) that
engine/ops/partitioning.py maps to mesh axes; activations are constrained at block boundaries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from engine.models.config import ComputeConfig, ModelConfig, RopeScaling
from engine.models.kv_cache import KVCache
from engine.ops.attention import causal_attention, dot_product_attention
from engine.ops.dense import dense, gated_mlp
from engine.ops.partitioning import constrain

# Parameters are created unsharded and placed by engine/models/params.py under jit with the
# shardings the rules table gives; NNX's eager sharding would need a mesh at construction.
nnx.use_eager_sharding(False)

def _dtype(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def _param(rngs: nnx.Rngs, shape, std: float, names, dtype) -> nnx.Param:
    """All weight matrices are initialised here: N(0, std^2), the GPT-2/Llama recipe."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=names)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, in float32. Zero-centred (Gemma): * (1 + scale), scale starting at 0."""

    def __init__(self, dim: int, eps: float, param_dtype, *, zero_centered: bool = False, rngs: nnx.Rngs):
        init = jnp.zeros if zero_centered else jnp.ones
        self.scale = nnx.Param(init((dim,), param_dtype), out_sharding=("norm",))
        self.eps, self.zero_centered = eps, zero_centered

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...].astype(jnp.float32)
        return (x32 * (1.0 + scale if self.zero_centered else scale)).astype(x.dtype)


def _norm(cfg: ModelConfig, compute: ComputeConfig, dim: int, rngs: nnx.Rngs) -> RMSNorm:
    return RMSNorm(dim, cfg.norm_eps, _dtype(compute.param_dtype), zero_centered=cfg.norm_zero_centered, rngs=rngs)


# --------------------------------------------------------------------------- RoPE


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Per-pair rotation frequencies; Llama-3 scaling stretches the low frequencies."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    low_wavelen = scaling.original_max_position / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return jnp.where(medium, (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq, scaled)


def apply_rope(x_btnh, positions_bt, inv_freq_h2):
    """Rotate (first half, second half) pairs, the convention of HF Llama checkpoints."""
    angles_bth2 = positions_bt[..., None].astype(jnp.float32) * inv_freq_h2
    cos = jnp.cos(angles_bth2)[:, :, None, :]
    sin = jnp.sin(angles_bth2)[:, :, None, :]
    x1, x2 = jnp.split(x_btnh.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x_btnh.dtype)


class Attention(nnx.Module):
    """Grouped-query attention with RoPE. Local (sliding-window) or global is chosen per call,
    so one stacked set of layers can mix both (Gemma 2/3)."""

    def __init__(self, cfg: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pdt, std = _dtype(compute.param_dtype), cfg.init_std
        self.wq_dnh = _param(rngs, (d, n, h), std, ("embed", "heads", "head_dim"), pdt)
        self.wk_dkh = _param(rngs, (d, k, h), std, ("embed", "kv_heads", "head_dim"), pdt)
        self.wv_dkh = _param(rngs, (d, k, h), std, ("embed", "kv_heads", "head_dim"), pdt)
        if cfg.qkv_bias:
            self.bq_nh = nnx.Param(jnp.zeros((n, h), pdt), out_sharding=("heads", "head_dim"))
            self.bk_kh = nnx.Param(jnp.zeros((k, h), pdt), out_sharding=("kv_heads", "head_dim"))
            self.bv_kh = nnx.Param(jnp.zeros((k, h), pdt), out_sharding=("kv_heads", "head_dim"))
        if cfg.qk_norm:
            self.q_norm = _norm(cfg, compute, h, rngs)
            self.k_norm = _norm(cfg, compute, h, rngs)
        # Residual-branch outputs are scaled down with depth (GPT-2) so the stream stays O(1).
        out_std = std / math.sqrt(2 * cfg.num_layers)
        self.wo_nhd = _param(rngs, (n, h, d), out_std, ("heads", "head_dim", "embed"), pdt)
        self.head_dim, self.rope_theta, self.rope_scaling = h, cfg.rope_theta, cfg.rope_scaling
        self.rope_local_theta, self.sliding_window = cfg.rope_local_theta, cfg.sliding_window
        self.qkv_bias, self.qk_norm = cfg.qkv_bias, cfg.qk_norm
        self.scale = (cfg.query_pre_attn_scalar or h) ** -0.5
        self.softcap = cfg.attn_logit_softcap
        self.dtype = _dtype(compute.dtype)
        self.attention_block = compute.attention_block

    def _inverse_frequencies(self, local):
        inv_freq = rope_inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        if self.rope_local_theta is None:
            return inv_freq
        return jnp.where(local, rope_inverse_frequencies(self.head_dim, self.rope_local_theta, None), inv_freq)

    def __call__(self, x_btd, positions_bt, segment_ids_bt, local=False, cache: KVCache | None = None):
        """`local` (a bool, traced under scan) selects the sliding window and local RoPE base.
        With a cache (decoding) returns (out, updated cache)."""
        dt = self.dtype
        inv_freq = self._inverse_frequencies(local)
        q = dense(x_btd, self.wq_dnh[...].astype(dt))
        k = dense(x_btd, self.wk_dkh[...].astype(dt))
        v = dense(x_btd, self.wv_dkh[...].astype(dt))
        if self.qkv_bias:
            q, k, v = q + self.bq_nh[...].astype(dt), k + self.bk_kh[...].astype(dt), v + self.bv_kh[...].astype(dt)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", None))
        q = checkpoint_name(apply_rope(q, positions_bt, inv_freq), "qkv_proj")
        k = checkpoint_name(apply_rope(k, positions_bt, inv_freq), "qkv_proj")
        v = checkpoint_name(v, "qkv_proj")
        if cache is None:
            with jax.named_scope("core"):
                out_btnh = causal_attention(q, k, v, segment_ids_bt, scale=self.scale, softcap=self.softcap,
                                            window=self.sliding_window, local=local, block=self.attention_block)
        else:  # decoding: attend over the cache, this step's keys and values written into it
            k, v, mask, cache = cache.update(k, v, window=self.sliding_window, local=local)
            out_btnh = dot_product_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap)
        out_btd = dense(out_btnh, self.wo_nhd[...].astype(dt), 2)
        return out_btd if cache is None else (out_btd, cache)


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (gelu_tanh)."""

    def __init__(self, cfg: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        pdt, std = _dtype(compute.param_dtype), cfg.init_std
        self.w_gate_df = _param(rngs, (d, f), std, ("embed", "mlp"), pdt)
        self.w_up_df = _param(rngs, (d, f), std, ("embed", "mlp"), pdt)
        self.w_down_fd = _param(rngs, (f, d), std / math.sqrt(2 * cfg.num_layers), ("mlp", "embed"), pdt)
        self.activation = ACTIVATIONS[cfg.activation]
        self.dtype = _dtype(compute.dtype)

    def __call__(self, x_btd):
        dt = self.dtype
        return gated_mlp(x_btd, self.w_gate_df[...].astype(dt), self.w_up_df[...].astype(dt),
                         self.w_down_fd[...].astype(dt), self.activation, ("act_batch", "act_seq", "act_mlp"))


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)). With post_norms
    (Gemma 2/3) each branch output is normalised again before the add.

    `self.mlp` is the replaceable slot: anything mapping (b, t, d) -> (b, t, d) fits.
    """

    def __init__(self, cfg: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        self.attn_norm = _norm(cfg, compute, cfg.d_model, rngs)
        self.attn = Attention(cfg, compute, rngs=rngs)
        self.mlp_norm = _norm(cfg, compute, cfg.d_model, rngs)
        self.mlp = MLP(cfg, compute, rngs=rngs)
        if cfg.post_norms:
            self.post_attn_norm = _norm(cfg, compute, cfg.d_model, rngs)
            self.post_mlp_norm = _norm(cfg, compute, cfg.d_model, rngs)
        self.post_norms = cfg.post_norms

    def __call__(self, x_btd, positions_bt, segment_ids_bt, local=False, cache: KVCache | None = None):
        with jax.named_scope("attention"):  # names the ops in profiles (bench/profile_step.py)
            attn_out = self.attn(self.attn_norm(x_btd), positions_bt, segment_ids_bt, local, cache)
        if cache is not None:
            attn_out, cache = attn_out
        x_btd = x_btd + (self.post_attn_norm(attn_out) if self.post_norms else attn_out)
        with jax.named_scope("mlp"):
            mlp_out = self.mlp(self.mlp_norm(x_btd))
        x_btd = x_btd + (self.post_mlp_norm(mlp_out) if self.post_norms else mlp_out)
        x_btd = constrain(x_btd, ("act_batch", "act_seq", "act_embed"))
        return x_btd if cache is None else (x_btd, cache)


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv_proj"),
}


class Transformer(nnx.Module):
    """The decoder: embeddings, `num_layers` blocks (stacked for lax.scan, or a list), the
    final norm and the LM head. `compute` says how (dtypes, scan, remat, attention blocks)."""

    def __init__(self, cfg: ModelConfig, compute: ComputeConfig | None = None, *, rngs: nnx.Rngs):
        compute = compute or ComputeConfig()
        self.cfg, self.compute = cfg, compute
        pdt = _dtype(compute.param_dtype)
        self.embed_vd = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"), pdt)
        if compute.scan_layers:
            self.blocks = self._stacked_blocks(cfg, compute, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, compute, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = _norm(cfg, compute, cfg.d_model, rngs)
        if not cfg.tie_embeddings:
            self.lm_head_dv = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, ("embed", "vocab"), pdt)

    @staticmethod
    def _stacked_blocks(cfg: ModelConfig, compute: ComputeConfig, rngs: nnx.Rngs) -> Block:
        """One Block whose every parameter has a leading `layers` axis, for lax.scan."""

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(cfg, compute, rngs=rngs)

        return make(rngs)

    def _run_blocks(self, x_btd, positions_bt, segment_ids_bt):
        cfg, compute = self.cfg, self.compute

        def layer(block: Block, x, local):
            return block(x, positions_bt, segment_ids_bt, local)

        if compute.remat != "none":
            layer = nnx.remat(layer, policy=REMAT_POLICIES[compute.remat], prevent_cse=not compute.scan_layers)
        is_local = cfg.layer_is_local()
        if not compute.scan_layers:
            for block, local in zip(self.blocks, is_local):
                x_btd = layer(block, x_btd, local)
            return x_btd
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer_state_and_local):
            layer_state, local = layer_state_and_local
            return layer(nnx.merge(graphdef, layer_state), x, local), None

        # Whether each layer is local rides along the scan as data: one compiled block.
        x_btd, _ = jax.lax.scan(body, x_btd, (stacked, jnp.asarray(is_local)))
        return x_btd

    def _decode_blocks(self, x_btd, positions_bt, segment_ids_bt, cache: KVCache):
        """The blocks with a KV cache; each layer writes its slots of the stacked cache in place.

        Unrolled even for stacked params: with a static layer index XLA updates the cache in
        place, where a scan carrying it copied the whole cache every layer (3x slower decode
        at batch 32, bench/sample.py).
        """
        valid_bt = segment_ids_bt != 0
        cache = cache.replace(valid_bs=jax.lax.dynamic_update_slice(cache.valid_bs, valid_bt, (0, cache.end)))
        if self.compute.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)
            blocks = [nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], stacked))
                      for i in range(self.cfg.num_layers)]
        else:
            blocks = list(self.blocks)
        for i, (block, local) in enumerate(zip(blocks, self.cfg.layer_is_local())):
            x_btd, cache = block(x_btd, positions_bt, segment_ids_bt, local, cache.replace(layer=i))
        return x_btd, cache.replace(end=cache.end + x_btd.shape[1], layer=0)

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None, cache: KVCache | None = None):
        """Logits (b, t, v) in the compute dtype. Packed rows pass positions and segments.

        Decoding passes a KVCache (segment id 0 marks left padding) and gets (logits, cache).
        """
        cfg = self.cfg
        dt = _dtype(self.compute.dtype)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones_like(tokens_bt)
        x_btd = self.embed_vd[...].astype(dt)[tokens_bt]
        if cfg.scale_embeddings:  # the factor rounded to the compute dtype, as Gemma does
            x_btd = x_btd * jnp.asarray(math.sqrt(cfg.d_model), dt)
        x_btd = constrain(x_btd, ("act_batch", "act_seq", "act_embed"))
        if cache is None:
            x_btd = self._run_blocks(x_btd, positions_bt, segment_ids_bt)
        else:
            x_btd, cache = self._decode_blocks(x_btd, positions_bt, segment_ids_bt, cache)
        with jax.named_scope("lm_head"):
            x_btd = self.final_norm(x_btd)
            head_dv = self.embed_vd[...].T if cfg.tie_embeddings else self.lm_head_dv[...]
            logits_btv = dense(x_btd, head_dv.astype(dt))
        if cfg.final_logit_softcap is not None:
            cap = cfg.final_logit_softcap
            logits_btv = (cap * jnp.tanh(logits_btv.astype(jnp.float32) / cap)).astype(dt)
        logits_btv = constrain(logits_btv, ("act_batch", "act_seq", "act_vocab"))
        return logits_btv if cache is None else (logits_btv, cache)

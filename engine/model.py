"""The decoder-only transformer, in Flax NNX.

One implementation; model families are configs (engine/config.py: ModelConfig). Shapes are
in names: b batch, t query positions, s key positions, d d_model, n query heads, k kv heads,
g query heads per kv head, h head_dim, f mlp_dim, v vocab.

Every parameter carries logical axis names (its `sharding_names` metadata) that
engine/sharding.py maps to mesh axes; activations are constrained at block boundaries.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from engine.config import ModelConfig, RopeScaling
from engine.sharding import constrain

# Parameters are created unsharded and placed by engine/train.py under jit with the
# shardings the rules table gives; NNX's eager sharding would need a mesh at construction.
nnx.use_eager_sharding(False)

NEG_INF = -1e30  # finite, so fully masked (padding) rows give a uniform softmax, not NaN


def _dtype(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


def _param(rngs: nnx.Rngs, shape, std: float, names, dtype) -> nnx.Param:
    """All weight matrices are initialised here: N(0, std^2), the GPT-2/Llama recipe."""
    value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value.astype(dtype), out_sharding=names)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * self.scale[...].astype(jnp.float32)).astype(x.dtype)


# --------------------------------------------------------------------------- RoPE


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> jax.Array:
    """Per-pair rotation frequencies; Llama-3 scaling stretches the low frequencies."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
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


# --------------------------------------------------------------------------- attention


def attention_mask(segment_q_bt, segment_k_bs, positions_q_bt=None, positions_k_bs=None):
    """Causal within a packed document: query i sees key j iff j <= i and same segment.

    Segment id 0 marks padding. Causality is by row index, which equals position order
    inside each packed segment.
    """
    t, s = segment_q_bt.shape[1], segment_k_bs.shape[1]
    causal_ts = jnp.arange(t)[:, None] + (s - t) >= jnp.arange(s)[None, :]
    same_bts = segment_q_bt[:, :, None] == segment_k_bs[:, None, :]
    valid_bs = (segment_k_bs != 0)[:, None, :]
    return causal_ts[None] & same_bts & valid_bs


def dot_product_attention(q_btnh, k_bskh, v_bskh, mask_bts):
    """Grouped-query attention; softmax in float32."""
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(h)
    scores = jnp.where(mask_bts[:, None, None], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_bskh.dtype)
    out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs, v_bskh)
    return out_btkgh.reshape(b, t, n, h)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        pdt, std = _dtype(cfg.param_dtype), cfg.init_std
        self.wq_dnh = _param(rngs, (d, n, h), std, ("embed", "heads", "head_dim"), pdt)
        self.wk_dkh = _param(rngs, (d, k, h), std, ("embed", "kv_heads", "head_dim"), pdt)
        self.wv_dkh = _param(rngs, (d, k, h), std, ("embed", "kv_heads", "head_dim"), pdt)
        # Residual-branch outputs are scaled down with depth (GPT-2) so the stream stays O(1).
        out_std = std / math.sqrt(2 * cfg.num_layers)
        self.wo_nhd = _param(rngs, (n, h, d), out_std, ("heads", "head_dim", "embed"), pdt)
        self.head_dim, self.rope_theta, self.rope_scaling = h, cfg.rope_theta, cfg.rope_scaling
        self.dtype = _dtype(cfg.dtype)

    def __call__(self, x_btd, positions_bt, segment_ids_bt):
        dt = self.dtype
        inv_freq = rope_inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling)
        q = jnp.einsum("btd,dnh->btnh", x_btd, self.wq_dnh[...].astype(dt))
        k = jnp.einsum("btd,dkh->btkh", x_btd, self.wk_dkh[...].astype(dt))
        v = jnp.einsum("btd,dkh->btkh", x_btd, self.wv_dkh[...].astype(dt))
        q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", None))
        q = checkpoint_name(apply_rope(q, positions_bt, inv_freq), "qkv_proj")
        k = checkpoint_name(apply_rope(k, positions_bt, inv_freq), "qkv_proj")
        v = checkpoint_name(v, "qkv_proj")
        mask = attention_mask(segment_ids_bt, segment_ids_bt)
        out_btnh = dot_product_attention(q, k, v, mask)
        return jnp.einsum("btnh,nhd->btd", out_btnh, self.wo_nhd[...].astype(dt))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.mlp_dim
        pdt, std = _dtype(cfg.param_dtype), cfg.init_std
        self.w_gate_df = _param(rngs, (d, f), std, ("embed", "mlp"), pdt)
        self.w_up_df = _param(rngs, (d, f), std, ("embed", "mlp"), pdt)
        self.w_down_fd = _param(rngs, (f, d), std / math.sqrt(2 * cfg.num_layers), ("mlp", "embed"), pdt)
        self.dtype = _dtype(cfg.dtype)

    def __call__(self, x_btd):
        dt = self.dtype
        gate = jnp.einsum("btd,df->btf", x_btd, self.w_gate_df[...].astype(dt))
        up = jnp.einsum("btd,df->btf", x_btd, self.w_up_df[...].astype(dt))
        h_btf = constrain(jax.nn.silu(gate) * up, ("act_batch", "act_seq", "act_mlp"))
        return jnp.einsum("btf,fd->btd", h_btf, self.w_down_fd[...].astype(dt))


class Block(nnx.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pdt = _dtype(cfg.param_dtype)
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_btd, positions_bt, segment_ids_bt):
        x_btd = x_btd + self.attn(self.attn_norm(x_btd), positions_bt, segment_ids_bt)
        x_btd = x_btd + self.mlp(self.mlp_norm(x_btd))
        return constrain(x_btd, ("act_batch", "act_seq", "act_embed"))


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block
    "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("qkv_proj"),
}


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = _dtype(cfg.param_dtype)
        self.embed_vd = _param(rngs, (cfg.vocab_size, cfg.d_model), cfg.init_std, ("vocab", "embed"), pdt)
        if cfg.scan_layers:
            self.blocks = self._stacked_blocks(cfg, rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, pdt, rngs=rngs)
        if not cfg.tie_embeddings:
            self.lm_head_dv = _param(rngs, (cfg.d_model, cfg.vocab_size), cfg.init_std, ("embed", "vocab"), pdt)

    @staticmethod
    def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs) -> Block:
        """One Block whose every parameter has a leading `layers` axis, for lax.scan."""

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Block(cfg, rngs=rngs)

        return make(rngs)

    def _run_blocks(self, x_btd, positions_bt, segment_ids_bt):
        cfg = self.cfg

        def layer(block: Block, x):
            return block(x, positions_bt, segment_ids_bt)

        if cfg.remat != "none":
            layer = nnx.remat(layer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
        if not cfg.scan_layers:
            for block in self.blocks:
                x_btd = layer(block, x_btd)
            return x_btd
        graphdef, stacked = nnx.split(self.blocks)

        def body(x, layer_state):
            return layer(nnx.merge(graphdef, layer_state), x), None

        x_btd, _ = jax.lax.scan(body, x_btd, stacked)
        return x_btd

    def __call__(self, tokens_bt, positions_bt=None, segment_ids_bt=None):
        """Logits (b, t, v) in the compute dtype. Packed rows pass positions and segments."""
        cfg = self.cfg
        dt = _dtype(cfg.dtype)
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
        if segment_ids_bt is None:
            segment_ids_bt = jnp.ones_like(tokens_bt)
        x_btd = self.embed_vd[...].astype(dt)[tokens_bt]
        x_btd = constrain(x_btd, ("act_batch", "act_seq", "act_embed"))
        x_btd = self._run_blocks(x_btd, positions_bt, segment_ids_bt)
        x_btd = self.final_norm(x_btd)
        head_dv = self.embed_vd[...].T if cfg.tie_embeddings else self.lm_head_dv[...]
        logits_btv = jnp.einsum("btd,dv->btv", x_btd, head_dv.astype(dt))
        return constrain(logits_btv, ("act_batch", "act_seq", "act_vocab"))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), the PaLM accounting."""
    dense = cfg.num_params(include_embedding=False) + cfg.vocab_size * cfg.d_model  # lm head matmul
    attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len  # QK^T and PV, causal-unaware
    return 6 * dense + 6 * attention

"""AltUp, alternating updates (Gemma 3n; arXiv 2301.13310): the residual stream is n streams
of the model width, and each layer computes on one of them only (the `active` one) and updates
all n from what it computed.

Per layer and token, from the streams x_1..x_n (transformers' Gemma3nTextAltUp):

    m      = tanh(router(norm(x_a) / d))                     (n,)    modality weights
    pred_k = x_k + sum_j P(m)[k, j] x_j                      P(m) = (m . W_pred) as (n, n)
    y      = layer(pred_a)                                   the layer's usual work, on one stream
    c      = 1 + m' . W_corr,  m' = tanh(router(norm(y) / d))
    x'_k   = pred_k + c_k (y - pred_a)                       every stream corrected by the innovation

after which Gemma 3n's per-layer input, gated by the corrected active stream (times a learned
scale), is added to streams 1..n-1. The model starts the streams as the embedding and n - 1
projections of it rescaled to its RMS (AltUpStreams.expand), and ends with the mean of stream
0 and n - 1 projections back, rescaled likewise (collapse). The decoder carries the streams as
one (b, t, n d) array, as hyper_connection.py does, so the layer scan and the activation
sharding see the usual rank.

The layer itself (altup_layer) is Gemma 3n's: the attention beside LAuReL (laurel.py), the
two averaged, then the MLP, each sublayer with its norms after as before it.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx

from engine.models.common import Build, make_norm, param
from engine.models.lora import project
from engine.models.specs import AltUpSpec, LayerSpec, MLPSpec, NormSpec


def _streams(x_btx, n: int):
    b, t, _ = x_btx.shape
    return x_btx.reshape(b, t, n, -1)


class AltUp(nnx.Module):
    """One layer's prediction and correction (transformers' layer.altup): the router and its
    norm, the prediction (n -> n n) and correction (n -> n) coefficients, the output scale."""

    def __init__(self, spec: AltUpSpec, norm: NormSpec, build: Build, *, rngs: nnx.Rngs):
        d, n, pdt, std = build.d_model, spec.streams, build.param_dtype, build.init_std
        self.w_router_dn = param(rngs, (d, n), std, ("embed", None), pdt)
        self.router_norm = make_norm(norm, d, pdt, rngs=rngs)
        self.w_predict_nm = param(rngs, (n, n * n), std, (None, None), pdt)
        self.w_correct_nn = param(rngs, (n, n), std, (None, None), pdt)
        self.correct_scale_d = nnx.Param(jnp.zeros((d,), pdt), out_sharding=("norm",))
        self.spec, self.d = spec, d

    def _coefs(self, weight):
        w = weight[...].astype(jnp.float32)
        clip = self.spec.coef_clip
        return w if clip is None else jnp.clip(w, -clip, clip)

    def modalities(self, x_btd):
        """tanh(router(norm(x) / d)) in float32, (b, t, n)."""
        routed = self.router_norm(x_btd).astype(jnp.float32) * (1.0 / self.d)
        return jnp.tanh(routed @ self.w_router_dn[...].astype(jnp.float32))

    def predict(self, x_btnd):
        """Each stream plus its mix of all n: (b, t, n, d) in x's dtype."""
        n = self.spec.streams
        m_btn = self.modalities(x_btnd[:, :, self.spec.active])
        mix_btkj = (m_btn @ self._coefs(self.w_predict_nm)).reshape(*m_btn.shape[:2], n, n)
        mixed = jnp.einsum("btkj,btjd->btkd", mix_btkj, x_btnd.astype(jnp.float32))
        return (x_btnd.astype(jnp.float32) + mixed).astype(x_btnd.dtype)

    def correct(self, pred_btnd, y_btd):
        """Every prediction plus its share of the innovation y - pred_active."""
        m_btn = self.modalities(y_btd)
        coef_btn = m_btn @ self._coefs(self.w_correct_nn) + 1.0
        innovation_btd = y_btd.astype(jnp.float32) - pred_btnd[:, :, self.spec.active].astype(jnp.float32)
        out = pred_btnd.astype(jnp.float32) + coef_btn[..., None] * innovation_btd[:, :, None]
        return out.astype(y_btd.dtype)


def _to_rms(x_btd, target_bt1):
    """x rescaled to the RMS `target` (the floor on x's mean square transformers' 1e-5)."""
    x32 = x_btd.astype(jnp.float32)
    rms = jnp.sqrt(jnp.maximum(jnp.mean(x32 * x32, axis=-1, keepdims=True), 1e-5))
    return (x32 * target_bt1 / rms).astype(x_btd.dtype)


def _rms(x_btd):
    x32 = x_btd.astype(jnp.float32)
    return jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True))


class AltUpStreams(nnx.Module):
    """The model's way into and out of the streams (transformers' altup_projections and
    altup_unembed_projections): n - 1 (d, d) projections each way, w_in{j}_dd, w_out{j}_dd."""

    def __init__(self, spec: AltUpSpec, build: Build, *, rngs: nnx.Rngs):
        d, pdt = build.d_model, build.param_dtype
        self.n = spec.streams
        for j in range(1, self.n):
            setattr(self, f"w_in{j}_dd", param(rngs, (d, d), build.init_std, ("embed", None), pdt))
            setattr(self, f"w_out{j}_dd", param(rngs, (d, d), build.init_std, ("embed", None), pdt))
        self.dtype, self.compute, self.dot_general = build.dtype, build.compute, build.dot_general

    def _project(self, attr: str, x_btd):
        kw = {"backward": self.compute.matmul_backward, "dot_general": self.dot_general}
        return project(self, attr, x_btd, 1, self.dtype, **kw)

    def expand(self, x_btd):
        """(b, t, n d): the embedding, then its projections at the embedding's RMS."""
        target = _rms(x_btd)
        parts = [x_btd] + [_to_rms(self._project(f"w_in{j}_dd", x_btd), target) for j in range(1, self.n)]
        return jnp.concatenate(parts, axis=-1)

    def collapse(self, x_btx):
        """(b, t, d): the mean of stream 0 and the others projected back at stream 0's RMS."""
        x_btnd = _streams(x_btx, self.n)
        first = x_btnd[:, :, 0]
        target = _rms(first)
        parts = [first] + [_to_rms(self._project(f"w_out{j}_dd", x_btnd[:, :, j]), target) for j in range(1, self.n)]
        return jnp.mean(jnp.stack(parts).astype(jnp.float32), axis=0).astype(x_btx.dtype)


def altup_layer(block, x_btx, positions_bt, segment_ids_bt, spec: LayerSpec, cache=None, *, rotary=None, **extra):
    """A transformer.Block's layer over AltUp's streams (b, t, n d), as Gemma 3n runs it: the
    attention on the normed active prediction beside LAuReL (the two averaged by 1/sqrt 2), the
    MLP, the correction, then the per-layer input added to streams 1..n-1. As Block.forward
    returns: (streams, cache or a store layer's keys and values, None)."""
    altup = spec.altup
    assert altup is not None
    n, a = altup.streams, altup.active
    pred_btnd = block.altup.predict(_streams(x_btx, n))
    active_btd = pred_btnd[:, :, a]
    normed_btd = block.attn_norm(active_btd)
    kw = {"rotary": rotary, "shared_kv": extra.get("shared_kv"), "store_kv": extra.get("store_kv", False)}
    branch_btd, cache, _ = block._mix(normed_btd, positions_bt, segment_ids_bt, spec, cache, kw)
    h_btd = active_btd + branch_btd
    if spec.laurel is not None:
        h_btd = (h_btd + block.laurel(normed_btd)) / jnp.asarray(math.sqrt(2), h_btd.dtype)
    ffn = spec.ffn
    assert isinstance(ffn, MLPSpec)  # Gemma 3n's layers: a dense MLP each
    mlp_out = block.mlp(block.mlp_norm(h_btd), ffn.gate_sparsity)
    h_btd = h_btd + (block.post_mlp_norm(mlp_out) if spec.post_norms else mlp_out)
    out_btnd = block.altup.correct(pred_btnd, h_btd)
    per_layer_btp = extra.get("per_layer_btp")
    if spec.per_layer_input_dim is not None and per_layer_btp is not None:
        first_btd = out_btnd[:, :, a]
        if altup.correct_scale:
            first_btd = first_btd * block.altup.correct_scale_d[...].astype(first_btd.dtype)
        dt, kw2 = block.dtype, {"backward": block.compute.matmul_backward, "dot_general": block.dot_general}
        gate_btp = project(block, "per_layer_gate_dp", first_btd, 1, dt, **kw2)
        gated_btp = (block.activation(gate_btp.astype(jnp.float32)) * per_layer_btp.astype(jnp.float32)).astype(dt)
        added_btd = block.post_per_layer_norm(project(block, "per_layer_proj_pd", gated_btp, 1, dt, **kw2))
        out_btnd = out_btnd.at[:, :, 1:].add(added_btd[:, :, None])
    b, t = x_btx.shape[:2]
    return out_btnd.reshape(b, t, -1), cache, None

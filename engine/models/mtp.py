"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2; GLM-4.5, DeepSeek-V4,
MiMo-V2-Flash): modules after the decoder, module k predicting the token k + 2 ahead.

At position i module k joins a hidden state with the embedding of token i + k + 1, each
RMS-normalised, projects the pair back to d_model (eh_proj), runs one layer
(ModelConfig.mtp_layer: the last layer's kind, or mtp_layer_kind's) and normalises its
output; the main model's LM head, shared, reads that as logits for token i + k + 2. The
hidden state is the main model's final-normed one for the first module and module k - 1's
output for module k (DeepSeek-V3's chain). This is transformers' `MtpModel`
(modeling_layers.py: MtpLayer, `forward_layer` then `_project_to_logits`); the embedding and
head are the main model's there too.

DeepSeek-V4's module (its inference/model.py MTPBlock) reads the main model's n residual
streams before their final mix instead: e_proj(enorm(embedding)) is added to h_proj(hnorm(
stream)) of each stream, its layer runs on the n streams, and its own mix of them (hc_head)
then its norm give the head's input; the next module reads the streams.

MiniMax's modules are DeepSeek-V3's with the options of ModelConfig.mtp_layer_kind: M3's
(vLLM's MiniMaxM3MTP) a block-sparse layer run at the hidden state's positions; M2's (SGLang's
MiniMaxM2ForCausalLMNextN) projecting [hidden, embedding] and ending in the model's final norm.

Shapes as in transformer.py. The first module's own parameters are `mtp` (its norms and
projections), module k's `mtp_{k}`; their layers are the `mtp_blocks` stack (one layer per
module, laid out as the model's other stacks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import dtype_of, make_norm, param
from engine.models.config import ComputeConfig, ModelConfig
from engine.models.hyper_connection import HyperHead
from engine.ops.dense import dense
from engine.ops.partitioning import constrain


class MTPHead(nnx.Module):
    """A multi-token-prediction module's own parameters around its layer: the norms of the
    token embedding (enorm) and of the hidden state (hnorm), their projection (eh_proj,
    stored (2d, d): the embedding's rows first, the hidden state's under
    mtp_layer_kind.hidden_first) and the output norm (HF's shared_head.norm; none under
    mtp_layer_kind.shared_final_norm, which reads the model's final norm).
    DeepSeek-V4's: a (d, d) projection of each (e_proj, h_proj) and the streams' mix (hc_head)."""

    def __init__(self, cfg: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        d, pdt = cfg.d_model, dtype_of(compute.param_dtype)
        spec = cfg.mtp_layer_spec()

        def norm():
            return make_norm(spec.norm, d, pdt, rngs=rngs)

        self.enorm, self.hnorm = norm(), norm()
        kind = cfg.mtp_layer_kind
        if kind is None or not kind.shared_final_norm:
            self.post_norm = norm()
        if spec.hyper is None:
            self.w_eh_xd = param(rngs, (2 * d, d), cfg.init_std, (None, "embed"), pdt)
        else:
            self.w_e_dd = param(rngs, (d, d), cfg.init_std, (None, "embed"), pdt)
            self.w_h_dd = param(rngs, (d, d), cfg.init_std, (None, "embed"), pdt)
            self.hc_head = HyperHead(spec.hyper, d, cfg.init_std, rngs=rngs)


def _ahead(x_bt, k: int, fill):
    """x at i + k (b, t): the row's last k positions `fill`."""
    b = x_bt.shape[0]
    return jnp.concatenate([x_bt[:, k:], jnp.full((b, k), fill, x_bt.dtype)], axis=1)


def mtp_depth_logits(model, hidden_btd, tokens_bt, positions_bt=None, segment_ids_bt=None):
    """[(logits (b, t, v) float32, router stats of its layer or None)] of each module: module
    k's at i predicts token i + k + 2 from `hidden_btd` (the main model's final-normed hidden
    states as Transformer.hidden_states gives them; DeepSeek-V4: its streams (b, t, n d)
    before their mix) and tokens i + 1 ... i + k + 1. A position whose next k + 2 tokens are
    not all in its document has logits that mean nothing (mtp_loss leaves them out), and the
    documents after it do not see it."""
    cfg, compute = model.cfg, model.compute
    dt = dtype_of(compute.dtype)
    b, t = tokens_bt.shape
    d = cfg.d_model
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    if segment_ids_bt is None:
        segment_ids_bt = jnp.ones((b, t), jnp.int32)
    layer, kind = cfg.mtp_layer_spec(), cfg.mtp_layer_kind
    stack = model.mtp_blocks
    graphdef, state = nnx.split(stack) if compute.scan_layers else (None, None)
    head_dv = model.embed_vd[...].T if cfg.tie_embeddings else model.lm_head_dv[...]
    products = {"backward": model.matmul_backward, "dot_general": model.dot_general}
    h_btx, out = hidden_btd, []
    for k, name in enumerate(cfg.mtp_head_names()):
        head = getattr(model, name)
        embedded_btd = model.embed_vd[...].astype(dt)[_ahead(tokens_bt, k + 1, 0)]
        if layer.hyper is None:
            pair = [head.enorm(embedded_btd), head.hnorm(h_btx)]
            joined = jnp.concatenate(pair[::-1] if kind is not None and kind.hidden_first else pair, axis=-1)
            joined = joined.astype(dt)
            x_btx = dense(joined, head.w_eh_xd[...].astype(dt), **products)
        else:  # DeepSeek-V4: the embedding's projection added to each stream's
            streams_btnd = h_btx.reshape(b, t, -1, d)
            e_btd = dense(head.enorm(embedded_btd).astype(dt), head.w_e_dd[...].astype(dt), **products)
            h_btnd = dense(head.hnorm(streams_btnd).astype(dt), head.w_h_dd[...].astype(dt), **products)
            x_btx = (e_btd[:, :, None, :] + h_btnd).reshape(b, t, -1)
        x_btx = constrain(x_btx, ("act_batch", "act_seq", "act_embed"))
        block = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k], state)) if compute.scan_layers else stack[k]
        # RoPE at i + k + 1 (i + k: mtp_layer_kind.at_hidden_position), within the table of t
        # positions (the last positions' are stand-ins)
        ahead = 0 if kind is not None and kind.at_hidden_position else 1
        shifted_bt = jnp.minimum(positions_bt + k + ahead, t - 1)
        x_btx, _, stats = block.forward(x_btx, shifted_bt, segment_ids_bt, layer)
        if layer.hyper is None:
            post_norm = model.final_norm if kind is not None and kind.shared_final_norm else head.post_norm
            h_btx = x_btd = post_norm(x_btx)
        else:
            h_btx, x_btd = x_btx, head.post_norm(head.hc_head(x_btx))
        logits = jnp.einsum("btd,dv->btv", x_btd.astype(dt), head_dv.astype(dt), preferred_element_type=jnp.float32)
        out.append((logits, stats))
    return out


def mtp_logits(model, hidden_btd, tokens_bt, positions_bt=None, segment_ids_bt=None):
    """(logits (b, t, v) float32, router stats of its layer or None) of the first module:
    position i predicts token i + 2 (mtp_depth_logits)."""
    return mtp_depth_logits(model, hidden_btd, tokens_bt, positions_bt, segment_ids_bt)[0]


def mtp_loss(model, hidden_btd, tokens_bt, positions_bt=None, segment_ids_bt=None):
    """DeepSeek-V3's L_MTP over its D modules, (1 / D) sum_k L_k: L_k the mean cross entropy
    of module k's predictions of token i + k + 2 (mtp_depth_logits) over the positions whose
    next k + 2 tokens are in their document. The batch's loss mask does not apply: every such
    position of a document is a target."""
    b, t = tokens_bt.shape
    if segment_ids_bt is None:
        segment_ids_bt = jnp.ones((b, t), jnp.int32)
    losses = []
    for k, (logits_btv, _) in enumerate(mtp_depth_logits(model, hidden_btd, tokens_bt, positions_bt, segment_ids_bt)):
        targets_bt = _ahead(tokens_bt, k + 2, 0)
        valid_bt = segment_ids_bt != 0
        for s in range(1, k + 3):  # documents are contiguous: every token up to the target in its own
            valid_bt &= _ahead(segment_ids_bt, s, 0) == segment_ids_bt
        valid_bt = valid_bt.astype(jnp.float32)
        logits_btv = logits_btv.astype(jnp.float32)
        target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
        nll_bt = jax.nn.logsumexp(logits_btv, axis=-1) - target_logit_bt
        losses.append(jnp.sum(nll_bt * valid_bt) / jnp.maximum(jnp.sum(valid_bt), 1.0))
    return sum(losses) / len(losses)

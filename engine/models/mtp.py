"""Multi-token prediction (DeepSeek-V3, arXiv 2412.19437 section 2.2; GLM-4.5): one more
layer after the decoder that predicts the token after next.

At position i the module joins the main model's final (normed) hidden state h_i with the
embedding of token i + 1, each RMS-normalised, projects the pair back to d_model
(eh_proj), runs one layer of the last layer's kind (attention over the same causal
sequence, RoPE at position i + 1, the experts) and normalises its output; the main model's
LM head, shared, reads that as logits for token i + 2. This is transformers' `MtpModel`
(modeling_layers.py: MtpLayer, `forward_layer` then `_project_to_logits`) for one module;
the embedding and head are the main model's there too.

Shapes as in transformer.py. The module's parameters are `mtp` (its norms and projection)
and the `mtp_blocks` stack (one layer, laid out as the model's other stacks).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from engine.models.common import dtype_of, make_norm, param
from engine.models.config import ComputeConfig, ModelConfig
from engine.ops.dense import dense
from engine.ops.partitioning import constrain


class MTPHead(nnx.Module):
    """A multi-token-prediction module's own parameters around its layer: the norms of the
    token embedding (enorm) and of the main model's hidden state (hnorm), their projection
    (eh_proj, stored (2d, d): the embedding's rows first) and the output norm (HF's
    shared_head.norm)."""

    def __init__(self, cfg: ModelConfig, compute: ComputeConfig, *, rngs: nnx.Rngs):
        d, pdt = cfg.d_model, dtype_of(compute.param_dtype)

        def norm():
            return make_norm(cfg.mtp_layer_spec().norm, d, pdt, rngs=rngs)

        self.enorm, self.hnorm, self.post_norm = norm(), norm(), norm()
        self.w_eh_xd = param(rngs, (2 * d, d), cfg.init_std, (None, "embed"), pdt)


def mtp_logits(model, hidden_btd, tokens_bt, positions_bt=None, segment_ids_bt=None):
    """(logits (b, t, v) float32, router stats of its layer or None): position i predicts
    token i + 2 from `hidden_btd` (the main model's final-normed hidden states, as
    Transformer.hidden_states gives them) and token i + 1. The last position has no next
    token, nor has a document's last position one of its own: their logits mean nothing
    (mtp_loss leaves them out), and the documents after them do not see them."""
    cfg, compute = model.cfg, model.compute
    dt = dtype_of(compute.dtype)
    b, t = tokens_bt.shape
    if positions_bt is None:
        positions_bt = jnp.broadcast_to(jnp.arange(t), (b, t))
    if segment_ids_bt is None:
        segment_ids_bt = jnp.ones((b, t), jnp.int32)
    next_bt = jnp.concatenate([tokens_bt[:, 1:], tokens_bt[:, -1:]], axis=1)
    head = model.mtp
    embedded_btd = model.embed_vd[...].astype(dt)[next_bt]
    joined = jnp.concatenate([head.enorm(embedded_btd), head.hnorm(hidden_btd)], axis=-1).astype(dt)
    x_btd = dense(joined, head.w_eh_xd[...].astype(dt), backward=model.matmul_backward, dot_general=model.dot_general)
    x_btd = constrain(x_btd, ("act_batch", "act_seq", "act_embed"))
    layer = cfg.mtp_layer_spec()
    stack = model.mtp_blocks
    if compute.scan_layers:
        graphdef, state = nnx.split(stack)
        block = nnx.merge(graphdef, jax.tree.map(lambda a: a[0], state))
    else:
        block = stack[0]
    # RoPE at i + 1, within the table of t positions (the last position's is a stand-in)
    shifted_bt = jnp.minimum(positions_bt + 1, t - 1)
    x_btd, _, stats = block.forward(x_btd, shifted_bt, segment_ids_bt, layer)
    x_btd = head.post_norm(x_btd)
    head_dv = model.embed_vd[...].T if cfg.tie_embeddings else model.lm_head_dv[...]
    logits = jnp.einsum("btd,dv->btv", x_btd.astype(dt), head_dv.astype(dt), preferred_element_type=jnp.float32)
    return logits, stats


def mtp_loss(model, hidden_btd, tokens_bt, positions_bt=None, segment_ids_bt=None):
    """DeepSeek-V3's L_MTP of its one module: the mean cross entropy of the predictions of
    token i + 2 (mtp_logits) over the positions whose next two tokens are in their document.
    The batch's loss mask does not apply: every such position of a document is a target."""
    b, t = tokens_bt.shape
    if segment_ids_bt is None:
        segment_ids_bt = jnp.ones((b, t), jnp.int32)
    logits_btv, _ = mtp_logits(model, hidden_btd, tokens_bt, positions_bt, segment_ids_bt)
    targets_bt = jnp.concatenate([tokens_bt[:, 2:], jnp.zeros((b, 2), tokens_bt.dtype)], axis=1)
    later_bt = jnp.concatenate([segment_ids_bt[:, 2:], jnp.zeros((b, 2), segment_ids_bt.dtype)], axis=1)
    following_bt = jnp.concatenate([segment_ids_bt[:, 1:], jnp.zeros((b, 1), segment_ids_bt.dtype)], axis=1)
    valid_bt = ((segment_ids_bt != 0) & (following_bt == segment_ids_bt) & (later_bt == segment_ids_bt)).astype(
        jnp.float32
    )
    logits_btv = logits_btv.astype(jnp.float32)
    target_logit_bt = jnp.take_along_axis(logits_btv, targets_bt[..., None], axis=-1)[..., 0]
    nll_bt = jax.nn.logsumexp(logits_btv, axis=-1) - target_logit_bt
    return jnp.sum(nll_bt * valid_bt) / jnp.maximum(jnp.sum(valid_bt), 1.0)

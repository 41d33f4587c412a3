"""The language-modelling loss with the LM head run in pieces (TrainConfig.loss_tiles).

The model's forward pass stops at the final-normed hidden states (Transformer.hidden_states)
and the head's product, its post-processing and the cross entropy's two per-token terms run a
piece of the sequence at a time (engine/ops/cross_entropy.py: tiled_log_z_and_target), so
the step never holds the whole (b, t, vocab) logits. `head_logits_fn` makes the logits as
Transformer._forward's `lm_head` scope does: the same product, then the same
transformer.finish_logits (tests/test_loss_tiles.py checks the two agree on a head with each
of the post-processing steps).
"""

from __future__ import annotations

from flax import nnx

from engine.models.common import dtype_of
from engine.models.transformer import Transformer, finish_logits
from engine.ops.cross_entropy import tiled_log_z_and_target
from engine.ops.dense import dense, uses_cpu_backward, weight_grads_in


def head_logits_fn(model: Transformer):
    """logits_fn(x_bcd) -> (b, c, vocab) logits in the compute dtype, from final-normed hidden
    states. The head's weights are read here (closed over); each call rounds them to the
    compute dtype itself, so a scan over pieces sums their gradient in the parameters' dtype."""
    cfg, dt = model.cfg, dtype_of(model.compute.dtype)
    head_dv = model.embed_vd[...].T if cfg.tie_embeddings else model.lm_head_dv[...]
    bias_v = model.lm_head_bias_v[...] if cfg.head.bias else None

    def logits_fn(x_bcd):
        logits = dense(
            x_bcd,
            head_dv.astype(dt),
            float32_out=uses_cpu_backward(model.matmul_backward),
            backward=model.matmul_backward,
            dot_general=model.dot_general,
        )
        return finish_logits(cfg, logits, bias_v)

    return logits_fn


def tiled_lm_terms(graphdef, params, batch, tiles: int):
    """(log Z (b, t), the target's logit (b, t), aux as Transformer.forward's) of the batch's
    next-token predictions, the head and its logits `tiles` pieces of each row at a time."""
    model = nnx.merge(graphdef, params)
    x_btd, aux = model.hidden_states(batch["tokens"], batch["positions"], batch["segment_ids"])
    # The head's products follow the model's weight-gradient dtype, as in its forward pass.
    with weight_grads_in(model.compute.weight_grad_dtype):
        log_z_bt, target_bt = tiled_log_z_and_target(x_btd, head_logits_fn(model), batch["targets"], tiles)
    return log_z_bt, target_bt, aux

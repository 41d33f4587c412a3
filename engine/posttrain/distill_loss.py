"""Distillation losses as pure functions: TRL GKD's generalized Jensen-Shannon divergence.

The definitions and names are trl.experimental.gkd.GKDTrainer.generalized_jsd_loss's (TRL
1.16; Agarwal et al. 2024, "On-Policy Distillation of Language Models", eq. 1). With the
student's and the teacher's next-token distributions S and T at a position, both the
softmax of logits / temperature:

    beta = 0     KL(T || S)                                    forward KL
    beta = 1     KL(S || T)                                    reverse KL
    otherwise    beta KL(T || M) + (1 - beta) KL(S || M),      M = (1 - beta) S + beta T

summed over the vocabulary (`per_token_jsd`, (b, t)). The reduction is TRL's over the
positions whose label is not -100 (here: `mask_bt` is 1): their sum over their count
("batchmean" with labels; at least 1), or over `num_items` where given (TRL's
num_items_in_batch, the gradient-accumulation-correct form the trainer uses: the whole
batch's count). The teacher's side carries no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def per_token_jsd(student_logits_btv, teacher_logits_btv, beta: float, temperature: float = 1.0):
    """(b, t): the generalized JSD of each position's next-token distributions, in float32 (or
    the logits' dtype, if wider), summed over the vocabulary."""
    dtype = jnp.promote_types(student_logits_btv.dtype, jnp.float32)
    student_btv = jax.nn.log_softmax(student_logits_btv.astype(dtype) / temperature, axis=-1)
    teacher_btv = jax.lax.stop_gradient(jax.nn.log_softmax(teacher_logits_btv.astype(dtype) / temperature, axis=-1))

    def kl(log_p, log_q):  # KL(p || q) per position: torch's kl_div(log_q, log_p, log_target=True) summed
        return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)

    if beta == 0:
        return kl(teacher_btv, student_btv)
    if beta == 1:
        return kl(student_btv, teacher_btv)
    mixture_btv = jnp.logaddexp(student_btv + jnp.log1p(-beta), teacher_btv + jnp.log(beta))
    return beta * kl(teacher_btv, mixture_btv) + (1 - beta) * kl(student_btv, mixture_btv)


def generalized_jsd_loss(
    student_logits_btv, teacher_logits_btv, mask_bt=None, beta: float = 0.5, temperature: float = 1.0, num_items=None
):
    """TRL's scalar loss: the masked positions' JSD summed, over `num_items` if given, else
    over the masked positions' count (at least 1; without a mask, over the batch's rows)."""
    jsd_bt = per_token_jsd(student_logits_btv, teacher_logits_btv, beta, temperature)
    if mask_bt is None:
        total, count = jnp.sum(jsd_bt), jsd_bt.shape[0]
    else:
        # Selected, not multiplied: a position outside the mask adds nothing, as TRL's jsd[mask].
        total, count = jnp.sum(jnp.where(mask_bt > 0, jsd_bt, 0.0)), jnp.maximum(jnp.sum(mask_bt), 1)
    return total / (count if num_items is None else num_items)

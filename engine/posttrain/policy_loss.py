"""The GRPO / GSPO objective as pure functions: group advantages, importance ratios,
clipping, the k3 KL penalty and the four loss aggregations.

Definitions follow TRL's GRPOTrainer (and Tunix's GRPO learner where noted):

    advantage    A_i = r_i - mean(group); / (std + 1e-4) with scale_rewards = group (the
                 group's std) or batch (the whole batch's std); none: not divided. std is
                 the unbiased one (ddof=1), as in both TRL and Tunix.
    ratio        token (GRPO):     w_it = exp(logp_it - old_it)
                 sequence (GSPO):  w_i  = exp(mean_t(logp_it - old_it)), the length-normalised
                                   sequence ratio, shared by all tokens of the sequence
                 sequence_token (GSPO-token, Tunix `gspo-token`):
                                   w_it = sg(w_i) * pi_it / sg(pi_it): w_i's value, a per-token gradient
    per token    L_it = -min(w A, clip(w, 1 - epsilon_low, 1 + epsilon_high) A) + beta * KL_it
    k3 KL        KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1   (Schulman's k3)
    loss_type    grpo:    mean over sequences of (sum_t L_it / |o_i|)
                 bnpo:    sum L / number of completion tokens (in the micro-batch)
                 dr_grpo: sum L / (sequences * max_completion_length)
                 dapo:    sum L / number of completion tokens in the whole (accumulated) batch

With gradient accumulation, grpo, bnpo and dr_grpo are computed per micro-batch and
averaged (TRL divides by the accumulation steps); dapo divides by the global token count,
so it does not depend on how the batch is split. Without accumulation bnpo == dapo.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
Level = Literal["token", "sequence", "sequence_token"]
STD_EPS = 1e-4


def group_advantages(
    rewards_b: np.ndarray, valid_b: np.ndarray, group_size: int, scale: Literal["group", "batch", "none"] = "group"
) -> tuple[np.ndarray, np.ndarray]:
    """(advantages_b, std_g): the std each group's advantages are scaled by (its own; the
    batch's with scale "batch"; its own, unused, with "none", as TRL logs it). Completions
    marked invalid get 0 and are left out of the statistics of their group; a group whose
    rewards are all equal has std 0."""
    r = np.asarray(rewards_b, np.float64).reshape(-1, group_size)
    v = np.asarray(valid_b, bool).reshape(-1, group_size)
    count = v.sum(1)
    mean = np.where(count > 0, (r * v).sum(1) / np.maximum(count, 1), 0.0)
    centred = np.where(v, r - mean[:, None], 0.0)
    std_g = np.sqrt((centred**2).sum(1) / np.maximum(count - 1, 1))
    if scale == "group":
        advantages = centred / (std_g[:, None] + STD_EPS)
    elif scale == "batch":
        valid_rewards = r[v]
        std_batch = valid_rewards.std(ddof=1) if valid_rewards.size > 1 else 0.0
        advantages = centred / (std_batch + STD_EPS)
        std_g = np.full_like(std_g, std_batch)
    else:
        advantages = centred
    return np.where(v, advantages, 0.0).reshape(-1).astype(np.float32), std_g


def completion_logps(logits_btv, tokens_bt, temperature: float = 1.0):
    """(log p of tokens_bt, entropy) per position under softmax(logits / temperature).

    TRL scales by the sampling temperature, so the policy scored is the one sampled from.
    """
    logp_btv = jax.nn.log_softmax(logits_btv.astype(jnp.float32) / temperature, axis=-1)
    logp_bt = jnp.take_along_axis(logp_btv, tokens_bt[..., None], axis=-1)[..., 0]
    entropy_bt = -jnp.sum(jnp.exp(logp_btv) * logp_btv, axis=-1)
    return logp_bt, entropy_bt


def k3_kl(logp_bt, ref_logp_bt, mask_bt=None):
    """Schulman's k3 estimator of KL(policy || reference), per token. Positions outside `mask_bt`
    (after EOS) are 0 before the exponential, so a huge log-ratio there cannot turn the masked
    sum (or its gradient) into inf * 0 = NaN."""
    delta = ref_logp_bt - logp_bt
    if mask_bt is not None:
        delta = jnp.where(mask_bt > 0, delta, 0.0)
    return jnp.exp(delta) - delta - 1.0


def log_importance_weights(logp_bt, old_logp_bt, mask_bt, level: Level):
    """Log of the importance ratio: (b, t) at token level, (b, 1) for GSPO's sequence ratio."""
    log_ratio_bt = logp_bt - old_logp_bt
    if level == "token":
        return log_ratio_bt
    seq_b1 = jnp.sum(log_ratio_bt * mask_bt, -1, keepdims=True) / jnp.maximum(jnp.sum(mask_bt, -1, keepdims=True), 1.0)
    if level == "sequence":
        return seq_b1
    return jax.lax.stop_gradient(seq_b1) + logp_bt - jax.lax.stop_gradient(logp_bt)


def policy_loss(
    logp_bt,
    old_logp_bt,
    advantages_b,
    mask_bt,
    *,
    ref_logp_bt=None,
    level: Level = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    loss_type: LossType = "dapo",
    max_completion_length: int | None = None,
    total_tokens=None,
    accumulation_steps: int = 1,
):
    """(loss, metrics) of one (micro-)batch. `old_logp_bt` None: the policy that sampled is
    the current one (mu = 1), old = stop_gradient(logp) and every ratio is exactly 1.

    `total_tokens`: completion tokens of the whole accumulated batch (dapo); defaults to
    this batch's.
    """
    mask_bt = mask_bt.astype(jnp.float32)
    if old_logp_bt is None:
        old_logp_bt = jax.lax.stop_gradient(logp_bt)
    log_w = log_importance_weights(logp_bt, old_logp_bt, mask_bt, level)
    coef_1 = jnp.exp(log_w)
    coef_2 = jnp.clip(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    adv_b1 = advantages_b[:, None].astype(jnp.float32)
    per_token = -jnp.minimum(coef_1 * adv_b1, coef_2 * adv_b1)
    kl_bt = None
    if beta != 0.0:
        kl_bt = k3_kl(logp_bt, ref_logp_bt, mask_bt)
        per_token = per_token + beta * kl_bt
    tokens_b = jnp.sum(mask_bt, -1)
    tokens = jnp.sum(mask_bt)
    masked_sum = jnp.sum(per_token * mask_bt)
    if loss_type == "grpo":
        loss = jnp.mean(jnp.sum(per_token * mask_bt, -1) / jnp.maximum(tokens_b, 1.0)) / accumulation_steps
    elif loss_type == "bnpo":
        loss = masked_sum / jnp.maximum(tokens, 1.0) / accumulation_steps
    elif loss_type == "dr_grpo":
        assert max_completion_length is not None, "dr_grpo needs max_completion_length"
        loss = masked_sum / (mask_bt.shape[0] * max_completion_length) / accumulation_steps
    elif loss_type == "dapo":
        loss = masked_sum / jnp.maximum(tokens if total_tokens is None else total_tokens, 1.0)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    def masked_mean(x):  # (b, 1) sequence-level quantities: a mean over sequences, as TRL logs them
        if x.shape[-1] == 1:
            return jnp.mean(x)
        return jnp.sum(x * mask_bt) / jnp.maximum(tokens, 1.0)

    low = (coef_1 < 1 - epsilon_low) & (adv_b1 < 0)
    high = (coef_1 > 1 + epsilon_high) & (adv_b1 > 0)
    ratio = jnp.broadcast_to(coef_1, mask_bt.shape)
    metrics = {
        "clip_ratio_low": masked_mean(low.astype(jnp.float32)),
        "clip_ratio_high": masked_mean(high.astype(jnp.float32)),
        "clip_ratio": masked_mean((low | high).astype(jnp.float32)),
        "ratio_mean": masked_mean(coef_1),
        "ratio_max": jnp.max(jnp.where(mask_bt > 0, ratio, -jnp.inf)),
        "ratio_min": jnp.min(jnp.where(mask_bt > 0, ratio, jnp.inf)),
    }
    if kl_bt is not None:
        metrics["kl"] = masked_mean(kl_bt)
    return loss, metrics

"""The policy-gradient objective as pure functions: importance ratios, the registered
surrogates (clipped PPO, CISPO) and aggregations and the k3 KL penalty. Advantages are
advantages.py's; the off-policy (rollout) correction's weights are rollout_correction.py's.

Definitions follow TRL's GRPOTrainer (and Tunix's GRPO learner where noted):

    ratio        token (GRPO):     w_it = exp(logp_it - old_it)
                 sequence (GSPO):  w_i  = exp(mean_t(logp_it - old_it)), the length-normalised
                                   sequence ratio, shared by all tokens of the sequence
                 sequence_token (GSPO-token, Tunix `gspo-token`):
                                   w_it = sg(w_i) * pi_it / sg(pi_it): w_i's value, a per-token gradient
    surrogate    clipped: L_it = -min(w A, clip(w, 1 - epsilon_low, 1 + epsilon_high) A)
                 cispo:   L_it = -sg(min(w, epsilon_high)) A logp_it
                 sapo:    L_it = -sigmoid(tau (w - 1)) 4 / tau A, tau = tau_pos if A > 0 else tau_neg
                          (SAPO, Gao et al. 2025; TRL's loss_type sapo): a soft gate in place of the clip
                 gmpo:    L_i = -exp(mean_t clip_A(logp_it - old_it)) A, the geometric mean of the token
                          ratios, each log-ratio clipped sign-aware to [-epsilon_low, epsilon_high]
                          (GMPO, Zhao et al. 2025; trl.experimental.gmpo, verl's geo_mean policy loss)
    + beta KL    KL_it = exp(ref_it - logp_it) - (ref_it - logp_it) - 1   (Schulman's k3)
    loss_type    (TRL's names = surrogate + aggregation, registry.POLICY_LOSSES)
                 grpo:    clipped, mean over sequences of (sum_t L_it / |o_i|)   seq_mean_token_mean
                 bnpo:    clipped, sum L / completion tokens of the micro-batch  token_mean_local
                 dr_grpo: clipped, sum L / (sequences * max_completion_length)   seq_mean_token_sum_norm
                 dapo:    clipped, sum L / completion tokens of the whole batch  token_mean
                 luspo:   clipped, mean over sequences of sum_t L_it             seq_mean_token_sum
                 cispo:   cispo,   sum L / completion tokens of the whole batch  token_mean
                 sapo:    sapo,    as grpo                                       seq_mean_token_mean
                 gmpo:    gmpo,    mean over sequences of L_i (+ beta x each one's mean KL)

`loss_aggregation` overrides a loss type's aggregation (sequence- vs token-level). With
gradient accumulation every aggregation but token_mean is computed per micro-batch and
averaged (TRL divides by the accumulation steps); token_mean divides by the global token
count, so it does not depend on how the batch is split. Without accumulation bnpo == dapo.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from engine.posttrain import advantages
from engine.posttrain.registry import LOSS_AGGREGATIONS, POLICY_LOSSES

Level = Literal["token", "sequence", "sequence_token"]


def group_advantages(
    rewards_b: np.ndarray, valid_b: np.ndarray, group_size: int, scale: Literal["group", "batch", "none"] = "group"
) -> tuple[np.ndarray, np.ndarray]:
    """GRPO's group advantages (advantages.grpo): (advantages_b, std_g), the std each group's
    advantages are scaled by (its own; the batch's with scale "batch"; its own, unused, with
    "none", as TRL logs it). Invalid completions get 0 and leave their group's statistics."""
    return advantages.grpo(rewards_b, valid_b, None, group_size, scale)


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


# --------------------------------------------------------------------------- surrogates


def clipped_surrogate(ratio, advantages_b1, logp_bt, *, epsilon_low: float, epsilon_high: float):
    """PPO's clipped objective: -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A), and where it clipped."""
    clipped = jnp.clip(ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token = -jnp.minimum(ratio * advantages_b1, clipped * advantages_b1)
    low = (ratio < 1 - epsilon_low) & (advantages_b1 < 0)
    high = (ratio > 1 + epsilon_high) & (advantages_b1 > 0)
    return per_token, {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio": low | high}


def cispo_surrogate(ratio, advantages_b1, logp_bt, *, epsilon_low: float, epsilon_high: float):
    """CISPO (MiniMax-M1, arXiv:2506.13585; TRL's loss_type cispo): the importance weight itself
    is clipped, from above at epsilon_high (ScaleRL's eps_max, e.g. 5.0: an absolute bound, not
    1 + eps), and held constant: -sg(min(w, eps_max)) A log p. Every token keeps a gradient."""
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, epsilon_high))
    clipped = (ratio > epsilon_high) & (advantages_b1 > 0)  # TRL's cispo_clip_ratio
    return -weight * advantages_b1 * logp_bt, {"cispo_clip_ratio": clipped}


def sapo_surrogate(
    ratio, advantages_b1, logp_bt, *, epsilon_low: float, epsilon_high: float, temperature_pos=1.0, temperature_neg=1.05
):
    """SAPO (arXiv:2511.20347; TRL's loss_type sapo): the ratio through a temperature-controlled
    sigmoid gate, -sigmoid(tau (w - 1)) 4 / tau A, whose slope at w = 1 is 1 (PPO's gradient
    there) and which fades smoothly instead of clipping; tau is temperature_pos for positive
    advantages and temperature_neg otherwise (TRL's defaults 1.0 and 1.05)."""
    tau = jnp.where(advantages_b1 > 0, temperature_pos, temperature_neg).astype(ratio.dtype)
    return -jax.nn.sigmoid(tau * (ratio - 1)) * 4 / tau * advantages_b1, {}


def gmpo_surrogate(ratio, advantages_b1, logp_bt, *, epsilon_low: float, epsilon_high: float, mask_bt):
    """GMPO (arXiv:2507.20673; trl.experimental.gmpo's _compute_loss, verl's geo_mean): the
    sequence's weight is the geometric mean of its token ratios, each log-ratio clipped in log
    space, sign-aware as PPO's min (a positive advantage is clipped from above only, a negative
    one from below only): -exp(mean_t clip(log w_it)) A, the same for every token of the sequence.
    epsilon_low / epsilon_high are log-space bounds (the ratio range (exp(-eps_low), exp(eps_high)),
    TRL's default 0.4)."""
    log_ratio = jnp.where(mask_bt > 0, jnp.log(ratio), 0.0)  # nothing past the completion reaches the mean
    clamped = jnp.clip(log_ratio, -epsilon_low, epsilon_high)
    clipped = jnp.where(advantages_b1 > 0, jnp.minimum(log_ratio, clamped), jnp.maximum(log_ratio, clamped))
    mean_b1 = jnp.sum(clipped * mask_bt, -1, keepdims=True) / jnp.maximum(jnp.sum(mask_bt, -1, keepdims=True), 1.0)
    low = (log_ratio < -epsilon_low) & (advantages_b1 < 0)
    high = (log_ratio > epsilon_high) & (advantages_b1 > 0)
    return -jnp.exp(mean_b1) * advantages_b1, {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio": low | high}


# --------------------------------------------------------------------------- aggregations
# verl's loss_agg_mode names; TRL's loss types are a surrogate with one of these. With
# gradient accumulation every one but token_mean is a per-micro-batch value divided by the
# accumulation steps (TRL's rule); token_mean divides by the accumulated batch's tokens.


def token_mean(per_token_bt, mask_bt, *, max_completion_length, total_tokens, accumulation_steps):
    """sum L / completion tokens of the whole accumulated batch (TRL dapo and cispo, verl token-mean)."""
    tokens = jnp.sum(mask_bt) if total_tokens is None else total_tokens
    return jnp.sum(per_token_bt * mask_bt) / jnp.maximum(tokens, 1.0)


def token_mean_local(per_token_bt, mask_bt, *, max_completion_length, total_tokens, accumulation_steps):
    """sum L / completion tokens of this micro-batch (TRL bnpo)."""
    return jnp.sum(per_token_bt * mask_bt) / jnp.maximum(jnp.sum(mask_bt), 1.0) / accumulation_steps


def seq_mean_token_mean(per_token_bt, mask_bt, *, max_completion_length, total_tokens, accumulation_steps):
    """Mean over sequences of each one's token mean (TRL grpo, verl seq-mean-token-mean)."""
    per_seq = jnp.sum(per_token_bt * mask_bt, -1) / jnp.maximum(jnp.sum(mask_bt, -1), 1.0)
    return jnp.mean(per_seq) / accumulation_steps


def seq_mean_token_sum(per_token_bt, mask_bt, *, max_completion_length, total_tokens, accumulation_steps):
    """Mean over sequences of each one's token sum (TRL luspo, verl seq-mean-token-sum)."""
    return jnp.mean(jnp.sum(per_token_bt * mask_bt, -1)) / accumulation_steps


def seq_mean_token_sum_norm(per_token_bt, mask_bt, *, max_completion_length, total_tokens, accumulation_steps):
    """sum L / (sequences * max_completion_length) (TRL dr_grpo, verl seq-mean-token-sum-norm)."""
    assert max_completion_length is not None, "seq_mean_token_sum_norm needs max_completion_length"
    return jnp.sum(per_token_bt * mask_bt) / (mask_bt.shape[0] * max_completion_length) / accumulation_steps


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A registered loss type: a surrogate per token and how its tokens are aggregated."""

    surrogate: Callable
    aggregation: str
    reads_mask: bool = False
    """The surrogate takes the completion mask (`mask_bt`): a sequence-level weight (GMPO's)."""

    def __call__(self, *args, **kwargs):
        return self.surrogate(*args, **kwargs)


GRPO = PolicyLoss(clipped_surrogate, "seq_mean_token_mean")
BNPO = PolicyLoss(clipped_surrogate, "token_mean_local")
DR_GRPO = PolicyLoss(clipped_surrogate, "seq_mean_token_sum_norm")
DAPO = PolicyLoss(clipped_surrogate, "token_mean")
LUSPO = PolicyLoss(clipped_surrogate, "seq_mean_token_sum")
CISPO = PolicyLoss(cispo_surrogate, "token_mean")
SAPO = PolicyLoss(sapo_surrogate, "seq_mean_token_mean")
GMPO = PolicyLoss(gmpo_surrogate, "seq_mean_token_mean", reads_mask=True)


def sapo(temperature_pos: float, temperature_neg: float) -> PolicyLoss:
    """SAPO with a run's temperatures (GRPOConfig.sapo_temperature_pos / _neg)."""
    return PolicyLoss(
        functools.partial(sapo_surrogate, temperature_pos=temperature_pos, temperature_neg=temperature_neg),
        SAPO.aggregation,
    )


# --------------------------------------------------------------------------- the loss


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
    loss_type: str | PolicyLoss | Callable = "dapo",
    aggregation: str | Callable | None = None,
    max_completion_length: int | None = None,
    total_tokens=None,
    accumulation_steps: int = 1,
    is_weights=None,
):
    """(loss, metrics) of one (micro-)batch. `old_logp_bt` None: the policy that sampled is
    the current one (mu = 1), old = stop_gradient(logp) and every ratio is exactly 1.

    `loss_type`: a registered name (registry.POLICY_LOSSES), a PolicyLoss, or a user's surrogate;
    `aggregation`: a registered name or function, None for the loss type's own (token_mean for a
    user's surrogate). `total_tokens`: completion tokens of the whole accumulated batch
    (token_mean); defaults to this batch's. `is_weights`: rollout_correction's weights,
    multiplying each token's policy term (not the KL), as TRL does.
    """
    mask_bt = mask_bt.astype(logp_bt.dtype)  # float32 in training; float64 in the parity tests
    loss_def = POLICY_LOSSES.resolve(loss_type) if isinstance(loss_type, str) else loss_type
    surrogate = loss_def.surrogate if isinstance(loss_def, PolicyLoss) else loss_def
    aggregation = aggregation or (loss_def.aggregation if isinstance(loss_def, PolicyLoss) else "token_mean")
    aggregate = LOSS_AGGREGATIONS.resolve(aggregation) if isinstance(aggregation, str) else aggregation
    if old_logp_bt is None:
        old_logp_bt = jax.lax.stop_gradient(logp_bt)
    log_w = log_importance_weights(logp_bt, old_logp_bt, mask_bt, level)
    coef_1 = jnp.exp(log_w)
    adv_b1 = advantages_b[:, None].astype(logp_bt.dtype)
    extra = {"mask_bt": mask_bt} if getattr(loss_def, "reads_mask", False) else {}
    per_token, flags = surrogate(coef_1, adv_b1, logp_bt, epsilon_low=epsilon_low, epsilon_high=epsilon_high, **extra)
    if is_weights is not None:
        per_token = per_token * is_weights
    kl_bt = None
    if beta != 0.0:
        kl_bt = k3_kl(logp_bt, ref_logp_bt, mask_bt)
        per_token = per_token + beta * kl_bt
    per_token = jnp.broadcast_to(per_token, mask_bt.shape)
    loss = aggregate(
        per_token,
        mask_bt,
        max_completion_length=max_completion_length,
        total_tokens=total_tokens,
        accumulation_steps=accumulation_steps,
    )
    tokens = jnp.sum(mask_bt)

    def masked_mean(x):  # (b, 1) sequence-level quantities: a mean over sequences, as TRL logs them
        if x.shape[-1] == 1:
            return jnp.mean(x)
        return jnp.sum(x * mask_bt) / jnp.maximum(tokens, 1.0)

    ratio = jnp.broadcast_to(coef_1, mask_bt.shape)
    metrics = {name: masked_mean(flag.astype(mask_bt.dtype)) for name, flag in flags.items()}
    metrics.update(
        ratio_mean=masked_mean(coef_1),
        ratio_max=jnp.max(jnp.where(mask_bt > 0, ratio, -jnp.inf)),
        ratio_min=jnp.min(jnp.where(mask_bt > 0, ratio, jnp.inf)),
    )
    if kl_bt is not None:
        metrics["kl"] = masked_mean(kl_bt)
    return loss, metrics

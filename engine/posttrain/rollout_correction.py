"""Trainer/rollout consistency: the gap between the log-probs a rollout was sampled with (the
behaviour policy mu: the engine's KV-cache sampler, its bf16 copy, vLLM, or weights
`max_staleness` updates old) and the trainer's log-probs pi of the same tokens, measured every
step, and the corrections that act on it (`rollout_correction.mode`, registry.ROLLOUT_CORRECTIONS).

Measured on every GRPO step (mismatch_metrics), whatever the sampler, as the anchors name them:

    sampling/sampling_logp_difference/mean|max   |log pi - log mu| over the completion tokens (TRL)
    rollout_corr/rollout_is_mean|min|max         the token ratio rho = pi / mu (verl, token level)
    rollout_corr/rollout_is_std                  its std, rho clamped to [1/c, c] first (verl)
    rollout_corr/rollout_is_ratio_fraction_high  tokens with rho > c (verl); _low: rho < 1/c
    rollout_corr/kl                              k1 estimate of KL(mu || pi): E_mu[log mu - log pi] (verl)
    rollout_corr/k3_kl                           k3: E_mu[rho - log rho - 1] (verl, Schulman's k3)

with c = MISMATCH_THRESHOLD (verl's default rollout_is_threshold). pi is the trainer's policy the
update starts from: its forward pass before the first update (old_logps), or with one update
per batch the loss's own forward (the same numbers, at no cost).

The stage's final metrics summarise the run's worst step (divergence_summary: `rollout_divergence/*`),
so a pipeline gate reads one number per quantity, e.g. a stage that runs only while the gap stayed
small: `when: 'grpo.metrics["rollout_divergence/worst_logp_difference_max"] < 0.5'`.

The corrections (`fn(log_ratio_bt, mask_bt, low, high) -> (ratio, weights, keep)`): `ratio` at
the mode's level ((b, t) or (b, 1)), `weights` multiplying each token's policy term (no
gradient), `keep` the tokens or sequences left in the loss, None for all. A token not kept is
removed from the loss (its policy term, the KL and the token count the aggregation divides by),
as verl's rejection sampling (rollout_rs) removes it from the response mask.

    token_truncate           w = clip(rho_t, low, high)                       TRL / verl TIS
    token_mask               w = rho_t inside [low, high], 0 outside          TRL (MIS; counted in the normaliser)
    sequence_truncate        w = clip(prod_t rho_t, low, high)                TRL
    sequence_mask            w = prod_t rho_t inside, 0 outside               TRL
    icepop                   tokens with rho_t outside [low, high] removed, w = rho_t for the rest:
                             IcePop's M(k) = k on [alpha, beta], 0 elsewhere (Ling team, Ring-1T,
                             arXiv:2510.18855; alpha 0.5, beta 5 by default)
    sequence_geometric_mask  sequences whose geometric-mean ratio exp(mean_t log rho_t) is outside
                             [low, high] removed, w = 1: verl's rollout_rs geometric (pure
                             rejection; its preset bounds 0.999, 1.001 by default)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.posttrain.registry import ROLLOUT_CORRECTIONS

MISMATCH_THRESHOLD = 2.0
"""c: the monitored fraction of tokens outside [1/c, c] (verl's rollout_is_threshold default)."""
SAFETY_BOUND = 20.0
"""verl's bound on a log-ratio before it is exponentiated for the ratio statistics."""

# --------------------------------------------------------------------------- monitoring


def mismatch_metrics(trainer_logp_bt, behaviour_logp_bt, mask_bt, threshold: float = MISMATCH_THRESHOLD):
    """The behaviour/trainer gap on the completion tokens (`mask_bt`), as scalars. A behaviour
    log-prob that is not finite (a server that could not score a token) is left out, as TRL does."""
    valid = (mask_bt > 0) & jnp.isfinite(behaviour_logp_bt)
    any_valid = jnp.any(valid)
    count = jnp.maximum(jnp.sum(valid), 1)
    delta = jnp.where(valid, trainer_logp_bt - behaviour_logp_bt, 0.0)  # log rho, 0 off the tokens

    def mean(x):
        return jnp.sum(jnp.where(valid, x, 0.0)) / count

    rho = jnp.exp(jnp.clip(delta, -SAFETY_BOUND, SAFETY_BOUND))
    clamped = jnp.clip(rho, 1.0 / threshold, threshold)
    prefix = "rollout_corr/"
    return {
        "sampling/sampling_logp_difference/mean": mean(jnp.abs(delta)),
        "sampling/sampling_logp_difference/max": jnp.max(jnp.abs(delta)),
        prefix + "rollout_is_mean": mean(rho),
        prefix + "rollout_is_max": jnp.where(any_valid, jnp.max(jnp.where(valid, rho, 0.0)), 0.0),
        prefix + "rollout_is_min": jnp.where(any_valid, jnp.min(jnp.where(valid, rho, jnp.inf)), 0.0),
        # Two passes (mean, then the mean squared deviation): E[x^2] - E[x]^2 in float32 reads
        # ~3e-4 where every ratio is within 2e-7 of 1.
        prefix + "rollout_is_std": jnp.sqrt(mean((clamped - mean(clamped)) ** 2)),
        prefix + "rollout_is_ratio_fraction_high": mean((rho > threshold).astype(delta.dtype)),
        prefix + "rollout_is_ratio_fraction_low": mean((rho < 1.0 / threshold).astype(delta.dtype)),
        prefix + "kl": mean(-delta),
        prefix + "k3_kl": mean(jnp.exp(delta) - delta - 1.0),
    }


DIVERGENCE_SUMMARY = {
    "rollout_divergence/worst_logp_difference_mean": ("sampling/sampling_logp_difference/mean",),
    "rollout_divergence/worst_logp_difference_max": ("sampling/sampling_logp_difference/max",),
    "rollout_divergence/worst_kl": ("rollout_corr/kl",),
    "rollout_divergence/worst_k3_kl": ("rollout_corr/k3_kl",),
    "rollout_divergence/worst_fraction_past_threshold": (
        "rollout_corr/rollout_is_ratio_fraction_high",
        "rollout_corr/rollout_is_ratio_fraction_low",
    ),
}
"""Each summary: the largest over the run's steps of the sum of these per-step metrics."""


def divergence_summary(records: list[dict]) -> dict[str, float]:
    """The worst step's gap over a run's metrics records (metrics.jsonl, resumed steps included):
    what a pipeline gate reads from the stage's manifest. Empty when no step measured it."""
    measured = [r for r in records if "sampling/sampling_logp_difference/mean" in r]
    if not measured:
        return {}
    summary = {
        name: max(sum(float(r.get(key, 0.0)) for key in keys) for r in measured)
        for name, keys in DIVERGENCE_SUMMARY.items()
    }
    summary["rollout_divergence/steps"] = len({r.get("step") for r in measured})
    return summary


# --------------------------------------------------------------------------- the corrections


def _outside(ratio, low, high):
    return (ratio < low) | (ratio > high)


def _sequence_log_ratio(log_ratio_bt):
    return jnp.sum(log_ratio_bt, -1, keepdims=True)


def token_truncate(log_ratio_bt, mask_bt, low, high):
    ratio = jnp.exp(log_ratio_bt)
    return ratio, jnp.clip(ratio, low, high), None


def token_mask(log_ratio_bt, mask_bt, low, high):
    ratio = jnp.exp(log_ratio_bt)
    return ratio, jnp.where(_outside(ratio, low, high), 0.0, ratio), None


def sequence_truncate(log_ratio_bt, mask_bt, low, high):
    ratio = jnp.exp(_sequence_log_ratio(log_ratio_bt))
    return ratio, jnp.clip(ratio, low, high), None


def sequence_mask(log_ratio_bt, mask_bt, low, high):
    ratio = jnp.exp(_sequence_log_ratio(log_ratio_bt))
    return ratio, jnp.where(_outside(ratio, low, high), 0.0, ratio), None


def icepop(log_ratio_bt, mask_bt, low, high):
    ratio = jnp.exp(log_ratio_bt)
    keep = ~_outside(ratio, low, high)
    return ratio, jnp.where(keep, ratio, 0.0), keep


def sequence_geometric_mask(log_ratio_bt, mask_bt, low, high):
    tokens = jnp.maximum(jnp.sum(mask_bt, -1, keepdims=True), 1.0)
    ratio = jnp.exp(_sequence_log_ratio(log_ratio_bt) / tokens)
    return ratio, jnp.ones_like(ratio), ~_outside(ratio, low, high)


def rollout_correction(old_logp_bt, behaviour_logp_bt, mask_bt, mode="token_truncate", clip_min=None, clip_max=3.0):
    """(weights, keep_bt, metrics) of a registered correction `mode` (or a function of the
    correction's signature) between the trainer's policy the update starts from (`old`) and the
    rollout's behaviour log-probs. `weights` multiply each token's policy term (constant);
    `keep_bt` (b, t) is the loss's new mask (None: `mask_bt` unchanged). Metrics: the raw ratio
    at the mode's level (is_ratio_mean|max|min; over tokens, or sequences), the fraction outside
    [clip_min, clip_max] (is_clipped_fraction), and for a mode that removes tokens the fraction
    removed (rollout_corr/rollout_rs_masked_fraction, verl's name)."""
    correct = ROLLOUT_CORRECTIONS.resolve(mode) if isinstance(mode, str) else mode
    mask_bt = mask_bt.astype(old_logp_bt.dtype)
    log_ratio = jnp.where(mask_bt > 0, old_logp_bt - behaviour_logp_bt, 0.0)
    low = -jnp.inf if clip_min is None else clip_min
    high = jnp.inf if clip_max is None else clip_max
    ratio, weights, keep = correct(log_ratio, mask_bt, low, high)
    tokens = jnp.maximum(jnp.sum(mask_bt), 1.0)

    def mean(x):  # over tokens at token level, over sequences at sequence level (as TRL logs)
        return jnp.mean(x) if x.shape[-1] == 1 else jnp.sum(x * mask_bt) / tokens

    live = mask_bt > 0 if ratio.shape[-1] != 1 else jnp.ones_like(ratio, bool)
    metrics = {
        "is_ratio_mean": mean(ratio),
        "is_ratio_max": jnp.max(jnp.where(live, ratio, -jnp.inf)),
        "is_ratio_min": jnp.min(jnp.where(live, ratio, jnp.inf)),
        "is_clipped_fraction": mean(_outside(ratio, low, high).astype(mask_bt.dtype)),
    }
    keep_bt = None
    if keep is not None:
        keep_bt = jnp.broadcast_to(keep, mask_bt.shape).astype(mask_bt.dtype) * mask_bt
        metrics["rollout_corr/rollout_rs_masked_fraction"] = 1.0 - jnp.sum(keep_bt) / tokens
    return jax.lax.stop_gradient(weights), keep_bt, metrics

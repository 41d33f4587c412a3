"""Advantage estimators for outcome rewards (one scalar per completion), in NumPy on the host,
registered by name (registry.ADVANTAGE_ESTIMATORS; `advantage_estimator` in a GRPO config).

Each returns (advantages_b, std_g): one advantage per completion, constant over its tokens,
and the std each group was scaled by (logged as frac_reward_zero_std). Completions marked
invalid (no reward function scored them) get 0 and are left out of every statistic.

    grpo                         A_i = (r_i - mean(group)) / (std + 1e-4); scale_rewards group (the
                                 group's unbiased std), batch (the batch's) or none (Dr. GRPO)
    rloo                         A_i = r_i - mean of the other completions of its group (TRL's
                                 RLOOTrainer, verl's rloo) = G/(G-1) (r_i - mean(group)); scale_rewards
                                 none is TRL's default, batch its normalize_advantages=True ((A - mean)
                                 / (std + 1e-4) over the batch), group divides by the group's std
    reinforce_plus_plus          verl's REINFORCE++ (arXiv:2501.03262) for an outcome reward with
                                 gamma = 1: the return r_i at each of its tokens, whitened over every
                                 completion token of the batch (token-weighted mean and unbiased
                                 variance, (x - mean) / sqrt(var + 1e-8), verl's masked_whiten)
    reinforce_plus_plus_baseline verl's REINFORCE++-baseline: r_i - mean(group) at each token, then the
                                 same whitening over the batch's tokens

scale_rewards applies to grpo and rloo; the REINFORCE++ estimators always whiten over the batch.
"""

from __future__ import annotations

import numpy as np

from engine.posttrain.registry import ADVANTAGE_ESTIMATORS

STD_EPS = 1e-4  # TRL's, added to the std (grpo, rloo)
WHITEN_EPS = 1e-8  # verl's masked_whiten, added to the variance (REINFORCE++)


def _groups(rewards_b, valid_b, group_size: int):
    r = np.asarray(rewards_b, np.float64).reshape(-1, group_size)
    v = np.asarray(valid_b, bool).reshape(-1, group_size)
    count = v.sum(1)
    mean = np.where(count > 0, (r * v).sum(1) / np.maximum(count, 1), 0.0)
    centred = np.where(v, r - mean[:, None], 0.0)
    std_g = np.sqrt((centred**2).sum(1) / np.maximum(count - 1, 1))  # unbiased, as TRL and Tunix
    return r, v, count, centred, std_g


def _batch_std(values: np.ndarray) -> float:
    return float(values.std(ddof=1)) if values.size > 1 else 0.0


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo(rewards_b, valid_b, lengths_b, group_size: int, scale: str = "group"):
    r, v, _, centred, std_g = _groups(rewards_b, valid_b, group_size)
    if scale == "group":
        advantages = centred / (std_g[:, None] + STD_EPS)
    elif scale == "batch":
        std_batch = _batch_std(r[v])
        advantages = centred / (std_batch + STD_EPS)
        std_g = np.full_like(std_g, std_batch)
    else:
        advantages = centred
    return np.where(v, advantages, 0.0).reshape(-1).astype(np.float32), std_g


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo(rewards_b, valid_b, lengths_b, group_size: int, scale: str = "none"):
    r, v, count, _, std_g = _groups(rewards_b, valid_b, group_size)
    others = np.maximum(count - 1, 1)[:, None]
    baseline = ((r * v).sum(1, keepdims=True) - r) / others
    # A group with one scorable completion has no baseline: 0/0 in TRL, zeroed there too.
    advantages = np.where(v & (count[:, None] > 1), r - baseline, 0.0)
    if scale == "batch":
        a = advantages[v]
        advantages = (advantages - (a.mean() if a.size else 0.0)) / (_batch_std(a) + STD_EPS)
    elif scale == "group":
        advantages = advantages / (std_g[:, None] + STD_EPS)
    return np.where(v, advantages, 0.0).reshape(-1).astype(np.float32), std_g


def _whiten_over_tokens(values_b, valid_b, lengths_b):
    """verl's masked_whiten of a per-sequence value broadcast over its tokens."""
    weight = np.where(valid_b, np.asarray(lengths_b, np.float64), 0.0)
    tokens = weight.sum()
    mean = (weight * values_b).sum() / max(tokens, 1.0)
    var = (weight * (values_b - mean) ** 2).sum() / max(tokens, 1.0)
    var = var * tokens / (tokens - 1) if tokens > 1 else var  # Bessel's correction, as verl's masked_var
    return np.where(valid_b, (values_b - mean) / np.sqrt(var + WHITEN_EPS), 0.0)


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus")
def reinforce_plus_plus(rewards_b, valid_b, lengths_b, group_size: int, scale: str = "batch"):
    r, v, _, _, std_g = _groups(rewards_b, valid_b, group_size)
    advantages = _whiten_over_tokens(r.reshape(-1), v.reshape(-1), lengths_b)
    return advantages.astype(np.float32), std_g


@ADVANTAGE_ESTIMATORS.register("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(rewards_b, valid_b, lengths_b, group_size: int, scale: str = "batch"):
    _, v, _, centred, std_g = _groups(rewards_b, valid_b, group_size)
    advantages = _whiten_over_tokens(centred.reshape(-1), v.reshape(-1), lengths_b)
    return advantages.astype(np.float32), std_g

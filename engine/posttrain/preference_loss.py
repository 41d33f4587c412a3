"""Preference losses over sequence log-probabilities, as pure functions: DPO and its variants
with TRL's definitions and names (trl.DPOTrainer, TRL 1.16; SimPO as trl's CPO `simpo`).

Inputs are per pair (shape (p,)): the policy's and the reference's summed log-probabilities
of the chosen and rejected completions, and their completion token counts. With
`logratio = policy - reference` per completion:

    sigmoid      -log sigmoid(beta * (chosen_logratio - rejected_logratio))        (DPO)
    robust       (-(1 - eps) log sigmoid(beta delta) + eps log sigmoid(-beta delta)) / (1 - 2 eps),
                 eps = label_smoothing (robust DPO, Chowdhury et al. 2024)
    hinge        relu(1 - beta * delta)
    ipo          (delta_per_token - 1 / (2 beta))^2, each logratio / its token count (TRL)
    sppo_hard    (chosen_logratio - 1/(2 beta))^2 + (rejected_logratio + 1/(2 beta))^2
    apo_zero     1 - sigmoid(beta * chosen_logratio) + sigmoid(beta * rejected_logratio)
    apo_down     sigmoid(beta * chosen_logratio) + 1 - sigmoid(beta * delta)
    sigmoid_norm -log sigmoid(beta * delta_per_token)                              (length-normalised DPO)
    simpo        reference-free: -log sigmoid(beta * (mean_logp_chosen - mean_logp_rejected) - gamma),
                 with label smoothing as trl's CPO
    exo_pair     EXO-pref (Ji et al. 2024, eq. 16): KL(softmax(beta [chosen, rejected] logratio) || [1 - eps, eps]),
                 eps = label_smoothing (> 0)
    nca_pair     -log sigmoid(beta c) - log sigmoid(-beta c) / 2 - log sigmoid(-beta r) / 2 (NCA, Chen et al. 2024),
                 c, r = chosen_logratio, rejected_logratio
    bco_pair     -log sigmoid(beta c) - log sigmoid(-beta r)
    aot          AOT (Melnyk et al. 2024), paired: the batch's sorted policy margins (chosen - rejected log-prob)
                 against its sorted reference margins, through DPO's smoothed sigmoid; couples the pairs of a
                 micro-batch (TRL sorts its per-device batch, the engine its global micro-batch)
    aot_unpaired the same between the sorted chosen and the sorted rejected logratios
    discopop     DiscoPOP (Chris Lu et al. 2024, eq. 5): logistic and exponential losses of x = beta delta,
                 mixed by sigmoid(x / tau)
    orpo         reference-free (ORPO, Hong et al. 2024; trl's ORPOTrainer): -beta log sigmoid(log odds of
                 the mean completion log-probs); the run adds the chosen sequences' NLL (prompt included)

A run may combine several (TRL's list-valued loss_type with loss_weights): the loss is
sum_k weight_k * mean_pairs(loss_k). `sft` in such a list is TRL's NLL per chosen completion
token (RPO); it and ORPO's NLL are computed from the tokens by the run, not here.

`rpo_alpha` adds TRL's `sft` term (RPO): alpha times the mean NLL per chosen completion token.
Each loss is a mean over pairs. Metrics are TRL's: rewards/{chosen, rejected, margins,
accuracies} (beta x logratio; SimPO: beta x mean log-prob), logps/{chosen, rejected}.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.posttrain.preference_types import MEAN_LOGP, SORTED


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, stable on both sides of -log 2 (trl's ORPO log1mexp)."""
    safe = jnp.minimum(x, -1e-30)  # keeps the untaken branch finite (its gradient is masked, not NaN)
    return jnp.where(x < -0.6931471805599453, jnp.log1p(-jnp.exp(safe)), jnp.log(-jnp.expm1(safe)))


def _sorted_pairs(a, b, valid):
    """a and b each sorted ascending over the valid pairs, and which sorted positions hold one:
    invalid pairs are pushed past the end, so padding rows never enter a sort."""
    if valid is None:
        return jnp.sort(a), jnp.sort(b), None
    big = jnp.asarray(jnp.finfo(a.dtype).max / 4, a.dtype)
    keep = valid > 0
    position_valid = (jnp.arange(a.shape[0]) < jnp.sum(keep)).astype(a.dtype)
    return jnp.sort(jnp.where(keep, a, big)), jnp.sort(jnp.where(keep, b, big)), position_valid


def per_pair_loss(
    loss_type: str,
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    chosen_tokens,
    rejected_tokens,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    discopop_tau: float = 0.05,
    valid=None,
):
    """(p,) losses of one preference loss type (module docstring). `valid` (p,): which rows
    hold a pair; given, the losses come back zero where none is (for aot: at the sorted
    positions past the valid pairs), so their sum is the valid pairs' sum."""
    log_sigmoid = jax.nn.log_sigmoid
    if loss_type in SORTED:
        if loss_type == "aot":
            a, b = chosen_logps - rejected_logps, ref_chosen_logps - ref_rejected_logps
        else:
            a, b = chosen_logps - ref_chosen_logps, rejected_logps - ref_rejected_logps
        a_sorted, b_sorted, position_valid = _sorted_pairs(a, b * jnp.ones_like(a), valid)
        delta = a_sorted - b_sorted
        if position_valid is not None:
            delta = jnp.where(position_valid > 0, delta, 0.0)
        losses = -log_sigmoid(beta * delta) * (1 - label_smoothing) - log_sigmoid(-beta * delta) * label_smoothing
        return losses if position_valid is None else losses * position_valid
    losses = _pair_loss(
        loss_type,
        chosen_logps,
        rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        chosen_tokens,
        rejected_tokens,
        beta=beta,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
        discopop_tau=discopop_tau,
    )
    return losses if valid is None else losses * valid


def _pair_loss(
    loss_type,
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    chosen_tokens,
    rejected_tokens,
    *,
    beta,
    label_smoothing,
    simpo_gamma,
    discopop_tau,
):
    """(p,) losses of a loss type that treats each pair on its own."""
    log_sigmoid, sigmoid = jax.nn.log_sigmoid, jax.nn.sigmoid
    if loss_type == "simpo":
        logits = chosen_logps / jnp.maximum(chosen_tokens, 1.0) - rejected_logps / jnp.maximum(rejected_tokens, 1.0)
        logits = logits - simpo_gamma / beta
        return -log_sigmoid(beta * logits) * (1 - label_smoothing) - log_sigmoid(-beta * logits) * label_smoothing
    if loss_type == "orpo":  # the odds-ratio term of the mean completion log-probs (must be < 0)
        mean_chosen = chosen_logps / jnp.maximum(chosen_tokens, 1.0)
        mean_rejected = rejected_logps / jnp.maximum(rejected_tokens, 1.0)
        log_odds = (mean_chosen - mean_rejected) - (_log1mexp(mean_chosen) - _log1mexp(mean_rejected))
        return -beta * log_sigmoid(log_odds)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    if loss_type == "exo_pair":  # KL(q || p), q = softmax of the scaled logratios, p = [1 - eps, eps]
        eps = label_smoothing
        return sigmoid(beta * delta) * (log_sigmoid(beta * delta) - jnp.log1p(-eps)) + sigmoid(-beta * delta) * (
            log_sigmoid(-beta * delta) - jnp.log(eps)
        )
    if loss_type == "nca_pair":
        chosen, rejected = beta * chosen_logratios, beta * rejected_logratios
        return -log_sigmoid(chosen) - 0.5 * log_sigmoid(-chosen) - 0.5 * log_sigmoid(-rejected)
    if loss_type == "bco_pair":
        return -log_sigmoid(beta * chosen_logratios) - log_sigmoid(-beta * rejected_logratios)
    if loss_type == "discopop":
        logits = beta * delta
        modulation = sigmoid(logits / discopop_tau)
        return -log_sigmoid(logits) * (1 - modulation) + jnp.exp(-logits) * modulation
    if loss_type == "sigmoid":
        return -log_sigmoid(beta * delta)
    if loss_type == "robust":  # unbiased under label noise (Chowdhury et al. 2024), as TRL
        return (-(1 - label_smoothing) * log_sigmoid(beta * delta) + label_smoothing * log_sigmoid(-beta * delta)) / (
            1 - 2 * label_smoothing
        )
    if loss_type == "hinge":
        return jax.nn.relu(1 - beta * delta)
    per_token = chosen_logratios / jnp.maximum(chosen_tokens, 1.0) - rejected_logratios / jnp.maximum(
        rejected_tokens, 1.0
    )
    if loss_type == "ipo":
        return (per_token - 1 / (2 * beta)) ** 2
    if loss_type == "sigmoid_norm":
        return -log_sigmoid(beta * per_token)
    if loss_type == "sppo_hard":
        return (chosen_logratios - 0.5 / beta) ** 2 + (rejected_logratios + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - sigmoid(beta * chosen_logratios) + sigmoid(beta * rejected_logratios)
    if loss_type == "apo_down":
        return sigmoid(beta * chosen_logratios) + 1 - sigmoid(beta * delta)
    raise AssertionError(f"unknown loss type {loss_type}")  # the config validates it


def preference_rewards(
    loss_type: str,
    chosen_logps,
    rejected_logps,
    ref_chosen_logps,
    ref_rejected_logps,
    chosen_tokens,
    rejected_tokens,
    beta: float,
):
    """(chosen, rejected) implicit rewards, as TRL logs them (no gradient)."""
    if loss_type in MEAN_LOGP:
        chosen = beta * chosen_logps / jnp.maximum(chosen_tokens, 1.0)
        rejected = beta * rejected_logps / jnp.maximum(rejected_tokens, 1.0)
    else:
        chosen, rejected = beta * (chosen_logps - ref_chosen_logps), beta * (rejected_logps - ref_rejected_logps)
    return jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)

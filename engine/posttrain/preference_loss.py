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

`rpo_alpha` adds TRL's `sft` term (RPO): alpha times the mean NLL per chosen completion token.
Each loss is a mean over pairs. Metrics are TRL's: rewards/{chosen, rejected, margins,
accuracies} (beta x logratio; SimPO: beta x mean log-prob), logps/{chosen, rejected}.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

LossType = Literal["sigmoid", "robust", "hinge", "ipo", "sppo_hard", "apo_zero", "apo_down", "sigmoid_norm", "simpo"]
LOSS_TYPES: tuple[str, ...] = LossType.__args__
REFERENCE_FREE = ("simpo",)


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
):
    """(p,) losses of one preference loss type (module docstring)."""
    log_sigmoid, sigmoid = jax.nn.log_sigmoid, jax.nn.sigmoid
    if loss_type == "simpo":
        logits = chosen_logps / jnp.maximum(chosen_tokens, 1.0) - rejected_logps / jnp.maximum(rejected_tokens, 1.0)
        logits = logits - simpo_gamma / beta
        return -log_sigmoid(beta * logits) * (1 - label_smoothing) - log_sigmoid(-beta * logits) * label_smoothing
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
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
    if loss_type == "simpo":
        chosen = beta * chosen_logps / jnp.maximum(chosen_tokens, 1.0)
        rejected = beta * rejected_logps / jnp.maximum(rejected_tokens, 1.0)
    else:
        chosen, rejected = beta * (chosen_logps - ref_chosen_logps), beta * (rejected_logps - ref_rejected_logps)
    return jax.lax.stop_gradient(chosen), jax.lax.stop_gradient(rejected)

"""The pure core of training: what a stage minimises, and one optimizer step over it.

An `Objective` is a loss over one (micro-)batch plus how its metrics combine when the batch
is split for accumulation. Pretraining and SFT minimise `lm_objective`; GRPO/GSPO its
policy objective (engine/posttrain/grpo.py). `make_train_step` is the one accumulation
step all of them share; everything here is jit-able and free of I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import optax

from engine.models.lora import LORA_SEED, dropout_rows, join
from engine.models.params import apply_model_with_aux
from engine.ops.cross_entropy import log_z_and_target
from engine.train.lm_head import tiled_lm_terms

Reduction = Literal["sum", "mean", "max", "min"]
_COMBINE = {"sum": jnp.add, "mean": jnp.add, "max": jnp.maximum, "min": jnp.minimum}
_START = {"sum": 0.0, "mean": 0.0, "max": -jnp.inf, "min": jnp.inf}


@dataclasses.dataclass(frozen=True)
class Objective:
    """`loss_fn(params, batch, normaliser) -> (loss, aux)` over one micro-batch.

    `normaliser(batch)` is computed once from the whole batch before it is split, so a sum of
    micro-batch losses equals the loss of the whole batch exactly. Each aux metric combines
    over micro-batches by `reduce` (else `default`); `mean` divides the sum by their number.
    Aux must hold "loss" (the number logged and checked for finiteness).
    """

    loss_fn: Callable
    normaliser: Callable[[dict], jax.Array]
    reduce: dict[str, Reduction] = dataclasses.field(default_factory=dict)
    default: Reduction = "sum"


# --------------------------------------------------------------------------- language modelling


def cross_entropy(logits_btv, targets_bt, mask_bt, z_loss: float = 0.0):
    """(sum of masked NLL + z-loss terms, sum of masked NLL). Float32 throughout."""
    log_z_bt, target_logit_bt = log_z_and_target(logits_btv, targets_bt)
    return nll_sums(log_z_bt, target_logit_bt, mask_bt, z_loss)


def nll_sums(log_z_bt, target_logit_bt, mask_bt, z_loss: float = 0.0):
    """cross_entropy's sums from its per-token terms, log Z and the target's logit."""
    nll_sum = jnp.sum((log_z_bt - target_logit_bt) * mask_bt)
    total = nll_sum + z_loss * jnp.sum(jnp.square(log_z_bt) * mask_bt)
    return total, nll_sum


def lm_loss_fn(graphdef, z_loss: float = 0.0, loss_tiles: int = 1):
    """loss_fn(params, batch, normaliser) -> (loss, aux) for next-token prediction; with
    `loss_tiles` > 1 the LM head and the loss run over each row's positions in that many
    pieces (engine/train/lm_head.py)."""

    def loss_fn(params, batch, normaliser):
        with dropout_rows(batch.get(LORA_SEED)):  # a LoRA adapter's dropout, in training steps only
            if loss_tiles == 1:
                logits, moe = apply_model_with_aux(
                    graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"]
                )
                log_z, target_logit = log_z_and_target(logits, batch["targets"])
            else:
                log_z, target_logit, moe = tiled_lm_terms(graphdef, params, batch, loss_tiles)
        total, nll_sum = nll_sums(log_z, target_logit, batch["loss_mask"], z_loss)
        tokens = jnp.sum(batch["loss_mask"])
        aux = {"loss": nll_sum / normaliser, "nll_sum": nll_sum, "tokens": tokens}
        if not moe:
            return total / normaliser, aux
        # The router losses are a micro-batch's own, weighted by its share of the batch's
        # tokens: one micro-batch gives the batch's value; with accumulation their weighted
        # mean (the balancing loss, a product of means, is then per micro-batch).
        share = tokens / normaliser
        if "expert_load_e" in moe:
            aux.update(moe_metrics(moe, share))
        if "indexer_loss" in moe:  # sparse attention's indexer KL (engine/models/dsa.py), weighted alike
            aux["indexer_loss"] = share * moe["indexer_loss"]
        return total / normaliser + share * moe["aux_loss"], aux

    return loss_fn


def moe_metrics(moe: dict, share) -> dict:
    """A mixture of experts' router losses and per-expert loads (shares of the assignments,
    1/E each when balanced) as scalar metrics, each weighted by `share` (the micro-batch's
    share of the batch's tokens), so the default "sum" over micro-batches is their mean."""
    load_e = moe["expert_load_e"]
    metrics = {
        "moe_balance_loss": moe["balance_loss"],
        "moe_router_z_loss": moe["router_z_loss"],
        "moe_load_max": jnp.max(load_e) * load_e.shape[0],
    }
    metrics.update({f"moe_load/{e}": load_e[e] for e in range(load_e.shape[0])})
    if "mtp_loss" in moe:  # the multi-token-prediction layer's (engine/models/mtp.py)
        metrics["mtp_loss"] = moe["mtp_loss"]
    return {k: v * share for k, v in metrics.items()}


def token_count(batch) -> jax.Array:
    """The normaliser of token-mean losses: the batch's target tokens (at least 1)."""
    return jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)


def lm_objective(graphdef, z_loss: float = 0.0, loss_tiles: int = 1) -> Objective:
    """Next-token cross-entropy, a mean over every target token of the batch (pretrain, SFT)."""
    return Objective(lm_loss_fn(graphdef, z_loss, loss_tiles), token_count)


# --------------------------------------------------------------------------- steps


def make_train_step(objective: Objective, tx: optax.GradientTransformation, grad_accum: int):
    """train_step(params, opt_state, batch[, base]) -> (params, opt_state, metrics).

    With `base` the objective sees params and the frozen base side by side (a LoRA adapter
    and its base model, engine/models/lora.py); only params are differentiated and updated.

    With grad_accum > 1 the batch is split into micro-batches (rows i, i+A, i+2A, ... so
    each stays evenly sharded) and their losses and gradients are summed under one scan.
    Metrics: "objective" (the minimised loss), "grad_norm" and the objective's aux.
    """

    def train_step(params, opt_state, batch, base=None):
        loss_fn = objective.loss_fn if base is None else (lambda p, b, n: objective.loss_fn(join(p, base), b, n))
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        normaliser = objective.normaliser(batch)
        if grad_accum == 1:
            (loss, aux), grads = grad_fn(params, batch, normaliser)
        else:
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // grad_accum, grad_accum, *x.shape[1:]).swapaxes(0, 1), batch
            )
            aux_shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), normaliser)[0][1]
            how = {k: objective.reduce.get(k, objective.default) for k in aux_shapes}
            start = (
                jnp.zeros(()),
                {k: jnp.full(s.shape, _START[how[k]], s.dtype) for k, s in aux_shapes.items()},
                jax.tree.map(jnp.zeros_like, params),
            )

            def body(carry, mb):
                loss, aux, grads = carry
                (mb_loss, mb_aux), mb_grads = grad_fn(params, mb, normaliser)
                aux = {k: _COMBINE[how[k]](v, mb_aux[k]) for k, v in aux.items()}
                return (loss + mb_loss, aux, jax.tree.map(jnp.add, grads, mb_grads)), None

            (loss, aux, grads), _ = jax.lax.scan(body, start, micro)
            aux = {k: v / grad_accum if how[k] == "mean" else v for k, v in aux.items()}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**aux, "objective": loss, "grad_norm": optax.tree.norm(grads)}

    return train_step


def make_eval_step(objective: Objective):
    """eval_step(params, batch[, base]) -> aux with the sums (normaliser 1) of a held-out batch."""

    def eval_step(params, batch, base=None):
        _, aux = objective.loss_fn(params if base is None else join(params, base), batch, 1.0)
        return aux

    return eval_step

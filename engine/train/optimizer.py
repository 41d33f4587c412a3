"""optax optimizer and learning-rate schedules."""

from __future__ import annotations

import re

import jax
import optax

from engine.train.config import OptimizerConfig, ScheduleConfig


def learning_rate_schedule(opt: OptimizerConfig, sched: ScheduleConfig, total_steps: int) -> optax.Schedule:
    peak = opt.learning_rate
    floor = peak * sched.final_lr_fraction
    warmup = min(sched.warmup_steps, total_steps)
    if sched.kind == "constant":
        main = optax.constant_schedule(peak)
    elif sched.kind == "cosine":
        main = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1), alpha=sched.final_lr_fraction)
    else:  # wsd: warmup, a long stable phase, then a linear decay to the floor
        decay_steps = max(int(round(total_steps * sched.decay_fraction)), 1)
        stable_steps = max(total_steps - warmup - decay_steps, 0)
        main = optax.join_schedules(
            [optax.constant_schedule(peak), optax.linear_schedule(peak, floor, decay_steps)],
            boundaries=[stable_steps],
        )
    if warmup == 0:
        return main
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], boundaries=[warmup])


# Biases (bq_nh, bo_d, b_router_e, b_gate_ef, ...) and attention sinks: per-unit offsets, not
# matrices, whatever their rank (stacked layers and experts add axes).
_NOT_MATRICES = re.compile(r"^(b[a-z]?_|bias$|scale$|sinks_)")


def weight_decay_mask(params, decay_norms_and_embeddings: bool):
    """True for the leaves that get weight decay: matrices, not embeddings, norms, biases or
    attention sinks (unless decay_norms_and_embeddings: every leaf)."""

    def decide(path, leaf) -> bool:
        if decay_norms_and_embeddings:
            return True
        names = [str(getattr(p, "key", p)) for p in path]
        if any(n.startswith("embed") for n in names) or _NOT_MATRICES.match(names[-1]) or "norm" in names[-2:-1]:
            return False
        return leaf.ndim >= 2

    return jax.tree_util.tree_map_with_path(decide, params)


def make_optimizer(opt: OptimizerConfig, sched: ScheduleConfig, total_steps: int, params) -> tuple:
    """(optax transformation, schedule). Clipping happens before the Adam moments."""
    schedule = learning_rate_schedule(opt, sched, total_steps)
    parts = []
    if opt.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(opt.grad_clip_norm))
    parts.append(
        optax.adamw(
            schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps, weight_decay=opt.weight_decay,
            mask=weight_decay_mask(params, opt.decay_norms_and_embeddings),
        )
    )
    return optax.chain(*parts), schedule

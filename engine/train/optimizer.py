"""optax optimizer and learning-rate schedules."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
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
# matrices, whatever their rank (stacked layers and experts add axes); hash routing's table
# (hash_experts_vk, moe.py) is no weight (frozen: no gradient, so no update without decay).
_NOT_MATRICES = re.compile(r"^(b[a-z]?_|bias$|scale$|sinks_|hash_)")


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


ROUTER_BIAS = "b_router_e"
"""The choosing bias of a router (engine/models/moe.py); its gradient is the layer's load
imbalance (assignments per expert minus their mean), not a loss gradient."""


def router_bias_update(inner: optax.GradientTransformation, params, rate: float) -> optax.GradientTransformation:
    """`inner` for every leaf but the routers' choosing biases, which move by -rate * sign of
    their load imbalance (DeepSeek-V3's auxiliary-loss-free balancing: an overloaded expert's
    bias goes down). `inner` sees zeros there, so clipping, Adam and its state are those of the
    other leaves alone, and the state's layout is `inner`'s."""
    is_bias = jax.tree_util.tree_map_with_path(
        lambda path, _: str(getattr(path[-1], "key", path[-1])) == ROUTER_BIAS, params
    )

    def update(grads, state, params=None):
        zeroed = jax.tree.map(lambda g, b: jnp.zeros_like(g) if b else g, grads, is_bias)
        updates, state = inner.update(zeroed, state, params)
        updates = jax.tree.map(
            lambda u, g, b: (-rate * jnp.sign(g)).astype(u.dtype) if b else u, updates, grads, is_bias
        )
        return updates, state

    return optax.GradientTransformation(inner.init, update)


def train_only(inner: optax.GradientTransformation, params, trained: str) -> optax.GradientTransformation:
    """`inner` over the leaves whose path names `trained` (a module name: "indexer"); every
    other leaf gets a zero gradient going in (so clipping sees only the trained ones) and a
    zero update coming out (no weight decay either): frozen, the state's layout unchanged."""
    keep = jax.tree_util.tree_map_with_path(
        lambda path, _: any(str(getattr(p, "key", p)) == trained for p in path), params
    )

    def update(grads, state, params=None):
        grads = jax.tree.map(lambda g, k: g if k else jnp.zeros_like(g), grads, keep)
        updates, state = inner.update(grads, state, params)
        return jax.tree.map(lambda u, k: u if k else jnp.zeros_like(u), updates, keep), state

    return optax.GradientTransformation(inner.init, update)


def _floats_to(tree, dtype):
    """`tree` with its floating-point leaves in `dtype` (an optimizer state's counts stay integers)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def moments_in(inner: optax.GradientTransformation, dtype: str) -> optax.GradientTransformation:
    """`inner` (clipping and AdamW) with its moments stored in `dtype` and its update computed in
    float32 (MaxText's way): the gradients, the moments and (for the weight decay) the
    parameters cast up going in, the moments rounded down coming out, once per step (optax's
    mu_dtype rounds the first moment; its second follows the state's dtype, hence the casts
    here). The updates leave in float32; optax.apply_updates rounds each parameter's sum to
    its own dtype."""
    stored = jnp.dtype(dtype)

    def init(params):
        return _floats_to(inner.init(params), stored)

    def update(grads, state, params=None):
        wide = lambda tree: None if tree is None else _floats_to(tree, jnp.float32)  # noqa: E731
        updates, state = inner.update(wide(grads), wide(state), wide(params))  # params: the weight decay's
        return updates, _floats_to(state, stored)

    return optax.GradientTransformation(init, update)


def state_on_devices(inner: optax.GradientTransformation, shardings) -> optax.GradientTransformation:
    """`inner` with its state kept in the hosts' memory between steps (the step's pinned_host
    shardings, OptimizerConfig.host_offload) and brought to the devices, laid out by
    `shardings`, for the update alone."""

    def update(grads, state, params=None):
        return inner.update(grads, jax.device_put(state, shardings), params)

    return optax.GradientTransformation(inner.init, update)


def make_optimizer(
    opt: OptimizerConfig, sched: ScheduleConfig, total_steps: int, params, *, only: str | None = None
) -> tuple:
    """(optax transformation, schedule). Clipping happens before the Adam moments, which are
    stored in opt.moment_dtype where it is set (moments_in). `only`:
    train just the leaves under that module name (train_only; the sparse-attention indexer's
    dense warm-up, ComputeConfig.indexer_loss)."""
    schedule = learning_rate_schedule(opt, sched, total_steps)
    parts = []
    if opt.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(opt.grad_clip_norm))
    parts.append(
        optax.adamw(
            schedule,
            b1=opt.b1,
            b2=opt.b2,
            eps=opt.eps,
            weight_decay=opt.weight_decay,
            mask=weight_decay_mask(params, opt.decay_norms_and_embeddings),
            mu_dtype=opt.moment_dtype,
        )
    )
    tx = optax.chain(*parts)
    tx = tx if opt.moment_dtype is None else moments_in(tx, opt.moment_dtype)
    has_bias = any(
        str(getattr(path[-1], "key", path[-1])) == ROUTER_BIAS
        for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )
    tx = router_bias_update(tx, params, opt.router_bias_update_rate) if has_bias else tx
    return (tx if only is None else train_only(tx, params, only)), schedule

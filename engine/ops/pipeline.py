"""Pipeline parallelism over a stack of layers: the GPipe schedule as MaxText runs it, over
the `pipeline` mesh axis (engine/ops/partitioning.py: PIPELINE_AXIS).

The stacked parameters keep their `[layers, ...]` layout (so a checkpoint does not depend on
the number of stages); their `layers` axis is sharded over `pipeline`, and here each stack is
seen as `[stages, layers / stages, ...]`: stage s holds layers s * L / S ... (s + 1) * L / S - 1.
One function runs a stage (its layers in turn, a scan), vmapped over the stage axis with
`spmd_axis_name="pipeline"`, so each device of the axis runs its own stage on its own slot of
a state `[stages, micro_rows, ...]`. Each iteration

    1. puts micro-batch i into stage 0's slot (micro-batches past the last: a repeat, unused),
    2. runs every stage on its slot: stage s works on micro-batch i - s,
    3. keeps the last stage's output (micro-batch i - S + 1) and shifts the state one stage on
       (`jnp.roll` over a dimension sharded on `pipeline`: one collective-permute).

M micro-batches take M + S - 1 iterations; autodiff runs them backward in reverse. Each stage
works on M of them and idles (computes on a slot whose result is never read) for S - 1: the
bubble is (S - 1) / (M + S - 1) of the step's layer time, forward and backward alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from engine.config import ConfigError
from engine.ops.partitioning import PIPELINE_AXIS, constrain, current_mesh


def pipeline_stages() -> int:
    """The number of stages of the current mesh's `pipeline` axis (1 without one)."""
    mesh = current_mesh()
    return dict(mesh.shape).get(PIPELINE_AXIS, 1) if mesh is not None else 1


def bubble(stages: int, microbatches: int) -> float:
    """GPipe's idle share of each stage: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def gpipe(
    stage_fn: Callable[[Any, jax.Array, Any], jax.Array],
    stacked: Any,
    x_btd: jax.Array,
    rows: Any,
    *,
    stages: int,
    microbatches: int,
) -> jax.Array:
    """`x_btd` through every layer of `stacked` (a tree of arrays with a leading layer axis),
    as `stages` stages over `microbatches` micro-batches of its rows.

    stage_fn(stage_stacked, x_mtd, stage_rows) -> x_mtd runs one stage's layers (its slice of
    `stacked`, leading axis layers / stages) on one micro-batch; `rows` is a tree of per-row
    arrays (b, ...) (positions, segment ids; None leaves allowed), each stage gets its
    micro-batch's rows of them.
    """
    batch = x_btd.shape[0]
    if batch % microbatches:
        raise ConfigError(
            f"compute.pipeline_microbatches ({microbatches}) must divide the rows of each batch ({batch})"
        )
    micro_rows = batch // microbatches

    def by_stage(a):  # [L, ...] -> [S, L / S, ...]: consecutive layers per stage
        return a.reshape(stages, a.shape[0] // stages, *a.shape[1:])

    staged = jax.tree.map(by_stage, stacked)
    x_mbtd = x_btd.reshape(microbatches, micro_rows, *x_btd.shape[1:])
    rows_m = jax.tree.map(lambda a: a.reshape(microbatches, micro_rows, *a.shape[1:]), rows)
    run = jax.vmap(stage_fn, spmd_axis_name=PIPELINE_AXIS)
    stage_ids = jnp.arange(stages)
    first = (stage_ids == 0).reshape(stages, *[1] * x_btd.ndim)
    names = ("act_stage", "act_batch", "act_seq", "act_embed")

    def iteration(carry, i):
        state_sbtd, out_mbtd = carry
        feed_btd = jax.lax.dynamic_index_in_dim(x_mbtd, jnp.minimum(i, microbatches - 1), keepdims=False)
        state_sbtd = constrain(jnp.where(first, feed_btd[None], state_sbtd), names)
        micro = jnp.clip(i - stage_ids, 0, microbatches - 1)  # the micro-batch each stage works on
        stage_rows = jax.tree.map(lambda a: a[micro], rows_m)
        y_sbtd = constrain(run(staged, state_sbtd, stage_rows), names)
        # The last stage finished micro-batch i - S + 1; before it has one, slot 0 is written
        # and overwritten later with the real one.
        done = jnp.maximum(i - (stages - 1), 0)
        out_mbtd = jax.lax.dynamic_update_index_in_dim(out_mbtd, y_sbtd[stages - 1], done, 0)
        return (jnp.roll(y_sbtd, 1, axis=0), out_mbtd), None

    state_sbtd = constrain(jnp.zeros((stages, micro_rows, *x_btd.shape[1:]), x_btd.dtype), names)
    carry = (state_sbtd, jnp.zeros_like(x_mbtd))
    (_, out_mbtd), _ = jax.lax.scan(iteration, carry, jnp.arange(microbatches + stages - 1))
    return constrain(out_mbtd.reshape(x_btd.shape), ("act_batch", "act_seq", "act_embed"))

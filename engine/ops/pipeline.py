"""Pipeline parallelism over a stack of layers: the GPipe schedule as MaxText runs it
(maxtext/layers/pipeline.py), over the `pipeline` mesh axis (engine/ops/partitioning.py:
PIPELINE_AXIS).

The stacked parameters keep their `[layers, ...]` layout (so a checkpoint does not depend on
the number of stages); their `layers` axis is sharded over `pipeline`, and here each stack is
seen as `[stages, layers / stages, ...]`: stage s holds layers s * L / S ... (s + 1) * L / S - 1.
One function runs a stage (its layers in turn, a scan), vmapped over the stage axis with
`spmd_axis_name="pipeline"`, so each device of the axis runs its own stage on its own slot of
a state `[stages, micro_rows, ...]`.

Outside the stages a batch's rows are split over `pipeline` as over the batch axes (the
`act_batch` rule), so the embedding and the head each run once, not once per stage. Its M
micro-batches stay where the rows are: an `io` buffer `[stages, M / S, micro_rows, ...]`
sharded over `pipeline` (MaxText's state_io), stage s holding micro-batches s * M / S ...
(s + 1) * M / S - 1 (micro-batch s * M / S + j is rows s * B / S + r * M / S + j, r < micro_rows:
each device's rows stay on it). Each iteration i

    1. stage 0 takes its io column i % (M / S) (micro-batch i), the others the state,
    2. every stage runs on its slot: stage s works on micro-batch i - s,
    3. the state moves one stage on (a collective-permute over `pipeline`, stage s to s + 1),
       and the io column one stage back toward stage 0 (another, s + 1 to s), the last
       stage's output (micro-batch i - S + 1) taking the slot it leaves: micro-batch m ends at
       stage m // (M / S), column (m + S - 1) % (M / S).

So only activations cross the stage boundary: per iteration one micro-batch slot each way over
each boundary, forward and backward (the hand-offs do not wrap around, so unlike a roll no
device sends what the next iteration discards); the weights never cross it. The rows'
positions and segment ids travel the same way. M micro-batches take M + S - 1 iterations;
autodiff runs them backward in reverse. Each stage works on M of them and idles (computes on
a slot whose result is never read) for S - 1: the
bubble is (S - 1) / (M + S - 1) of the step's layer time, forward and backward alike.

MaxText's circular schedule (num_pipeline_repeats: stage s runs layer chunks s, s + S, ...)
would need each stage to hold every S-th chunk of layers, not consecutive ones: a different
layout of the `[layers, ...]` stacks (and of a checkpoint) per degree, which this one keeps
independent of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from engine.config import ConfigError
from engine.ops.partitioning import PIPELINE_AXIS, activation_spec, constrain, current_mesh, within_stages


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
    if microbatches % stages:
        raise ConfigError(
            f"compute.pipeline_microbatches ({microbatches}) must be a multiple of mesh.pipeline ({stages})"
        )
    if batch % microbatches:
        raise ConfigError(
            f"compute.pipeline_microbatches ({microbatches}) must divide the rows of each batch ({batch})"
        )
    per_stage, micro_rows = microbatches // stages, batch // microbatches

    def to_io(a):  # [b, ...] -> [S, M / S, micro_rows, ...]: a device's rows stay on it
        return jnp.swapaxes(a.reshape(stages, micro_rows, per_stage, *a.shape[1:]), 1, 2)

    def by_stage(a):  # [L, ...] -> [S, L / S, ...]: consecutive layers per stage
        return a.reshape(stages, a.shape[0] // stages, *a.shape[1:])

    stage_ids = jnp.arange(stages)

    def at(mask_s, a, b):  # a where the stage's mask holds, else b
        return jnp.where(mask_s.reshape(stages, *[1] * (a.ndim - 1)), a, b)

    mesh = current_mesh()
    assert mesh is not None, "pipeline stages run under a mesh with a pipeline axis"
    names = ("act_stage", "act_batch", "act_seq", "act_embed")
    io_names = ("act_stage", None, "act_batch", "act_seq", "act_embed")
    staged = jax.tree.map(by_stage, stacked)
    run = jax.vmap(stage_fn, spmd_axis_name=PIPELINE_AXIS)

    # Each hand-off goes one way and does not wrap around (this is not the circular schedule):
    # a ppermute from stage s to s + 1 (or back) over the pipeline axis, the end without a
    # neighbour keeping `fill` (stage 0's state slot is never read: it takes the column).
    def shift(a, fill, step: int):
        spec = activation_spec(a.shape, names[: a.ndim], mesh)
        pairs = [(s, s + step) for s in range(stages) if 0 <= s + step < stages]
        moved = jax.shard_map(
            lambda x: jax.lax.ppermute(x, PIPELINE_AXIS, pairs), mesh=mesh, in_specs=spec, out_specs=spec
        )(a)
        return at(stage_ids == (0 if step > 0 else stages - 1), fill, moved)

    def iteration(carry, i):
        io, rows_io, state, state_rows = carry
        column = i % per_stage
        stream = jax.lax.dynamic_index_in_dim(io, column, 1, keepdims=False)
        stream_rows = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, column, 1, keepdims=False), rows_io)
        x_in = constrain(at(stage_ids == 0, stream, state), names)
        rows_in = jax.tree.map(lambda a, b: at(stage_ids == 0, a, b), stream_rows, state_rows)
        y = constrain(run(staged, x_in, rows_in), names)
        # the column moves one stage toward stage 0; the last stage's output takes its place
        io = jax.lax.dynamic_update_index_in_dim(io, shift(stream, y, -1), column, 1)
        rows_io = jax.tree.map(
            lambda a, s: jax.lax.dynamic_update_index_in_dim(a, shift(s, s, -1), column, 1), rows_io, stream_rows
        )
        state_rows = jax.tree.map(lambda a: shift(a, a, 1), rows_in)
        return (io, rows_io, shift(y, y, 1), state_rows), None

    with within_stages():
        io = constrain(to_io(x_btd), io_names)
        rows_io = jax.tree.map(lambda a: constrain(to_io(a), io_names[: a.ndim + 2]), rows)
        state = constrain(jnp.zeros((stages, micro_rows, *x_btd.shape[1:]), x_btd.dtype), names)
        state_rows = jax.tree.map(lambda a: jnp.zeros_like(a[:, 0]), rows_io)
        carry = (io, rows_io, state, state_rows)
        (io, _, _, _), _ = jax.lax.scan(iteration, carry, jnp.arange(microbatches + stages - 1))
        # micro-batch s * M / S + j finished in column (j + S - 1) % (M / S) of stage s
        io = constrain(jnp.roll(io, -((stages - 1) % per_stage), axis=1), io_names)
    out_btd = jnp.swapaxes(io, 1, 2).reshape(x_btd.shape)
    return constrain(out_btd, ("act_batch", "act_seq", "act_embed"))
